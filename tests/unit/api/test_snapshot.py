"""Live snapshots, leak checks, growth, and the event ring's address and lifetime_ns:
exact numbers on the CPU, against the live storages and hand counts."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from conftest import fake_cuda, here

from memlord import LeakCheck, MemLord
from memlord._sites import relative_path

HERE = relative_path(__file__)
ENTRY_KEYS = {
    "nbytes",
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "site",
    "region",
    "age_s",
    "tracked",
    "category",
}


def site(line: int) -> str:
    return f"{HERE}:{line}"


def storage_bytes(*tensors: torch.Tensor) -> int:
    """The bytes of the distinct storages of tensors."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr(), s.nbytes()] = s.nbytes()
    return sum(seen.values())


@pytest.fixture
def lord():
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    yield lord
    h.disable()


# ---- snapshots -------------------------------------------------------------------------


def test_snapshot_totals_order_and_fields(lord):
    a = torch.empty(16)
    line_a = here() - 1
    with lord.region("load"):
        b = torch.zeros(3, 4, 5, dtype=torch.float16, requires_grad=True)
        line_b = here() - 1
    c = torch.empty(2, 3, 4, 5, 6)  # 5 dims: the shape is kept as a tuple
    d = torch.empty(100_000, 3)  # a large first dimension still packs
    snap = lord.snapshot(top=3)
    assert list(snap) == ["cpu"]
    cpu = snap["cpu"]
    assert set(cpu) == {"total_bytes", "count", "top"}
    assert cpu["total_bytes"] == storage_bytes(a, b, c, d) == lord.allocated("cpu")[0]
    assert cpu["count"] == 4
    top = cpu["top"]
    assert [e["nbytes"] for e in top] == [1_200_000, 2880, 120]
    for e in top:
        assert set(e) == ENTRY_KEYS
        assert e["device"] == "cpu" and e["tracked"] is True
        assert isinstance(e["age_s"], float) and e["age_s"] >= 0
    assert top[0]["shape"] == (100_000, 3) and top[0]["dtype"] == "torch.float32"
    assert top[1]["shape"] == (2, 3, 4, 5, 6)
    assert type(top[1]["shape"]) is tuple
    e = top[2]
    assert e["shape"] == (3, 4, 5) and e["dtype"] == "torch.float16"
    assert e["requires_grad"] is True and e["region"] == "load" and e["site"] == site(line_b)
    small = lord.snapshot(top=10)["cpu"]["top"][-1]
    assert small["site"] == site(line_a) and small["region"] is None
    assert small["shape"] == (16,) and small["requires_grad"] is False
    assert lord.snapshot(top=0)["cpu"] == {"total_bytes": cpu["total_bytes"], "count": 4, "top": []}
    del a, b, c, d
    assert lord.snapshot() == {}


def test_snapshot_scalar_and_odd_shapes(lord):
    s = torch.tensor(1.5, dtype=torch.float64)
    wide = torch.empty(1, 70_000, 1, dtype=torch.uint8)  # 70,000 > 2**16 in 3 dims: a tuple
    top = lord.snapshot()["cpu"]["top"]
    by_bytes = {e["nbytes"]: e for e in top}
    assert by_bytes[8]["shape"] == () and by_bytes[8]["dtype"] == "torch.float64"
    assert by_bytes[70_000]["shape"] == (1, 70_000, 1)
    del s, wide


def test_snapshot_per_device():
    lord = MemLord(auto_gc_bytes=None)
    x = fake_cuda(256, 0)  # made before tracking: allocate() tracks it on cuda:0
    y = fake_cuda(64, 1)
    h = lord.hook_into_python()
    lord.allocate([x, y])
    z = torch.empty(10)
    snap = lord.snapshot()
    assert sorted(snap) == ["cpu", "cuda:0", "cuda:1"]
    assert snap["cuda:0"]["total_bytes"] == 1024 and snap["cuda:0"]["count"] == 1
    assert snap["cuda:1"]["total_bytes"] == 256 and snap["cuda:1"]["count"] == 1
    assert snap["cpu"]["total_bytes"] == 40
    assert snap["cuda:0"]["top"][0]["device"] == "cuda:0"
    for dev, d in snap.items():
        assert d["total_bytes"] == lord.allocated(dev)[0]
    del x, y, z
    h.disable()


