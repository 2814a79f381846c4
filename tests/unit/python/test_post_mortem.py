"""The out-of-memory post-mortem (memlord.report._postmortem, docs/oom.md): who holds every
byte when a request fails.

A real OOM on the CPU: ``torch.empty(1 << 50)`` (4 PiB), which the CPU allocator refuses at
once, after one Adam training step of a small model under ``hook_into_python(ops=True)``.
The post-mortem is checked against the model itself (its parameters, gradients and
optimizer state, sized with ``numel() * element_size()``), torch's memory_viz reads the
pickle, and the files are checked on the real file system.  The CUDA attribution
(allocator blocks to tracked storages) is a pure function of torch's snapshot format,
tested here on hand-built segments; the real-GPU check is in tools/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from support.memory_viz import blocks_at, page_live_bytes, trace_live_allocations
from torch import nn

from memlord import MemLord
from memlord.report._postmortem import (
    SCHEMA,
    attribute_blocks,
    build_post_mortem,
    default_stem,
    load_post_mortem,
    render_html,
    synthetic_snapshot,
    write_post_mortem,
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _oom() -> str:
    """A real OOM: the CPU allocator refuses 4 PiB at once."""
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 50)
    return str(info.value)


class Work:
    """One training step of a small model with Adam, under a lord with lifetime tracking
    and ops=True, then a real OOM and its post-mortem."""

    def __init__(self, track: bool) -> None:
        torch.manual_seed(0)
        self.lord = lord = MemLord()
        with lord.hook_into_python(ops=True):
            self.model = model = nn.Sequential(
                nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 8)
            )
            self.opt = opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            tracker = lord.track_modules(model) if track else None
            x = torch.randn(32, 64)
            self.out = model(x)  # kept: an activation alive at the OOM
            loss = self.out.square().mean()
            loss.backward()
            opt.step()
            self.error = _oom()
            self.doc = build_post_mortem(
                [lord],
                {
                    "device": "cpu",
                    "bytes": (1 << 50) * 4,
                    "what": "torch.empty",
                    "source": "factory",
                    "site": "test_post_mortem.py:1",
                    "stack": [{"file": __file__, "line": 1, "function": "step"}],
                    "error": self.error,
                },
            )
            self.stats = lord.stats()  # the lord's own figures at the same moment
            if tracker is not None:
                tracker.disable()

    def expected(self) -> dict[str, int]:
        params = sum(_nbytes(p) for p in self.model.parameters())
        grads = sum(_nbytes(p.grad) for p in self.model.parameters())
        state = sum(
            _nbytes(v)
            for st in self.opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return {"parameter": params, "gradient": grads, "optimizer_state": state}


@pytest.fixture(params=[False, True], ids=["object-scan", "track_modules"])
def work(request):
    return Work(track=request.param)


def test_categories_match_the_models_own_bytes(work):
    doc = work.doc
    assert doc["schema"] == SCHEMA
    cpu = doc["devices"]["cpu"]
    exp = work.expected()
    for cat, n in exp.items():
        assert cpu["categories"][cat] == n, cat
        assert {r["name"]: r["bytes"] for r in cpu["by_category"]["top"]}[cat] == n
    assert cpu["categories"]["activation"] >= _nbytes(work.out)
    # the ledger and the registry agree, and equal the lord's own figure
    assert cpu["tracked"]["bytes"] == work.stats["cpu"]["allocated"]
    assert cpu["ledger"]["allocated"] == cpu["tracked"]["bytes"]
    assert sum(cpu["categories"].values()) == cpu["tracked"]["bytes"]


def test_at_least_99_percent_of_live_bytes_carry_a_category_and_a_site(work):
    cov = work.doc["devices"]["cpu"]["coverage"]
    assert cov["bytes"] > 0
    assert cov["with_category"] >= 0.99 * cov["bytes"]
    assert cov["with_site"] >= 0.99 * cov["bytes"]
    # parameters, gradients and optimizer state are named: all of them
    assert cov["named"] >= sum(work.expected().values())


def test_the_largest_storages_are_named_as_a_person_knows_them(work):
    doc = work.doc
    largest = {e["name"]: e for e in doc["devices"]["cpu"]["largest"]}
    name, p = max(work.model.named_parameters(), key=lambda kv: _nbytes(kv[1]))
    assert name == "2.weight"  # 256 x 128
    assert largest[name]["nbytes"] == _nbytes(p)
    assert largest[name]["category"] == "parameter"
    assert largest[f"grad of {name}"]["nbytes"] == _nbytes(p.grad)
    assert largest[f"grad of {name}"]["category"] == "gradient"
    for key in ("exp_avg", "exp_avg_sq"):
        e = largest[f"optimizer state {key} of {name}"]
        assert e["nbytes"] == _nbytes(work.opt.state[p][key])
        assert e["category"] == "optimizer_state"
    # every row has a site where memlord saw it born, relative to the working directory
    assert all(e["site"] for e in doc["devices"]["cpu"]["largest"])
    assert len(doc["devices"]["cpu"]["largest"]) == 20


def test_activations_are_named_by_the_module_that_made_them():
    work = Work(track=True)
    names = [e["name"] for e in work.doc["devices"]["cpu"]["largest"]]
    assert any(re.fullmatch(r"activation of \d \(forward\)", n) for n in names), names
    modules = {r["name"] for r in work.doc["devices"]["cpu"]["by_module"]["top"]}
    assert {"0", "2", "4"} <= modules


def test_the_request_is_kept_as_given(work):
    req = work.doc["request"]
    assert req["device"] == "cpu"
    assert req["bytes"] == 1 << 52
    assert req["bytes_text"] == "4 PiB"
    assert req["what"] == "torch.empty" and req["source"] == "factory"
    assert req["error"] == work.error and "alloc" in req["error"].lower()
    assert req["stack"] == [{"file": __file__, "line": 1, "function": "step"}]
    assert req["thread"]["name"] == "MainThread"
    assert work.doc["pid"] == os.getpid()
    assert work.doc["rank"] is None
    assert work.doc["notes"] == []


def test_tables_are_bounded_by_top_and_sum_to_the_live_bytes():
    work = Work(track=False)
    doc = build_post_mortem([work.lord], {"device": "cpu"}, top=2)
    cpu = doc["devices"]["cpu"]
    assert len(cpu["largest"]) == 2
    for key in ("by_site", "by_module", "by_region"):
        t = cpu[key]
        assert len(t["top"]) <= 2
        assert sum(r["bytes"] for r in t["top"]) + t["rest"]["bytes"] == cpu["tracked"]["bytes"]
    with pytest.raises(ValueError, match="top"):
        build_post_mortem([work.lord], {}, top=-1)
    with pytest.raises(TypeError, match="top"):
        build_post_mortem([work.lord], {}, top="3")
    with pytest.raises(TypeError, match="request"):
        build_post_mortem([work.lord], "cpu")


def test_without_lifetime_tracking_the_document_says_what_it_lacks():
    lord = MemLord()
    lord.allocate(torch.empty(1000))
    doc = build_post_mortem([lord], {"device": "cpu", "bytes": 1 << 52})
    assert doc["devices"]["cpu"]["ledger"]["allocated"] == 4000
    assert doc["devices"]["cpu"]["largest"] == []
    assert any("lifetime tracking is off" in n for n in doc["notes"])
    # no lord at all: still a document
    empty = build_post_mortem([], {})
    # where torch has initialised CUDA, every CUDA device's allocator view is there
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    gpus = {f"cuda:{i}" for i in range(torch.cuda.device_count())} if cuda else set()
    assert empty["schema"] == SCHEMA and set(empty["devices"]) == gpus
    assert all(empty["devices"][d]["ledger"] is None for d in gpus)


def test_the_pickle_lists_segments_in_the_order_of_its_devices():
    """segments[i] belongs to memlord_devices[i], CUDA devices first at their index: on a
    GPU host a CPU request's pickle holds cuda:0 (empty) and cpu, and cpu's blocks were in
    segments[0] while memlord_devices said cpu was 1."""
    doc = {"devices": {"cpu": {}, "cuda:0": {}, "cuda:1": {}}, "request": {"device": "cpu"}}
    live = [("cpu", 4096, 0, 0, 0, 0, None, False, None, "other")]
    snap = synthetic_snapshot(doc, live, {}, [])
    assert snap["memlord_devices"] == ["cuda:0", "cuda:1", "cpu"]
    assert [s["device"] for s in snap["segments"]] == [0, 1, 2]
    assert [len(s["blocks"]) for s in snap["segments"]] == [0, 0, 1]
    assert "total_allocated: 4.0KiB" in memory_viz.segsum(snap)


def test_json_round_trip_and_schema_check(work, tmp_path):
    paths = write_post_mortem(work.doc, tmp_path, "pm-1")
    assert set(paths) == {"json", "html", "pickle"}
    doc = load_post_mortem(paths["json"])
    assert doc["devices"]["cpu"]["largest"] == json.loads(
        json.dumps(work.doc["devices"]["cpu"]["largest"])
    )
    assert "_memory_snapshot" not in doc
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "schema": "memlord.oom/0"}))
    with pytest.raises(ValueError, match="schema"):
        load_post_mortem(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_post_mortem(bad)
    del doc["devices"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="devices"):
        load_post_mortem(bad)


def test_an_existing_post_mortem_is_never_overwritten(work, tmp_path):
    (tmp_path / "pm-1.json").write_text("mine")
    with pytest.raises(FileExistsError):
        write_post_mortem(work.doc, tmp_path, "pm-1")
    # nothing written, nothing left behind
    assert sorted(os.listdir(tmp_path)) == ["pm-1.json"]
    assert (tmp_path / "pm-1.json").read_text() == "mine"
    # an html or pickle in the way: the JSON is written, the extra left as it was
    (tmp_path / "pm-2.html").write_text("theirs")
    paths = write_post_mortem(work.doc, tmp_path, "pm-2")
    assert set(paths) == {"json", "pickle"}
    assert (tmp_path / "pm-2.html").read_text() == "theirs"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_folder_that_cannot_be_written_raises_oserror(work, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    # not FileExistsError, which says "this name is taken": the caller would try the next
    with pytest.raises(NotADirectoryError):
        write_post_mortem(work.doc, blocker, "pm")
    with pytest.raises(OSError) as info:
        write_post_mortem(work.doc, blocker / "sub", "pm")
    assert not isinstance(info.value, FileExistsError)
    assert os.listdir(tmp_path) == ["file"]


def test_only_what_is_asked_is_written(work, tmp_path):
    paths = write_post_mortem(work.doc, tmp_path, "pm", html=False, pickle=False)
    assert set(paths) == {"json"}
    assert os.listdir(tmp_path) == ["pm.json"]


def test_the_pickle_is_read_by_torch_memory_viz(work, tmp_path):
    paths = write_post_mortem(work.doc, tmp_path, "pm")
    snap = pickle.loads(open(paths["pickle"], "rb").read())  # noqa: SIM115
    cpu = snap["memlord_devices"].index("cpu")
    live = work.doc["devices"]["cpu"]["tracked"]["bytes"]
    assert f"total_allocated: {memory_viz.Bytes(live)}" in memory_viz.segsum(snap)
    lines = memory_viz.memory(snap, format_flamegraph=lambda s: s)
    got = sum(int(x.rsplit(" ", 1)[1]) for x in lines.splitlines() if ";active_allocated;" in x)
    assert got == live
    blocks = snap["segments"][cpu]["blocks"]
    assert len(blocks) == work.doc["devices"]["cpu"]["tracked"]["count"]
    assert blocks[0]["memlord_name"] == "2.weight"  # the largest, and the oldest of its size
    assert blocks[0]["frames"] and blocks[0]["frames"][0]["filename"].endswith(".py")
    oom = [t for t in snap["device_traces"][cpu] if t["action"] == "oom"]
    assert len(oom) == 1 and oom[0]["size"] == 1 << 52
    assert f"Device {cpu}" in memory_viz.trace(snap)
    assert "snapshot.pickle" in memory_viz.trace_plot(snap)


def test_the_pickle_carries_the_event_ring_when_the_lord_records(tmp_path):
    lord = MemLord()
    lord.record_events(1000)
    with lord.hook_into_python():
        keep = [torch.empty(100) for _ in range(3)]
        doc = build_post_mortem([lord], {"device": "cpu", "bytes": 10})
    paths = write_post_mortem(doc, tmp_path, "pm")
    snap = pickle.loads(open(paths["pickle"], "rb").read())  # noqa: SIM115
    trace = snap["device_traces"][snap["memlord_devices"].index("cpu")]
    assert sum(t["action"] == "alloc" for t in trace) == 3
    assert trace[-1]["action"] == "oom"
    del keep


def test_the_html_page_escapes_every_name(tmp_path):
    lord = MemLord()
    with lord.hook_into_python(), lord.region("<b>load</b>"):
        keep = torch.empty(1000)
        doc = build_post_mortem([lord], {"device": "cpu", "what": "<script>x</script>"})
    page = render_html(doc)
    assert "<script>x</script>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
    assert "&lt;b&gt;load&lt;/b&gt;" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched
    del keep


def test_default_stem_names_host_pid_and_count():
    stem = default_stem(3)
    assert re.fullmatch(rf"memlord-oom-[A-Za-z0-9._-]+-{os.getpid()}-3", stem), stem
    with pytest.raises(ValueError):
        default_stem(-1)
    with pytest.raises(TypeError):
        default_stem("1")


@pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this torch is built without torch.distributed"
)
def test_default_stem_names_the_rank_when_torch_distributed_is_initialised(tmp_path):
    code = textwrap.dedent(
        """
        import os, torch.distributed as dist
        from memlord.report._postmortem import default_stem, build_post_mortem
        dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],
                                rank=0, world_size=1)
        print("stem:", default_stem(1))
        doc = build_post_mortem([], {})
        print("ranks:", doc["rank"], doc["world_size"])
        dist.destroy_process_group()
        """
    )
    env = {**os.environ, "STORE": str(tmp_path / "store")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # gloo may print lines of its own (torch 2.10: "[Gloo] Rank 0 is connected to 0 peer
    # ranks..."): the child's lines are the ones it labelled
    said = dict(
        line.split(": ", 1) for line in out.stdout.splitlines() if line[:6] in ("stem: ", "ranks:")
    )
    assert said["stem"].endswith("-rank0-1"), out.stdout
    assert said["ranks"] == "0 1", out.stdout


def test_a_post_mortem_names_the_rank_the_launcher_set_when_no_group_is_up(monkeypatch):
    """An OOM before init_process_group() or after destroy_process_group() under torchrun:
    the rank and world size come from the launcher's RANK and WORLD_SIZE, as a profile's
    do (memlord._ranks.rank_info), so `memlord merge` can place the rank that died."""
    from memlord._ranks import rank_info

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert not torch.distributed.is_initialized()
    assert rank_info() == {"rank": 3, "world_size": 4}  # what a profile says
    assert default_stem(2).endswith("-rank3-2")
    doc = build_post_mortem([], {})
    assert (doc["rank"], doc["world_size"]) == (3, 4)
    monkeypatch.setenv("RANK", "4")  # not a rank of that world: no rank, as for profiles
    assert rank_info() == {}
    assert re.fullmatch(rf"memlord-oom-[A-Za-z0-9._-]+-{os.getpid()}-2", default_stem(2))
    assert build_post_mortem([], {})["rank"] is None


# ---- the CUDA attribution: a pure function of torch's snapshot format ------------------------
# These segments are hand-built in the format torch.cuda.memory._snapshot() documents (no GPU
# here); tools/gpu_check.sh checks the same function on a real OOM on a GPU.


def _seg(device, address, blocks, total=None):
    return {
        "device": device,
        "address": address,
        "total_size": total if total is not None else sum(b["size"] for b in blocks),
        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
        "active_size": 0,
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }


def _blk(size, state="active_allocated", address=None, frames=()):
    b = {"size": size, "requested_size": size, "state": state, "frames": list(frames)}
    if address is not None:
        b["address"] = address
    return b


def test_blocks_are_attributed_to_the_storage_that_holds_them():
    base = 0x7F00_0000_0000
    segments = [
        _seg(
            0,
            base,
            [
                _blk(2048, address=base),  # weight: exactly its storage
                _blk(512, address=base + 2048),  # a storage of 500 bytes, rounded up
                _blk(1024, "inactive", address=base + 2560),
                _blk(4096, address=base + 3584, frames=[{"filename": "x.py", "line": 3}]),
                _blk(512, "active_awaiting_free", address=base + 7680),
            ],
        ),
        # an older torch's blocks without addresses: placed one after the other
        _seg(0, base + (1 << 20), [_blk(1024), _blk(1024)]),
        _seg(1, base + (2 << 20), [_blk(8192, address=base + (2 << 20))]),  # another device
    ]
    storages = [
        (base, 2048, "0.weight"),
        (base + 2048, 500, "grad of 0.weight"),
        (base + (1 << 20) + 1024, 1000, "activation of 1 (forward)"),
        (base + (5 << 20), 4096, "not in any block"),
    ]
    got = attribute_blocks(segments, storages, 0, top=5)
    assert got["segments"] == 2
    assert got["reserved"] == 2048 + 512 + 1024 + 4096 + 512 + 2048
    assert got["allocated"] == 2048 + 512 + 4096 + 2048
    assert got["attributed"] == 2048 + 512 + 1024
    assert got["untracked"] == 4096 + 1024
    assert got["inactive"] == 1024 and got["awaiting_free"] == 512
    assert got["attributed_fraction"] == pytest.approx(3584 / 8704)
    assert [b["size"] for b in got["untracked_blocks"]] == [4096, 1024]
    assert got["untracked_blocks"][0]["frames"] == [{"filename": "x.py", "line": 3}]
    assert got["untracked_blocks"][1]["address"] == base + (1 << 20)
    held = {r["name"]: r["bytes"] for r in got["by_storage"]["top"]}
    assert held == {"0.weight": 2048, "grad of 0.weight": 512, "activation of 1 (forward)": 1024}
    # a storage that starts inside a block (an offset) holds that block too
    inner = attribute_blocks([_seg(0, base, [_blk(4096, address=base)])], [(base + 64, 10, "x")], 0)
    assert inner["attributed"] == 4096
    # nothing on the device: no fraction
    assert attribute_blocks(segments, storages, 7)["attributed_fraction"] is None


def test_two_lords_count_each_storage_once():
    a, b = MemLord(), MemLord()
    with a.hook_into_python(), b.hook_into_python():
        keep = [torch.empty(256) for _ in range(3)]
        doc = build_post_mortem([a, b], {"device": "cpu"})
    assert doc["devices"]["cpu"]["tracked"] == {"bytes": 3 * 1024, "count": 3}
    assert [lord["allocated"]["cpu"] for lord in doc["lords"]] == [3 * 1024, 3 * 1024]
    del keep


def test_a_piece_that_cannot_be_read_is_a_note_not_an_error():
    lord = MemLord()
    with lord.hook_into_python():
        keep = torch.empty(100)
        doc = build_post_mortem([lord, object()], {"device": "cpu", "bytes": "many"})
    assert doc["devices"]["cpu"]["tracked"]["bytes"] == 400
    assert any(n.startswith("lord 1:") for n in doc["notes"]), doc["notes"]
    assert doc["request"]["bytes"] is None  # not an int: not kept
    del keep


def test_a_time_out_of_range_still_gives_a_document(tmp_path):
    for when in (1e300, float("nan"), True):
        doc = build_post_mortem([], {"time": when})
        assert isinstance(doc["time"], float)
        write_post_mortem(doc, tmp_path, f"pm-{len(os.listdir(tmp_path))}", html=False)


class _Greedy(nn.Module):
    """A layer whose forward asks for 4 PiB (a real OOM) and builds the post-mortem there,
    as memlord does when a request inside a model fails."""

    def __init__(self, lord: MemLord) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lord = [lord]  # not a submodule
        self.doc: dict | None = None

    def forward(self, x):
        try:
            torch.empty(1 << 50)
        except RuntimeError as exc:
            self.doc = build_post_mortem(self.lord, {"device": "cpu", "error": str(exc)})
        return self.lin(x)


def test_the_request_names_the_module_regions_open_when_it_failed():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        model = nn.Sequential(nn.Linear(8, 8), _Greedy(lord))
        with lord.track_modules(model):
            model(torch.randn(2, 8))
    req = model[1].doc["request"]
    assert req["regions"] == ["Sequential", "1"]
    assert req["module"] == "1"
    # the first layer's output, alive while the second runs, is named by its module
    names = [e["name"] for e in model[1].doc["devices"]["cpu"]["largest"]]
    assert "activation of 0 (forward)" in names, names


def test_lords_may_be_one_lord_or_any_iterable_of_them():
    lord = MemLord()
    with lord.hook_into_python():
        keep = torch.empty(10)
        for lords in (lord, [lord], (lord,), iter([lord]), {lord}):
            doc = build_post_mortem(lords, {})
            assert doc["devices"]["cpu"]["tracked"]["bytes"] == 40
    with pytest.raises(TypeError, match="lords"):
        build_post_mortem(3, {})
    del keep


def test_the_pickle_shows_each_live_storage_once_to_memory_viz(tmp_path):
    """The post-mortem's pickle holds the event ring's trace beside a block per live
    storage: torch's memory_viz matches them by address, so a live storage's block must sit
    at the address of its trace allocation (or the page counts it twice: a block allocated
    before the trace plus an allocation never freed), and every address the trace frees
    must lie in the segment.  The blocks were laid out largest first while the trace kept
    the profile pickle's own addresses."""
    lord = MemLord()
    lord.record_events(1000)
    with lord.hook_into_python():
        # sizes not in the order of the storages' addresses, some freed before the OOM
        keep = [torch.empty(n) for n in (300, 5000, 70, 1200, 40000, 9)]
        gone = [torch.empty(n) for n in (2000, 11, 600)]
        del gone
        more = [torch.empty(n) for n in (800, 25)]
        doc = build_post_mortem([lord], {"device": "cpu", "bytes": 10})
    snap = pickle.loads(open(write_post_mortem(doc, tmp_path, "pm")["pickle"], "rb").read())  # noqa: SIM115
    cpu = snap["memlord_devices"].index("cpu")
    live = doc["devices"]["cpu"]["tracked"]["bytes"]
    assert live == sum(_nbytes(t) for t in keep + more)
    trace = snap["device_traces"][cpu]
    assert sum(t["action"] == "alloc" for t in trace) == len(keep) + len(more) + 3
    # torch's reader: the trace's allocations never freed are exactly the live blocks
    blocks = {a: b for a, b in blocks_at(snap, cpu) if b["state"] == "active_allocated"}
    still = trace_live_allocations(snap, cpu)
    assert sorted(e["size"] for e in still) == sorted(_nbytes(t) for t in keep + more)
    for e in still:
        assert e["addr"] in blocks and blocks[e["addr"]]["requested_size"] == e["size"], e
    # torch's trace printout: every free names an allocation of the trace
    dels = [x for x in memory_viz.trace(snap).splitlines() if x.startswith("del ")]
    assert len(dels) == 3 and not [x for x in dels if x.split()[1].isdigit()], dels
    # the page: each live byte once, every freed address in the segment
    assert page_live_bytes(snap, cpu) == live
    seg = snap["segments"][cpu]
    assert all(
        seg["address"] <= t["addr"] < seg["address"] + seg["total_size"]
        for t in trace
        if t["action"] != "oom"
    )
    assert f"total_allocated: {memory_viz.Bytes(live)}" in memory_viz.segsum(snap)
    del keep, more


