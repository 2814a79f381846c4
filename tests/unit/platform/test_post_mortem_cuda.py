"""The OOM post-mortem on a real GPU: a CUDA OOM provoked with
``torch.cuda.set_per_process_memory_fraction`` after an Adam step of a model made on the
device under ``hook_into_python(ops=True)``.  The post-mortem must attribute at least 95%
of the caching allocator's allocated bytes (``torch.cuda.memory_stats``, the outside
reference) to tracked storages, its blocks must add up to that figure, the driver's view
must match ``torch.cuda.mem_get_info``, and the pickle (torch's own
``torch.cuda.memory._snapshot()``) must be read by torch's memory_viz.

It runs in a fresh Python process: the fraction is process-wide, and a suite's other tests
leave CUDA blocks that no lord of this test tracks.  Marked ``cuda``; skips itself without
a GPU (tools/gpu_check.sh runs it alone too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = textwrap.dedent(
    """
    import pickle, sys
    import torch
    import torch.cuda._memory_viz as memory_viz
    from torch import nn
    from memlord import MemLord
    from memlord.report._postmortem import build_post_mortem, load_post_mortem, write_post_mortem

    out_dir = sys.argv[1]
    torch.cuda.init()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        model = nn.Sequential(*[nn.Linear(4096, 4096, device="cuda") for _ in range(8)])
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(64, 4096, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        limit = torch.cuda.memory_reserved(0) + (256 << 20)
        torch.cuda.set_per_process_memory_fraction(limit / total, 0)
        try:
            torch.empty(1 << 30, device="cuda")  # 4 GiB
        except torch.cuda.OutOfMemoryError as exc:
            error = str(exc)
        else:
            raise SystemExit("no OOM")
        doc = build_post_mortem(
            [lord],
            {"device": "cuda:0", "bytes": 4 << 30, "what": "torch.empty", "source": "factory",
             "error": error},
        )
    d = doc["devices"]["cuda:0"]
    alloc, seg, drv = d["allocator"], d["segments"], d["driver"]
    theirs = torch.cuda.memory_stats(0)["allocated_bytes.all.current"]
    print("allocated", theirs, "attributed", seg["attributed"], "untracked", seg["untracked"],
          "fraction", seg["attributed_fraction"], "other processes", drv["other_processes"])
    print("untracked blocks", seg["untracked_blocks"][:5])
    print("notes", doc["notes"])
    assert alloc["allocated"] == theirs, (alloc, theirs)
    assert seg["allocated"] == theirs, (seg["allocated"], theirs)
    assert seg["attributed"] >= 0.95 * theirs, seg
    # cuBLAS's workspaces, named by their size: what torch releases as workspaces
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    torch._C._cuda_clearCublasWorkspaces()
    released = before - torch.cuda.memory_allocated(0)
    print("library workspaces", seg["library_workspaces"], "released", released)
    assert seg["library_workspaces"]["bytes"] == released, (seg["library_workspaces"], released)
    assert seg["explained"] == seg["attributed"] + released
    assert alloc["ooms"] >= 1, alloc
    free, tot = torch.cuda.mem_get_info(0)
    assert drv["total"] == tot and drv["reserved"] == torch.cuda.memory_reserved(0), drv
    assert drv["other_processes"] == max(tot - drv["free"] - drv["reserved"], 0)
    names = {e["name"] for e in d["largest"]}
    for n in ("0.weight", "grad of 0.weight", "optimizer state exp_avg of 0.weight"):
        assert n in names, names
    held = {r["name"] for r in seg["by_storage"]["top"]}
    assert "0.weight" in held, held
    assert doc["pickle_source"] == "torch.cuda.memory._snapshot()"
    paths = write_post_mortem(doc, out_dir, "pm")
    assert set(paths) == {"json", "html", "pickle"}, paths
    back = load_post_mortem(paths["json"])["devices"]["cuda:0"]["segments"]
    assert back["attributed"] == seg["attributed"]
    snap = pickle.loads(open(paths["pickle"], "rb").read())
    assert "segments:" in memory_viz.segsum(snap)
    print("ok")
    """
)


def test_a_cuda_oom_post_mortem_attributes_95_percent_of_allocated_bytes(tmp_path):
    env = {**os.environ}
    env.pop("MEMLORD_CUDA_DRIVER", None)  # the real driver
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.rstrip().endswith("ok"), out.stdout
    print(out.stdout)  # the figures, for tools/gpu_check.sh's log (run alone with -rP)
