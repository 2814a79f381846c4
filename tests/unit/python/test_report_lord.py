"""lord.export(path): the profile document of a real lord after real torch work (lifetime
tracking, nested regions, a tracked module's forward and backward, the event ring on),
in every format, checked against the lord's own numbers."""

from __future__ import annotations

import gc
import json
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from conftest import fake_cuda
from support.ledger import storage_bytes, torch_memory
from support.lord_work import Work
from support.memory_viz import page_live_bytes, trace_live_allocations
from support.trace import validate_trace as _validate_trace

import memlord.lord
from memlord import MemLord
from memlord.report import Profile, export, load, memory_series
from memlord.report._lord import profile_from_lord


@pytest.fixture(scope="module")
def work():
    w = Work()
    yield w
    w.close()


def _final(doc: Profile) -> dict[str, int]:
    return {d: int(s.allocated[-1]) for d, s in memory_series(doc).items()}


def test_json_round_trip_equals_the_lords_numbers(work, tmp_path):
    lord = work.lord
    path = tmp_path / "lord.json"
    assert lord.export(path) == "json"
    doc = load(path)
    stats = lord.stats()
    # counters: the lord's stats, plus pending and reserved
    for dev, st in stats.items():
        assert {k: doc.counters[dev][k] for k in st} == st
        assert doc.counters[dev]["pending"] == 0 and doc.counters[dev]["reserved"] is None
    # events: the ring's records, decoded, none dropped
    ring = lord.decode_events(lord.events())
    ev = doc.events
    assert len(ev) == len(ring) > 0
    assert ev["t_ns"].tolist() == [r["t_ns"] for r in ring]
    assert ev["bytes"].tolist() == [r["bytes"] for r in ring]
    assert ev["address"].tolist() == [r["address"] for r in ring]
    assert ev.decode("kind") == [r["kind"] for r in ring]
    assert ev.decode("source") == [r["source"] for r in ring]
    assert ev.decode("device") == [r["device"] for r in ring]
    assert ev.decode("site") == [None if r["site"] == "<unknown>:0" else r["site"] for r in ring]
    assert ev.decode("region") == [r["region"] or None for r in ring]
    assert ev["thread"].tolist() == [r["thread"] for r in ring]
    # a tracked storage's death carries its lifetime; everything else is unknown (-1)
    life = ev["lifetime_ns"].tolist()
    assert life == [r["lifetime_ns"] if r["lifetime_ns"] > 0 else -1 for r in ring]
    deaths = [
        x for x, r in zip(life, ring, strict=True) if r["source"] == "death" and r["bytes"] == 2000
    ]
    assert deaths and all(x > 0 for x in deaths)  # tmp, deleted after the scratch region
    assert work.site in ev.sites
    assert {"load", "scratch", "step"} <= set(ev.regions)
    # the running sum of the events is the ledger: it ends at allocated, peaks at the peak
    assert doc.metadata["event_baseline"] == {"cpu": 0}
    series = memory_series(doc)["cpu"]
    assert series.source == "events"
    assert int(series.allocated[-1]) == stats["cpu"]["allocated"]
    assert int(series.allocated.max()) == stats["cpu"]["peak_allocated"]
    # regions: one span per closed region, with the Region objects' own numbers
    spans = {s.name: s for s in doc.regions}
    assert set(spans) >= {"load", "scratch", "step", "Sequential", "0", "1"}
    assert Counter(s.name for s in doc.regions)["Sequential (backward)"] == 1
    for region in (work.load, work.scratch, work.step):
        s = spans[region.name]
        st = region.stats
        assert s.kind == "region" and s.finished
        assert s.delta == {d: v["delta"] for d, v in st.items()}
        assert s.peak == {d: v["peak"] for d, v in st.items()}
        assert s.tensor_delta == sum(v["allocs"] - v["frees"] for v in st.values())
        assert s.duration_ns == round(region.duration_s * 1e9)
        assert s.thread == spans["load"].thread and s.memory_delta == sum(s.delta.values())
    assert spans["load"].delta == {"cpu": 4400} and spans["scratch"].delta == {"cpu": 2400}
    assert spans["scratch"].depth == 1 and spans["load"].depth == 0
    load_, scratch = spans["load"], spans["scratch"]
    assert load_.start_ns < scratch.start_ns <= scratch.end_ns < load_.end_ns
    assert spans["0"].depth == 1 and spans["Sequential"].depth == 0
    # hotspots, and the snapshot's largest tensors (the module's weight among them)
    assert {"device": "cpu", "kind": "alloc", "site": work.site, "bytes": 4000} in doc.hotspots
    (snap,) = doc.snapshots
    assert snap["checkpoint_name"] == "export"
    assert snap["device_breakdown"]["cpu"]["total_bytes"] == stats["cpu"]["allocated"]
    shapes = [t["shape"] for t in snap["device_breakdown"]["cpu"]["tensors"]]
    assert [64, 64] in shapes and [1000] in shapes
    # from memlord's registry of live storages (lifetime tracking is on): each of the
    # largest tensors knows the line and the region it was born in
    assert doc.metadata["top_tensors_from"] == "lifetime registry"
    (zeros,) = [t for t in snap["device_breakdown"]["cpu"]["tensors"] if t["shape"] == [1000]]
    assert zeros["site"] == work.site and zeros["operation"] == "load"
    assert zeros["tracked"] is True and zeros["age_s"] >= 0
    assert doc.metadata["regions_kept"] == doc.metadata["regions_closed"] == len(doc.regions)
    # and the document itself round-trips exactly
    again = profile_from_lord(lord)
    export(again, tmp_path / "again.json")
    assert load(tmp_path / "again.json") == again