def test_the_rings_live_allocations_no_storage_stands_for_are_blocks_once(tmp_path):
    """Without lifetime tracking the post-mortem knows no live storage, yet the ring shows
    allocations never freed: each is a block at its trace allocation's address (memory_viz
    counts it once), and the addresses the trace frees lie in the segment (the segment was
    empty: memory_viz's page found no segment for them)."""
    lord = MemLord()
    lord.record_events(1000)
    kept = [torch.empty(n) for n in (100, 3000, 7)]
    freed = [torch.empty(n) for n in (50, 900)]
    for t in kept + freed:
        lord.allocate(t)
    for t in freed:
        lord.free(t)
    doc = build_post_mortem([lord], {"device": "cpu", "bytes": 10})
    snap = pickle.loads(open(write_post_mortem(doc, tmp_path, "pm")["pickle"], "rb").read())  # noqa: SIM115
    cpu = snap["memlord_devices"].index("cpu")
    assert doc["devices"]["cpu"]["tracked"]["bytes"] == 0
    ledger = doc["devices"]["cpu"]["ledger"]["allocated"]
    assert ledger == sum(_nbytes(t) for t in kept)
    blocks = {a: b for a, b in blocks_at(snap, cpu) if b["state"] == "active_allocated"}
    still = trace_live_allocations(snap, cpu)
    assert sorted(e["size"] for e in still) == sorted(_nbytes(t) for t in kept)
    for e in still:
        assert e["addr"] in blocks and blocks[e["addr"]]["size"] == e["size"], e
        assert blocks[e["addr"]]["frames"] == e["frames"]
    assert page_live_bytes(snap, cpu) == ledger
    assert f"total_allocated: {memory_viz.Bytes(ledger)}" in memory_viz.segsum(snap)