def test_top_is_per_device():
    lord = MemLord(auto_gc_bytes=None)
    xs = [fake_cuda(n, 0) for n in (10, 30, 20)]
    h = lord.hook_into_python()
    lord.allocate(xs)
    ys = [torch.empty(n) for n in (5, 50, 7)]
    snap = lord.snapshot(top=2)
    assert [e["nbytes"] for e in snap["cuda:0"]["top"]] == [120, 80]
    assert [e["nbytes"] for e in snap["cpu"]["top"]] == [200, 28]
    del xs, ys
    h.disable()


def test_views_and_detach_share_one_storage(lord):
    t = torch.empty(100)
    v = t[10:20]
    d = t.detach()
    p = torch.nn.Parameter(t)  # re-wraps the same storage
    w = t.view(10, 10)
    snap = lord.snapshot()["cpu"]
    assert snap["count"] == 1 and snap["total_bytes"] == 400
    assert snap["top"][0]["shape"] == (100,)  # the tensor memlord saw first
    del t
    assert lord.snapshot()["cpu"]["count"] == 1  # the views keep it alive
    del v, d, p, w
    assert lord.snapshot() == {}


def test_include_untracked_no_double_count():
    lord = MemLord(auto_gc_bytes=None)
    pre = torch.empty(12_345)  # made before tracking: memlord never saw it
    h = lord.hook_into_python()
    view_of_pre = pre[:5]
    tracked = torch.empty(7)
    tracked_view = tracked[1:]
    plain = lord.snapshot(top=1_000_000)
    full = lord.snapshot(top=1_000_000, include_untracked=True)
    cpu, fcpu = plain["cpu"], full["cpu"]
    assert "untracked_bytes" not in cpu
    assert fcpu["count"] == cpu["count"] + fcpu["untracked_count"]
    assert fcpu["total_bytes"] == cpu["total_bytes"] + fcpu["untracked_bytes"]
    mine = [e for e in fcpu["top"] if e["nbytes"] == 12_345 * 4 and e["shape"] == (12_345,)]
    assert len(mine) == 1 and mine[0]["tracked"] is False  # pre and its view: one storage
    assert set(mine[0]) == ENTRY_KEYS
    assert mine[0]["site"] is None and mine[0]["age_s"] is None
    tracked_entries = [e for e in fcpu["top"] if e["tracked"]]
    assert len(tracked_entries) == cpu["count"] == 1  # tracked and its view: counted once
    assert tracked_entries[0]["nbytes"] == 28
    assert fcpu["untracked_bytes"] >= 12_345 * 4
    # top is cut per device after merging, largest first
    cut = lord.snapshot(top=2, include_untracked=True)["cpu"]["top"]
    assert len(cut) == 2 and cut[0]["nbytes"] >= cut[1]["nbytes"]
    del pre, view_of_pre, tracked, tracked_view
    h.disable()


def test_snapshot_without_tracking_raises():
    lord = MemLord(auto_gc_bytes=None)
    for call in (
        lambda: lord.snapshot(),
        lambda: lord.leak_check(),
        lambda: lord.assert_no_leak(),
        lambda: lord.step(),
    ):
        with pytest.raises(RuntimeError, match="hook_into_python"):
            call()
    h = lord.hook_into_python()
    assert lord.snapshot() == {}
    h.disable()
    with pytest.raises(RuntimeError, match="lifetime tracking"):
        lord.snapshot()


