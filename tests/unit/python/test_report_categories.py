"""The reports by category: lord.export()'s and the profiler's JSON carry the ledger's
bytes by category (counters, snapshots, each top tensor, each region, each event), and
they equal lord.stats() and what torch says the parameters and optimizer state hold, on
a real training step with ``ops=True``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlord import CATEGORIES, MemLord
from memlord.profiler import MemoryTracker
from memlord.report import load, memory_series
from memlord.report._source import LedgerSource


def storages_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def train(lord: MemLord, steps: int = 2):
    """A few AdamW steps of a small model, a region around each, modules tracked; returns
    the model and optimizer (alive)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 64)
    with lord.track_modules(model):
        for _ in range(steps):
            with lord.region("step"):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
    return model, opt


def check_document(doc, stats: dict, model, opt) -> None:
    cpu = stats["cpu"]
    # the counters are stats(): bytes by category now, at the peak and their own peaks
    c = doc.counters["cpu"]
    for key in ("categories", "peak_categories", "category_peaks"):
        assert c[key] == cpu[key]
    assert sum(c["categories"].values()) == c["allocated"] == cpu["allocated"]
    assert sum(c["peak_categories"].values()) == c["peak_allocated"]
    # ... and torch's own view of the parameters and optimizer state
    assert c["categories"]["parameter"] == storages_bytes(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert c["categories"]["optimizer_state"] == storages_bytes(state)
    # the last snapshot's breakdown by category adds up to its total
    snap = doc.snapshots[-1]["device_breakdown"]["cpu"]
    assert snap["categories"] == cpu["categories"]
    assert sum(snap["categories"].values()) == snap["total_bytes"]
    cats = {t["category"] for t in snap["tensors"]}
    assert cats <= set(CATEGORIES) and "parameter" in cats
    # every region has its deltas by category, adding up to its delta
    steps = [s for s in doc.regions if s.name == "step"]
    assert steps
    for s in steps:
        assert sum(v["delta"] for v in s.categories["cpu"].values()) == s.delta["cpu"]
    assert any("activation" in s.categories.get("cpu", {}) for s in doc.regions if s.name == "0")


def check_timeline(doc, stats: dict) -> None:
    """The timeline by category: at every point the categories add up to allocated, and
    they end at the ledger's categories."""
    series = memory_series(doc)["cpu"]
    assert {"parameter", "activation", "optimizer_state"} <= set(series.categories)
    total = sum(series.categories.values())
    assert np.array_equal(total, series.allocated)
    for cat, values in series.categories.items():
        assert values[-1] == stats["cpu"]["categories"][cat], cat
    # each storage is drawn under the category it ended with: the gradients, made in
    # backward as temporaries, show as gradients and nothing stays temporary
    assert "gradient" in series.categories and series.categories["gradient"].max() > 0
    assert (series.categories["parameter"] >= 0).all()


def test_lord_export_json_by_category(tmp_path):
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        model, opt = train(lord)
        path = tmp_path / "p.json"
        lord.export(path)
        stats = lord.stats()
    doc = load(path)
    assert doc.events.categories == list(CATEGORIES)
    assert set(doc.events.decode("category")) <= set(CATEGORIES)
    assert doc.metadata["category_baseline"]["cpu"] == dict.fromkeys(CATEGORIES, 0)
    check_document(doc, stats, model, opt)
    check_timeline(doc, stats)


def test_profiler_json_by_category(tmp_path):
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        tracker = MemoryTracker(
            tmp_path, interval=None, source=LedgerSource(lord, lifetime=False)
        ).start()
        try:
            model, opt = train(lord)
            tracker.take_snapshot("end")
            stats = lord.stats()
            doc = tracker.profile()
        finally:
            tracker.stop()
    check_document(doc, stats, model, opt)
    check_timeline(doc, stats)


def test_a_document_without_categories_draws_none():
    from support.synthetic import synthetic_profile

    doc = synthetic_profile(1000, steps=2, names=("a",))
    assert all(not s.categories for s in memory_series(doc).values())


@pytest.mark.parametrize(
    "where",
    [
        ("metadata", "category_baseline", {"cpu": {"other": "x"}}),
        ("metadata", "category_baseline", {"cpu": 3}),
    ],
)
def test_malformed_category_fields_are_refused(tmp_path, where):
    import json

    from memlord.report import ProfileError

    lord = MemLord()
    lord.record_events(100)
    lord.allocate(torch.empty(10))
    path = tmp_path / "p.json"
    lord.export(path)
    data = json.loads(path.read_text())
    data[where[0]][where[1]] = where[2]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="category_baseline"):
        load(path)


def test_trace_has_a_counter_by_category_and_region_deltas_by_category(tmp_path):
    import json

    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        train(lord)
        path = tmp_path / "p.trace.json"
        assert lord.export(path) == "trace"
        stats = lord.stats()["cpu"]
    events = json.loads(path.read_text())["traceEvents"]
    counters = [e for e in events if e.get("ph") == "C" and e["name"] == "memory cpu by category"]
    allocated = [e for e in events if e.get("ph") == "C" and e["name"] == "memory cpu"]
    assert len(counters) == len(allocated) > 0
    # at every point the categories add up to allocated; the last is the ledger's
    for c, a in zip(counters, allocated, strict=True):
        assert c["ts"] == a["ts"] and sum(c["args"].values()) == a["args"]["allocated"]
    assert counters[-1]["args"] == {
        k: v for k, v in stats["categories"].items() if k in counters[-1]["args"]
    }
    assert all(v == 0 for k, v in stats["categories"].items() if k not in counters[-1]["args"])
    step = next(e for e in events if e.get("ph") == "X" and e["name"] == "step")
    deltas = {k: v for k, v in step["args"].items() if k.startswith("delta cpu ")}
    assert deltas and sum(deltas.values()) == step["args"]["delta cpu"]