def test_a_storage_the_ring_shows_allocated_keeps_its_block_beyond_the_block_limit(
    tmp_path, monkeypatch
):
    """Past MAX_PICKLE_BLOCKS the smaller storages are one block; one the ring shows
    allocated still gets a block of its own at its trace allocation's address (else the
    page counts it twice: in the rest's block and as an allocation never freed)."""
    import memlord.report._postmortem as pm

    monkeypatch.setattr(pm, "MAX_PICKLE_BLOCKS", 2)
    lord = MemLord()
    with lord.hook_into_python():
        before = [torch.empty(n) for n in (4000, 3000, 20, 30)]  # before the ring records
        lord.record_events(1000)
        after = [torch.empty(n) for n in (10, 5000, 40)]
        doc = build_post_mortem([lord], {"device": "cpu", "bytes": 10})
    snap = pickle.loads(open(write_post_mortem(doc, tmp_path, "pm")["pickle"], "rb").read())  # noqa: SIM115
    cpu = snap["memlord_devices"].index("cpu")
    live = doc["devices"]["cpu"]["tracked"]["bytes"]
    assert live == sum(_nbytes(t) for t in before + after)
    active = [b for _, b in blocks_at(snap, cpu) if b["state"] == "active_allocated"]
    # the two largest, the ring's two others, the rest (3000, 20 and 30 floats) as one
    assert sorted(b["size"] for b in active) == [40, 160, 12200, 16000, 20000]
    assert [b["memlord_name"] for b in active if b["size"] == 12200] == ["3 smaller storages"]
    blocks = {a: b for a, b in blocks_at(snap, cpu) if b["state"] == "active_allocated"}
    still = trace_live_allocations(snap, cpu)
    assert sorted(e["size"] for e in still) == sorted(_nbytes(t) for t in after)
    for e in still:
        assert e["addr"] in blocks and blocks[e["addr"]]["size"] == e["size"], e
    assert page_live_bytes(snap, cpu) == live
    del before, after