def test_trace_has_a_slice_per_region_and_a_counter_track_per_device(work, tmp_path):
    path = tmp_path / "lord.trace.json"
    assert work.lord.export(path) == "trace"
    events = _validate_trace(json.loads(path.read_text()))
    doc = profile_from_lord(work.lord)
    slices = [e for e in events if e["ph"] == "X"]
    assert sorted(e["name"] for e in slices) == sorted(s.name for s in doc.regions)
    by_name = {e["name"]: e for e in slices}
    assert by_name["load"]["cat"] == "region"
    assert by_name["load"]["args"]["delta cpu"] == 4400
    assert by_name["scratch"]["args"]["peak cpu"] == work.scratch.stats["cpu"]["peak"]
    assert by_name["scratch"]["dur"] == pytest.approx(work.scratch.duration_s * 1e6, abs=1e-3)
    # one track per device, and its allocated bytes by category (the events carry one)
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "memory cpu"]
    names = {e["name"] for e in events if e["ph"] == "C"}
    assert names == {"memory cpu", "memory cpu by category"}
    values = [e["args"]["allocated"] for e in counters]
    assert values == memory_series(doc)["cpu"].allocated.tolist()
    assert values[-1] == work.lord.stats()["cpu"]["allocated"]
    assert "MainThread" in {e["args"]["name"] for e in events if e["ph"] == "M"}


def test_pickle_is_read_by_torch_memory_viz(work, tmp_path):
    path = tmp_path / "lord.pickle"
    assert work.lord.export(path) == "pickle"
    snap = pickle.loads(path.read_bytes())
    allocated = work.lord.stats()["cpu"]["allocated"]
    # the object scan also sees tensors other tests left alive (fake cuda ones): their
    # devices get an empty segment
    devices = snap["memlord_devices"]
    cpu = devices.index("cpu")
    text = memory_viz.segsum(snap)
    assert f"segments: {len(devices)}" in text
    assert f"total_allocated: {memory_viz.Bytes(allocated)}" in text
    assert f"Device {cpu}" in memory_viz.trace(snap)
    lines = memory_viz.memory(snap, format_flamegraph=lambda s: s)
    live = sum(int(x.rsplit(" ", 1)[1]) for x in lines.splitlines() if ";active_allocated;" in x)
    assert live == allocated
    # the factory hooks record no data pointer, so the live bytes are one block; the
    # trace has every allocation with its site
    trace = snap["device_traces"][cpu]
    assert all(not t for i, t in enumerate(snap["device_traces"]) if i != cpu)
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert len(allocs) == work.lord.stats()["cpu"]["allocs"]
    where = [(f["filename"], f["line"]) for f in allocs[0]["frames"]]
    assert (work.site.rpartition(":")[0], int(work.site.rpartition(":")[2])) in where
    assert all(f["name"] not in ("?", "") for f in allocs[0]["frames"])  # functions' names
    assert "snapshot.pickle" in memory_viz.trace_plot(snap)


