"""Out of memory on a real GPU (issue 28, item 6): an OOM provoked with
``torch.cuda.set_per_process_memory_fraction`` is counted once (torch's OOM observer
reports it, the hook it then leaves does not count it again), as torch's own
``num_ooms`` counts it; the post-mortem attributes at least 95% of the caching
allocator's allocated bytes to storages memlord tracks and cuBLAS's workspaces (named by
their size, the bytes ``torch._C._cuda_clearCublasWorkspaces()`` releases);
``retry_on_oom`` recovers a step that fits once the failed attempt's memory is released;
the current device is unchanged.

Marked ``cuda``; skips itself without a GPU (tools/gpu_check.sh runs it alone too).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from support.cuda import library_workspace_bytes
from torch import nn

import memlord
from memlord import MemLord

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FRACTION = 0.05  # of the device: a few GiB on an H100


@pytest.fixture
def small_gpu():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    device = torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(FRACTION, device)
    try:
        yield device
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        gc.collect()
        torch.cuda.empty_cache()


def _budget(device):
    return int(torch.cuda.get_device_properties(device).total_memory * FRACTION)


def test_oom_counted_once_with_a_post_mortem(small_gpu, tmp_path):
    device = small_gpu
    before = torch.cuda.memory_stats(device).get("num_ooms", 0)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python(ops=True):
        watch = lord.watch_oom(tmp_path)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(64, 2048, device="cuda")).sum().backward()
        opt.step()
        torch.cuda.synchronize()
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(_budget(device), dtype=torch.uint8, device="cuda")
        allocated = torch.cuda.memory_allocated(device)
        watch.disable()
        # the cuBLAS workspaces (no storage: untracked blocks), measured by torch
        workspaces = library_workspace_bytes(device)
    assert torch.cuda.current_device() == device
    assert torch.cuda.memory_stats(device)["num_ooms"] == before + 1
    assert lord.stats()[f"cuda:{device}"]["ooms"] == 1
    assert len(watch.written) == 1
    doc = json.loads(open(watch.written[0]["json"]).read())
    assert doc["request"]["bytes"] >= _budget(device)
    assert doc["request"]["device"] == f"cuda:{device}"
    seg = doc["devices"][f"cuda:{device}"]["segments"]
    assert seg is not None, doc["notes"]
    print(  # the figures, for tools/gpu_check.sh's log (run alone with -rP)
        f"allocated {allocated} attributed {seg['attributed']} workspaces released "
        f"{workspaces} named {seg['library_workspaces']} explained {seg['explained']} "
        f"({seg['explained'] / allocated:.4f}) unexplained {seg['unexplained']}"
    )
    assert seg["attributed"] >= 0.95 * (allocated - workspaces), (seg, allocated, workspaces)
    assert seg["untracked"] >= workspaces, (seg, workspaces)
    # the workspaces named by their size are exactly what torch releases as workspaces, and
    # with them the post-mortem explains at least 95% of every allocated byte
    assert seg["library_workspaces"]["bytes"] == workspaces, (seg, workspaces)
    assert seg["explained"] >= 0.95 * allocated, (seg, allocated)
    assert doc["request"]["source"] == "allocator"  # the observer wrote it, once
    del model, opt


def test_retry_on_oom_recovers_after_release(small_gpu):
    device = small_gpu
    budget = _budget(device)
    attempts = []

    class Holder:
        pass

    def step():
        attempts.append(torch.cuda.memory_allocated(device))
        if len(attempts) == 1:
            # garbage kept only by a reference cycle, then a request that does not fit
            a, b = Holder(), Holder()
            a.b, b.a = b, a
            a.t = torch.empty(budget // 2, dtype=torch.uint8, device="cuda")
        return torch.empty(budget // 2 + (1 << 20), dtype=torch.uint8, device="cuda")

    gc.collect()
    gc.disable()  # only retry_on_oom collects
    try:
        lord = MemLord(auto_gc_bytes=None)
        with lord.hook_into_python():
            out = memlord.retry_on_oom(step, backoff=0)
    finally:
        gc.enable()
    assert out.numel() == budget // 2 + (1 << 20)
    assert len(attempts) == 2
    assert torch.cuda.current_device() == device
    del out