@pytest.mark.parametrize(
    ("kwargs", "exc", "text"),
    [
        ({"top": -1}, ValueError, "'top'"),
        ({"top": "3"}, TypeError, "'top'"),
        ({"top": True}, TypeError, "'top'"),
        ({"top": 2.0}, TypeError, "'top'"),
        ({"include_untracked": 1}, TypeError, "'include_untracked'"),
    ],
)
def test_snapshot_bad_arguments(lord, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        lord.snapshot(**kwargs)


@pytest.mark.parametrize("method", ["leak_check", "assert_no_leak"])
@pytest.mark.parametrize("value", [1, None, "yes"])
def test_leak_check_bad_collect_changes_nothing(lord, method, value):
    t = torch.empty(10)
    before = lord.snapshot()
    with pytest.raises(TypeError, match="'collect'"):
        getattr(lord, method)(collect=value)
    assert lord.snapshot()["cpu"]["count"] == before["cpu"]["count"]
    with getattr(lord, method)() as check:  # a check works as before
        pass
    assert check.leaked == []
    del t


def test_numpy_arrays_are_tracked_without_tensor_metadata(lord):
    a = np.zeros(50, dtype=np.float64)
    lord.allocate(a)
    e = lord.snapshot()["cpu"]["top"][0]
    assert e["nbytes"] == 400 and e["dtype"] is None and e["shape"] is None
    del a


def test_snapshot_reads_the_registry_not_the_heap(lord, monkeypatch):
    t = torch.empty(4)

    def boom():
        raise AssertionError("snapshot() must not scan the heap")

    monkeypatch.setattr(gc, "get_objects", boom)
    assert lord.snapshot()["cpu"]["count"] == 1
    del t


# ---- leak checks -------------------------------------------------------------------------


def test_leak_check_finds_a_deliberate_leak(lord):
    before = torch.empty(3)  # born before: never reported
    kept = []
    with lord.leak_check() as lc:
        kept.append(torch.empty(256))
        line = here() - 1
        tmp = torch.empty(1000)
        del tmp
        with lord.region("inner"):
            kept.append(torch.empty(2, 8, dtype=torch.float64))
            line2 = here() - 1
    assert isinstance(lc, LeakCheck)
    assert [e["nbytes"] for e in lc.leaked] == [1024, 128]
    assert lc.leaked[0]["site"] == site(line) and lc.leaked[0]["tracked"] is True
    assert lc.leaked[1]["site"] == site(line2) and lc.leaked[1]["region"] == "inner"
    assert lc.leaked[1]["shape"] == (2, 8) and lc.leaked[1]["dtype"] == "torch.float64"
    assert lc.by_site() == {
        site(line): {"bytes": 1024, "count": 1},
        site(line2): {"bytes": 128, "count": 1},
    }
    assert site(line) in lc.table()
    kept.clear()
    assert lc.check() == [] and lc.leaked == []
    del before


def test_leak_table_limit_is_checked_and_never_drops_a_site(lord):
    """table(limit) lists at most limit sites: a negative limit was a slice from the end
    (table(-1) silently left out the last site), a str a bare "slice indices" error."""
    kept = []
    with lord.leak_check() as lc:
        kept.append(torch.empty(256))
        kept.append(torch.empty(64))
    assert len(lc.by_site()) == 2
    sites = list(lc.by_site())
    assert all(s in lc.table() for s in sites)
    assert sites[0] in lc.table(limit=1) and sites[1] not in lc.table(limit=1)
    before = lc.leaked
    with pytest.raises(ValueError, match="table\\(\\): argument 'limit' must be >= 0, not -1"):
        lc.table(limit=-1)
    with pytest.raises(TypeError, match="argument 'limit' must be an int, not str"):
        lc.table("2")
    with pytest.raises(TypeError, match="argument 'limit' must be an int, not bool"):
        lc.table(True)
    assert lc.leaked is before
    kept.clear()


def test_leak_check_collects_cycles_first(lord):
    with lord.leak_check() as lc:
        cyc: list = [torch.empty(64)]
        cyc.append(cyc)
        del cyc
    assert lc.leaked == []
    gc.disable()  # the cycle must survive until the check (GC torture collects at once)
    try:
        with lord.leak_check(collect=False) as lc:
            cyc = [torch.empty(64)]
            cyc.append(cyc)
            del cyc
    finally:
        gc.enable()
    assert len(lc.leaked) == 1
    gc.collect()


def test_assert_no_leak(lord):
    with lord.assert_no_leak():
        t = torch.empty(100)
        del t
    kept = []
    with pytest.raises(AssertionError) as info:
        with lord.assert_no_leak():
            kept.append(torch.empty(10, 10))
            line = here() - 1
    text = str(info.value)
    assert "1 storage (400 B)" in text
    assert site(line) in text and "count" in text and "bytes" in text
    # an exception from the block wins: no AssertionError on top of it
    with pytest.raises(KeyError):
        with lord.assert_no_leak():
            kept.append(torch.empty(5))
            raise KeyError("mine")


# ---- growth ------------------------------------------------------------------------------


def test_growth_reports_a_growing_list_not_a_steady_loop(lord):
    history = []
    steady = None
    assert lord.growth() == []
    for _ in range(5):
        history.append(torch.empty(100))
        line = here() - 1
        steady = torch.empty(1000)  # replaced every step: live bytes stay the same
        lord.step()
    assert lord.steps == 5
    g = lord.growth(min_steps=3)
    assert g == [{"site": site(line), "bytes": [800, 1200, 1600, 2000], "growth": 1200}]
    assert lord.growth(min_steps=4)[0]["bytes"] == [400, 800, 1200, 1600, 2000]
    assert lord.growth(min_steps=5) == []  # only 5 steps marked: 6 samples needed
    history.pop()
    lord.step()
    assert lord.growth(1) == []
    del steady


@pytest.mark.parametrize(
    ("value", "exc"),
    [
        (0, ValueError),
        (-1, ValueError),
        (10_000, ValueError),
        ("3", TypeError),
        (True, TypeError),
        (3.0, TypeError),
    ],
)
def test_growth_bad_arguments_change_nothing(lord, value, exc):
    lord.step()
    with pytest.raises(exc, match="'min_steps'"):
        lord.growth(value)
    assert lord.steps == 1


# ---- the event ring's address and lifetime_ns --------------------------------------------


def test_ring_address_and_lifetime_against_a_hand_count(lord):
    lord.record_events(64)
    t = torch.empty(100)
    addr = t.untyped_storage().data_ptr()
    v = t[3:]  # a view: no event
    u = torch.zeros(3, dtype=torch.uint8)
    uaddr = u.untyped_storage().data_ptr()
    del t
    del v  # the storage dies here
    del u
    ev = lord.decode_events(lord.events())
    assert [(e["kind"], e["source"], e["bytes"]) for e in ev] == [
        ("alloc", "factory", 400),
        ("alloc", "factory", 3),
        ("free", "death", 400),
        ("free", "death", 3),
    ]
    assert [e["address"] for e in ev] == [addr, uaddr, addr, uaddr]
    assert [e["lifetime_ns"] > 0 for e in ev] == [False, False, True, True]
    assert ev[2]["lifetime_ns"] <= ev[2]["t_ns"] - ev[0]["t_ns"] + 1_000_000
    raw = lord.events()
    assert int(raw["address"][0]) == addr and int(raw["lifetime_ns"][2]) > 0


def test_ring_address_of_explicit_calls():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(16)
    a, b = torch.empty(10), torch.empty(20)
    lord.allocate(a)
    lord.allocate([a, b])  # an event per storage, each with its own address
    lord.free(a)
    ev = lord.decode_events(lord.events())
    assert [(e["kind"], e["count"]) for e in ev] == [("alloc", 1)] * 3 + [("free", 1)]
    pa, pb = (t.untyped_storage().data_ptr() for t in (a, b))
    assert [e["address"] for e in ev] == [pa, pa, pb, pa]
    assert all(e["lifetime_ns"] == 0 for e in ev)  # not tracked


def test_ring_lifetime_of_an_explicit_free_of_a_tracked_storage(lord):
    lord.record_events(16)
    t = torch.empty(10)
    lord.free(t)
    ev = lord.decode_events(lord.events())
    assert [e["kind"] for e in ev] == ["alloc", "free"]
    assert ev[1]["address"] == t.untyped_storage().data_ptr() and ev[1]["lifetime_ns"] > 0
    del t
    assert len(lord.events()) == 2  # untracked by the free: its death adds nothing


def test_ring_address_of_a_hooked_conversion():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(16)
    t = torch.empty(64)
    with lord.hook_into_torch():
        h = t.half()
    ev = lord.decode_events(lord.events())
    assert [(e["kind"], e["source"]) for e in ev] == [("alloc", "convert")]
    assert ev[0]["address"] == h.untyped_storage().data_ptr()


def test_ring_decodes_a_parameter_event():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(4)
    t = torch.empty(10)  # made before tracking: the Parameter finds it
    with lord.hook_into_python():
        p = torch.nn.Parameter(t)
        (e,) = lord.decode_events(lord.events())
    assert e["source"] == "found" and e["address"] == p.untyped_storage().data_ptr()
    assert e["category"] == "parameter" and e["bytes"] == p.untyped_storage().nbytes()


# ---- threads, reference counts, memory ---------------------------------------------------


def test_snapshots_from_threads(lord):
    errors = []
    keep: list = []
    lock = threading.Lock()

    def work(k: int) -> None:
        try:
            for i in range(200):
                t = torch.empty(k + 1, i % 7 + 1)
                if i % 10 == 0:
                    with lock:
                        keep.append(t)
                snap = lord.snapshot(top=3)
                assert "cpu" in snap
                if i % 50 == 0:
                    lord.step()
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    cpu = lord.snapshot(top=0)["cpu"]
    assert cpu["count"] == len(keep) == 80
    assert cpu["total_bytes"] == storage_bytes(*keep) == lord.allocated("cpu")[0]
    keep.clear()
    assert lord.snapshot() == {}


def test_reference_counts_stable_after_many_snapshots(lord):
    t = torch.empty(2, 3, 4, 5, 6)  # its shape lives in the tracker as a tuple
    s = t.untyped_storage()
    shape = lord.snapshot()["cpu"]["top"][0]["shape"]
    refs = (sys.getrefcount(t), sys.getrefcount(s), sys.getrefcount(shape))
    for i in range(200):
        lord.snapshot(top=5)
        if i % 20 == 0:  # a scan of every object: ten of them are enough
            lord.snapshot(top=5, include_untracked=True)
        with lord.leak_check(collect=False):
            pass
        lord.step()
    lord.growth()
    assert (sys.getrefcount(t), sys.getrefcount(s), sys.getrefcount(shape)) == refs
    del t, s


def test_tracker_size_and_hash(lord):
    t = torch.empty(4)
    s = t.untyped_storage()
    (tracker,) = [r for r in weakref.getweakrefs(s) if type(r).__name__ == "Tracker"]
    # weakref.ref's fields plus 40 B: the snapshot's metadata within the 192 B budget
    assert type(tracker).__basicsize__ == weakref.ref.__basicsize__ + 40
    assert hash(tracker) == hash(s)  # the key in the hash field is not what hash() says
    assert tracker() is s
    # the guard for keeping the table key in weakref.ref's `hash` field: whatever CPython
    # does with the reference (hash it, compare it, list it), the key stays, so the
    # lord still finds the storage and credits it once
    for _ in range(3):
        assert hash(tracker) == hash(s) and tracker == weakref.ref(s)
        assert tracker in weakref.getweakrefs(s) and {tracker: 1}[tracker] == 1
    assert lord._tracks_storage(s)
    before = lord.memory_allocated("cpu")
    lord.free(t)
    assert lord.memory_allocated("cpu") == before - 16 and not lord._tracks_storage(s)
    del t, s
    with pytest.raises(TypeError):
        hash(tracker)


def test_nothing_tracked_yet(lord):
    """An empty registry: every reader answers with nothing (under UBSan this once sorted a
    NULL array: qsort's array must not be NULL, even with no element)."""
    lord.reset()
    import gc

    gc.collect()
    assert all(d["count"] == 0 for d in lord.snapshot().values())
    with lord.leak_check() as check:
        pass
    assert check.leaked == [] and check.by_site() == {}
    lord.step()
    lord.step()
    assert lord.growth(min_steps=1) == []