def test_html_report(work, tmp_path):
    pytest.importorskip("plotly", reason="the HTML report needs the report extra")
    path = tmp_path / "lord.html"
    assert work.lord.export(path) == "html"
    text = path.read_text()
    assert "Operations and regions" in text and "scratch" in text


def test_bad_names_and_arguments_write_nothing(work, tmp_path, request):
    with pytest.raises(ValueError) as info:
        work.lord.export(tmp_path / "lord.csv")
    message = str(info.value)
    assert "lord.csv" in message
    assert all(s in message for s in (".json", ".trace.json", ".pickle", ".pkl", ".html"))
    with pytest.raises(TypeError, match="'path'"):
        work.lord.export(3)
    with pytest.raises(ValueError, match="'top'"):
        work.lord.export(tmp_path / "x.json", top=-1)
    request.getfixturevalue("no_plotly")  # from here on, as without the extra
    with pytest.raises(ImportError, match=r"pip install memlord\[report\]"):
        work.lord.export(tmp_path / "r.html")
    assert list(tmp_path.iterdir()) == []


def test_without_the_ring_and_with_a_ring_that_dropped(tmp_path):
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        a = torch.zeros(1000)
        doc = profile_from_lord(lord)
        assert len(doc.events) == 0 and doc.counters["cpu"]["allocated"] == 4000
        assert memory_series(doc)["cpu"].source == "samples"  # the sample taken at export
        lord.record_events(4)  # started after 4000 bytes, and too small
        keep = [torch.zeros(10 * (i + 1)) for i in range(6)]
        del keep[0]
        doc = profile_from_lord(lord)
        assert len(doc.events) == 4 and lord.events_dropped == 3
        allocated = lord.stats()["cpu"]["allocated"]
        assert doc.metadata["event_baseline"]["cpu"] == allocated - (160 + 200 + 240 - 40)
        assert _final(doc) == {"cpu": allocated}
        # a reset starts the ledger afresh: the events before it are left out
        lord.reset()
        b = torch.zeros(50)
        doc = profile_from_lord(lord)
        assert doc.events.decode("kind") == ["alloc"] and doc.metadata["events_before_reset"] == 3
        assert _final(doc) == {"cpu": 200} and doc.metadata["event_baseline"] == {"cpu": 0}
        del a, b, keep


def test_region_history_is_bounded(monkeypatch):
    monkeypatch.setattr(memlord.lord, "REGION_HISTORY", 5)
    lord = MemLord(auto_gc_bytes=None)
    for i in range(12):
        with lord.region(f"r{i}"):
            pass
    doc = profile_from_lord(lord)
    assert [s.name for s in doc.regions] == [f"r{i}" for i in range(7, 12)]
    assert doc.metadata["regions_kept"] == 5 and doc.metadata["regions_closed"] == 12
    assert lord.regions()["r0"]["count"] == 1  # the aggregate still counts every one
    starts = [s.start_ns for s in doc.regions]
    assert starts == sorted(starts) and all(s.end_ns >= s.start_ns for s in doc.regions)


def test_regions_of_other_threads_keep_their_thread(tmp_path):
    import threading

    lord = MemLord(auto_gc_bytes=None)
    idents = []

    def worker():
        idents.append(threading.get_ident())
        with lord.region("worker"):
            with lord.region("worker inner"):
                pass

    t = threading.Thread(target=worker, name="w1")
    with lord.region("main"):
        t.start()
        t.join()
    spans = {s.name: s for s in profile_from_lord(lord).regions}
    assert spans["worker"].thread == spans["worker inner"].thread == idents[0]
    assert spans["worker"].depth == 0 and spans["worker inner"].depth == 1
    assert spans["main"].thread == threading.get_ident() and spans["main"].depth == 0
    lord.export(tmp_path / "t.trace.json")
    events = _validate_trace(json.loads((tmp_path / "t.trace.json").read_text()))
    tids = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert tids["worker"] == tids["worker inner"] != tids["main"]
    assert np.unique([e["tid"] for e in events if e["ph"] == "X"]).size == 2


