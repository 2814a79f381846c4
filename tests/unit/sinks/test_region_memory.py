"""What regions keep in memory: the history of closed regions is bounded (settable,
``MemLord(region_history=...)``) and emptied by ``regions(clear=True)``; the interned
region names are freed once nothing refers to them (the event ring's records, tracked
storages, open regions), so per-request names do not grow without bound, and the codes
that are still referred to keep decoding to their names.  Memory is measured with
tracemalloc, outside memlord (repro r26)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch

from memlord import MemLord
from memlord._regions import REGION_HISTORY

LONG = "x" * 40


def _traced_after(lord: MemLord, n: int, ring: int) -> tuple[int, int]:
    """Bytes tracemalloc still sees allocated after n uniquely named regions and
    regions(clear=True), record_events(0), reset(); and the peak table of names."""
    lord.record_events(ring)
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        most = 0
        for i in range(n):
            with lord.region(f"request-{i}-{LONG}"):
                pass
            if i % 997 == 0:
                most = max(most, len(lord._region_names()))
        lord.regions(clear=True)
        lord.record_events(0)
        lord.reset()
        gc.collect()
        cur, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return cur - base, most


@pytest.mark.parametrize("ring", [0, 16, 1000])
def test_clear_record_events_0_and_reset_free_names_and_history(ring: int) -> None:
    lord = MemLord()
    n = 30_000
    held, most = _traced_after(lord, n, ring)
    # 30,000 names and closed regions held about 10 MiB before
    assert held < 512 * 1024, held
    assert lord._region_names() == [""]
    assert lord._region_history() == ([], 0)
    assert lord.regions() == {}
    if ring:
        # the table stays within twice what the ring refers to, and at least 4,096
        assert most <= max(4096, 2 * ring) + 1


def test_history_is_bounded_settable_and_cleared() -> None:
    lord = MemLord(region_history=10)
    for i in range(25):
        with lord.region(f"r{i % 3}"):
            pass
    history, seen = lord._region_history()
    assert seen == 25
    assert [name for name, _ in history] == [f"r{i % 3}" for i in range(15, 25)]
    assert lord.regions()["r0"]["count"] == 9  # older ones still aggregated
    lord.regions(clear=True)
    assert lord._region_history() == ([], 0)
    assert MemLord()._region_aggregate._history.maxlen == REGION_HISTORY
    none = MemLord(region_history=0)
    with none.region("a"):
        pass
    assert none._region_history()[0] == []
    assert none.regions()["a"]["count"] == 1


@pytest.mark.parametrize("bad", [True, 1.5, "10", None])
def test_region_history_must_be_an_int(bad) -> None:
    with pytest.raises(TypeError, match="region_history"):
        MemLord(region_history=bad)


@pytest.mark.parametrize("bad", [-1, 2**63, 2**70])
def test_region_history_must_not_be_negative_or_past_int64(bad) -> None:
    """A value no history can have is a ValueError naming the argument (2**63 and more
    raised OverflowError from the deque it sizes)."""
    with pytest.raises(ValueError, match="region_history"):
        MemLord(region_history=bad)


def test_ring_records_keep_decoding_to_their_region_after_sweeps() -> None:
    lord = MemLord()
    ring = 100
    lord.record_events(ring)
    made = []
    n = 12_000  # several automatic sweeps
    for i in range(n):
        with lord.region(f"step-{i}"):
            t = torch.empty(8, dtype=torch.uint8)
            lord.allocate(t)
            made.append(t)
        if len(made) > ring:
            made.pop(0)
    events = lord.decode_events(lord.events())
    assert len(events) == ring
    assert [e["region"] for e in events] == [f"step-{i}" for i in range(n - ring, n)]
    assert [e["bytes"] for e in events] == [t.untyped_storage().nbytes() for t in made]
    assert len(lord._region_names()) <= 4096 + 1


def test_tracked_storage_and_open_region_keep_their_names_across_sweeps() -> None:
    lord = MemLord()
    with lord.hook_into_python():
        outer = lord.region("outer-still-open")
        outer.__enter__()
        with lord.region("born-here"):
            kept = torch.ones(1000)
        for i in range(10_000):  # new names, never referred to once closed
            with lord.region(f"tmp-{i}"):
                pass
        lord.record_events(0)  # an explicit sweep too
        later = torch.ones(10)  # born inside the open region
        snap = lord.snapshot()
        outer.__exit__(None, None, None)
    regions = {e["nbytes"]: e["region"] for e in snap["cpu"]["top"]}
    assert regions[kept.untyped_storage().nbytes()] == "born-here"
    assert regions[later.untyped_storage().nbytes()] == "outer-still-open"
    assert len(lord._region_names()) <= 4096 + 1


def test_events_name_the_regions_opened_after_a_sweep() -> None:
    lord = MemLord()
    lord.record_events(50)
    for i in range(5000):
        with lord.region(f"old-{i}"):
            pass
    lord.record_events(50)  # sweeps: the old names' slots are free
    for name in ("a", "b", "a"):
        with lord.region(name):
            lord.allocate(torch.empty(4, dtype=torch.uint8))
    assert [e["region"] for e in lord.decode_events(lord.events())] == ["a", "b", "a"]
    names = lord._region_names()
    assert names.count("a") == 1 and names.count("b") == 1
