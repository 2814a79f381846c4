"""The memory API's resets go through the event seam (issue 26): ``reset_peak_memory_stats``
and ``reset_memory_stats`` are events of kinds ``reset_peak`` / ``reset_accumulated``, one per
device they reset, which the event ring records and the DEBUG log prints; the ledger's
figures after them are exactly what the resets have always left."""

from __future__ import annotations

import logging

import torch

import memlord
from memlord import EVENT_KINDS, EVENT_SOURCES, MemLord, _core

KiB = 1024


def u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()  # torch's own figure, not memlord's


def lord_with_history():
    lord = MemLord()
    a, b = u8(8 * KiB), u8(KiB)
    lord.allocate((a, b))
    lord.free(a)
    return lord, a, b


def changed(before: dict, after: dict) -> dict:
    assert before.keys() == after.keys()
    keys = [k for k in before if k != "pending_free_bytes"]  # deprecated alias, kept equal
    return {k: (before[k], after[k]) for k in keys if before[k] != after[k]}


def test_reset_peak_is_an_event_and_leaves_the_ledger_as_before() -> None:
    lord, a, b = lord_with_history()
    lord.record_events(100)
    before, stats_before = lord.memory_stats("cpu"), lord.stats("cpu")["cpu"]
    assert before["peak_allocated"] == nbytes(a) + nbytes(b)
    lord.reset_peak_memory_stats("cpu")
    recs = lord.events()
    assert len(recs) == 1
    assert EVENT_KINDS[recs["kind"][0]] == "reset_peak"
    assert EVENT_SOURCES[recs["source"][0]] == "explicit"
    assert recs["bytes"][0] == nbytes(b)  # the new peak: the live bytes
    # only the peak moved, to the live bytes torch reports
    after = lord.memory_stats("cpu")
    old, new = nbytes(a) + nbytes(b), nbytes(b)
    assert changed(before, after) == {
        "peak_allocated": (old, new),
        # allocate() counts under "other": its own peak and its bytes at the peak move too
        "category.other.peak": (old, new),
        "category.other.at_peak": (old, new),
    }
    st = lord.stats("cpu")["cpu"]
    peaks = ("peak_allocated", "peak_categories", "category_peaks")
    assert {k: v for k, v in st.items() if stats_before[k] != v} == {k: st[k] for k in peaks}
    assert st["peak_categories"] == st["category_peaks"] == st["categories"]
    assert lord.max_memory_allocated("cpu") == nbytes(b)


def test_reset_memory_stats_is_an_event_and_leaves_the_ledger_as_before() -> None:
    lord, a, b = lord_with_history()
    lord.record_events(100)
    before = lord.memory_stats("cpu")
    lord.reset_memory_stats()
    recs = lord.events()
    assert [EVENT_KINDS[k] for k in recs["kind"].tolist()] == ["reset_accumulated"]
    assert EVENT_SOURCES[recs["source"][0]] == "explicit"
    assert recs["bytes"][0] == nbytes(b)
    after = lord.memory_stats("cpu")
    assert changed(before, after) == {
        "peak_allocated": (nbytes(a) + nbytes(b), nbytes(b)),
        "category.other.peak": (nbytes(a) + nbytes(b), nbytes(b)),
        "category.other.at_peak": (nbytes(a) + nbytes(b), nbytes(b)),
        "num_allocations": (2, 0),
        "num_frees": (1, 0),
    }
    assert after["freed_since_gc_bytes"] == nbytes(a)  # the auto-GC counter is kept
    st = lord.stats("cpu")["cpu"]
    assert st["allocated_total"] == 0 and st["freed_total"] == 0 and st["allocs"] == 0


def test_a_reset_of_a_device_never_seen_is_no_event() -> None:
    lord, a, b = lord_with_history()
    lord.record_events(100)
    lord.reset_peak_memory_stats("cuda:0")
    lord.reset_memory_stats("cuda:0")
    assert len(lord.events()) == 0
    assert lord.max_memory_allocated("cpu") == nbytes(a) + nbytes(b)


def test_a_reset_inside_a_region_is_recorded_there_and_keeps_its_peak() -> None:
    lord, a, b = lord_with_history()
    lord.record_events(100)
    with lord.region("step") as r:
        c = u8(4 * KiB)
        lord.allocate(c)
        lord.free(c)
        lord.reset_peak_memory_stats()
    recs = lord.events()
    kinds = [EVENT_KINDS[k] for k in recs["kind"].tolist()]
    assert kinds == ["alloc", "free", "reset_peak"]
    assert recs["region"][2] == recs["region"][0] != 0  # seen inside the region
    assert lord.max_memory_allocated("cpu") == nbytes(b)
    # the region keeps its own peak: live bytes at entry plus c
    assert r.stats["cpu"]["peak"] == nbytes(b) + nbytes(c)
    assert r.stats["cpu"]["peak_delta"] == nbytes(c)


def test_resets_are_logged_at_debug(caplog) -> None:
    lord, a, b = lord_with_history()
    caplog.set_level(logging.DEBUG, logger="memlord")
    lord.reset_peak_memory_stats("cpu")
    lord.reset_memory_stats("cpu")
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("memlord")]
    assert any(line.startswith("[reset_peak] cpu ") for line in lines), lines
    assert any(line.startswith("[reset_accumulated] cpu ") for line in lines), lines
    # and no line reads a reset as an allocation or a free
    assert not any(line.startswith(("[allocate]", "[free]")) for line in lines), lines


def test_the_new_kinds_are_the_c_cores() -> None:
    assert "reset_peak" in _core.EVENT_KINDS and "reset_accumulated" in _core.EVENT_KINDS
    assert memlord.EVENT_KINDS is _core.EVENT_KINDS