def test_regions_read_in_the_middle_of_a_fold():
    """A signal handler or finalizer that exports while this thread folds closed regions
    gets the kept ones and those still waiting, and drains nothing."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.region("kept"):
        pass
    lord.regions()  # folded into the history
    with lord.region("waiting"):
        pass
    agg = lord._region_aggregate
    agg._folding = True  # as inside _fold_locked
    try:
        names = [s.name for s in profile_from_lord(lord).regions]
        assert names == ["kept", "waiting"] and len(lord._region_done()) == 1
    finally:
        agg._folding = False
    assert lord.regions()["waiting"]["count"] == 1


def test_trace_and_pickle_timelines_are_torch_profilers(tmp_path):
    """The memory over time that the trace's counter track and the pickle's allocation
    trace draw, for a model's forward and backward counted with ops=True, is the timeline
    torch.profiler records for the same code on its own (torch.profiler._memory_profiler,
    every CPU allocation and free): the same peak, the same bytes at the end."""
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True), torch_memory() as theirs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
        )
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        del loss
    net, peak = theirs.net, theirs.peak
    assert 0 < net < peak

    trace = tmp_path / "m.trace.json"
    lord.export(trace)
    events = _validate_trace(json.loads(trace.read_text()))
    values = [e["args"]["allocated"] for e in events if e["name"] == "memory cpu"]
    assert (max(values), values[-1]) == (peak, net)

    path = tmp_path / "m.pickle"
    lord.export(path)
    snap = pickle.loads(path.read_bytes())
    level = high = 0
    for e in snap["device_traces"][snap["memlord_devices"].index("cpu")]:
        level += {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        high = max(high, level)
    assert (high, level) == (peak, net)
    assert f"total_allocated: {memory_viz.Bytes(net)}" in memory_viz.segsum(snap)
    del model


def test_pickle_pairs_every_allocation_of_a_training_step_with_its_free(tmp_path):
    """A training step counted with ops=True (LayerNorm's operator has three new outputs,
    its backward several): in the pickle, torch's memory_viz keeps as never freed exactly
    the allocations still alive (the parameters and the gradients), and its page shows
    the ledger's bytes live."""
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
        model(torch.randn(8, 16)).square().mean().backward()
    gc.collect()
    live = [*model.parameters(), *(p.grad for p in model.parameters())]
    assert lord.allocated("cpu")[0] == storage_bytes(*live)
    path = tmp_path / "step.pickle"
    lord.export(path)
    snap = pickle.loads(path.read_bytes())
    cpu = snap["memlord_devices"].index("cpu")
    still = trace_live_allocations(snap, cpu)
    assert sorted(e["size"] for e in still) == sorted(t.untyped_storage().nbytes() for t in live)
    assert page_live_bytes(snap, cpu) == storage_bytes(*live)
    del model, live


def test_pickle_names_each_device_index_at_its_position(tmp_path):
    """A CUDA tensor on cuda:1 alive at the export (no cuda:0) put the profile's devices at
    indices 1 (cuda:1) and 2 (cpu), while ``memlord_devices`` listed them without the gap
    (``["cuda:1", "cpu"]``): ``device_traces[memlord_devices.index("cpu")]`` read cuda:0's
    empty trace, and torch's memory_viz read no CPU memory at all.  The reference is the
    events themselves, read through torch's memory_viz: the CPU trace's allocations net to
    the ledger's bytes."""
    keep = fake_cuda(7, 1)  # a live tensor on cuda:1, found by the export's scan
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 256)
        model(torch.randn(32, 64)).sum().backward()
    gc.collect()
    path = tmp_path / "m.pickle"
    lord.export(path)
    snap = pickle.loads(path.read_bytes())
    names = snap["memlord_devices"]
    assert len(names) == len(snap["device_traces"])
    for seg in snap["segments"]:
        assert names[seg["device"]] == seg["memlord_device"]
    cpu = names.index("cpu")
    level = sum(
        {"alloc": e["size"], "free_completed": -e["size"]}.get(e["action"], 0)
        for e in snap["device_traces"][cpu]
    )
    assert (
        level
        == lord.allocated("cpu")[0]
        == storage_bytes(*model.parameters(), *(p.grad for p in model.parameters()))
    )
    # cuda:N at index N (cuda:0 is None, unless another test left a cuda:0 tensor alive)
    assert names[1] == "cuda:1"
    del keep
