"""The event seam: auto-GC runs at a safe point, the dispatcher holds lords weakly, each
module instance owns and frees its state, and records, queries and getters stay sound while
the ledger or the configuration changes under them (a reset inside a log handler or from
another thread, a GC inside a query, a finalizer that reconfigures auto-GC); which sinks
run follows their busy words (repros r01, r01b, r12, r18, r22)."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch
from conftest import under_asan
from support import warm

import memlord
from memlord import MemLord, _backend, _core, _log


class OnCuda(torch.Tensor):
    """A cpu tensor that reports cuda:0 (stands in for a CUDA tensor without a GPU)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


@pytest.fixture
def release_spy():
    """Replace the backend cache release with a spy; cpu counts as a device with a cache."""
    calls = []
    state = {"check": None}

    def spy(device_type, index):
        calls.append((device_type, index, state["check"]() if state["check"] else None))
        return True

    def configure(release):
        _core._configure(
            release_cache=release,
            torch_prefix=os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
            memlord_prefix=os.path.dirname(os.path.abspath(memlord.__file__)) + os.sep,
            logger=_log.logger,
            debug_env=_log._debug_env_changed,
            log_event=_log._event,
            log_gc=_log._auto_gc,
        )

    configure(spy)
    was = _core._testing.set_cache_type("cpu", True)
    try:
        yield calls, state
    finally:
        _core._testing.set_cache_type("cpu", was)
        configure(_backend.release_cache)


# ---- auto-GC runs at a safe point -------------------------------------------------------


def test_release_runs_after_the_dying_storage_is_gone(release_spy):
    calls, state = release_spy
    lord = MemLord(auto_gc_bytes=1 << 20)
    with lord.hook_into_python():
        t = torch.ones(1 << 20)  # 4 MiB: freeing it passes the 1 MiB threshold
        storage = weakref.ref(t.untyped_storage())
        state["check"] = lambda: storage() is None
        del t  # the death is credited in the deallocator; the release waits
        _core._testing.safe_point()
    assert lord.gc_runs == 1
    assert calls == [("cpu", -1, True)], calls  # the storage was already gone


def test_release_not_inside_the_deallocator(release_spy):
    calls, state = release_spy
    lord = MemLord(auto_gc_bytes=1)
    depth = {"in_del": 0}

    class Holder:
        def __del__(self):
            depth["in_del"] += 1
            del self.t  # the tensor dies inside another object's finalizer
            depth["in_del"] -= 1

    state["check"] = lambda: depth["in_del"]
    with lord.hook_into_python():
        h = Holder()
        h.t = torch.ones(1000)
        del h
        _core._testing.safe_point()
    assert [c[2] for c in calls] == [0]  # not while the finalizer ran


def test_one_release_per_device_however_many_lords(release_spy):
    calls, _ = release_spy
    lords = [MemLord(auto_gc_bytes=1) for _ in range(3)]
    x = torch.ones(100)
    for lord in lords:
        lord.allocate(x)
    hooks = [lord.hook_into_torch() for lord in lords]
    try:
        x.to("meta")  # a move: every lord credits the cpu source, each one is due
    finally:
        for h in hooks:
            h.disable()
    assert [lord.gc_runs for lord in lords] == [1, 1, 1]
    assert len(calls) == 1, calls


def test_pending_call_runs_a_release_without_further_memlord_calls(release_spy):
    calls, _ = release_spy
    lord = MemLord(auto_gc_bytes=1)
    with lord.hook_into_python():
        t = torch.ones(10)
        del t
        for _ in range(100):  # bytecodes: CPython runs pending calls between them
            pass
        assert len(calls) == 1


def test_auto_gc_record_is_info_and_says_how_many_lords(release_spy, memlog):
    lords = [MemLord(auto_gc_bytes=1) for _ in range(2)]
    x = torch.ones(100)
    for lord in lords:
        lord.allocate(x)
    hooks = [lord.hook_into_torch() for lord in lords]
    try:
        x.to("meta")
    finally:
        for h in hooks:
            h.disable()
    (rec,) = [r for r in memlog.records() if "[auto_gc]" in r.getMessage()]
    assert rec.levelno == logging.INFO
    assert "lords=2" in rec.getMessage() and "cache released" in rec.getMessage()


# ---- the dispatcher holds lords weakly (repro r18) ----------------------------------------


def test_dropped_lord_is_collected_and_torch_restored():
    orig_to, orig_empty = torch.Tensor.to, torch.empty

    def scope():
        lord = MemLord(auto_gc_bytes=None)
        lord.hook_into_torch()
        lord.hook_into_python()
        return weakref.ref(lord)

    w = scope()
    gc.collect()
    _core._testing.safe_point()
    assert w() is None
    assert torch.Tensor.to is orig_to and torch.empty is orig_empty
    info = _core._hooks_info()
    assert not info["installed"] and not info["python_installed"]


def test_lord_kept_alive_by_its_handle():
    lord = MemLord(auto_gc_bytes=None)
    handle = lord.hook_into_torch()
    w = weakref.ref(lord)
    del lord
    gc.collect()
    assert w() is not None and handle.enabled
    torch.ones(4).double()
    assert w().allocated()[0] == 32
    handle.disable()


def test_lord_alive_stays_subscribed_without_its_handle():
    lord = MemLord(auto_gc_bytes=None)
    lord.hook_into_torch()
    gc.collect()
    torch.ones(4).double()
    assert lord.allocated()[0] == 32
    lord.hook_into_torch().disable()


def test_other_lord_keeps_hooks_when_one_is_dropped():
    keep = MemLord(auto_gc_bytes=None)
    h = keep.hook_into_torch()

    def scope():
        lord = MemLord(auto_gc_bytes=None)
        lord.hook_into_torch()
        return weakref.ref(lord)

    w = scope()
    gc.collect()
    _core._testing.safe_point()
    assert w() is None
    assert _core._hooks_info()["subscribers"] == 1
    torch.ones(2).double()
    assert keep.allocated()[0] == 16
    h.disable()


# ---- the ledger changes while records are written (repros r01, r01b) ----------------------


def test_reset_inside_a_log_handler_between_device_records(monkeypatch):
    """A log handler that resets the ledger while one allocate() of two devices is being
    logged: the call completes, and leaves the ledger empty (repro r01)."""
    lord = MemLord(auto_gc_bytes=None)
    a = torch.ones(10)
    b = torch.ones(10).as_subclass(OnCuda)

    class Resetting(logging.Handler):
        done = False

        def emit(self, record):
            if not Resetting.done:
                Resetting.done = True
                lord.reset()

    handler = Resetting()
    logging.getLogger("memlord").addHandler(handler)
    monkeypatch.setenv("DEBUG", "1")
    try:
        lord.allocate([a, b])  # the first record resets the ledger; the second must not crash
    finally:
        logging.getLogger("memlord").removeHandler(handler)
    assert Resetting.done
    assert lord.stats() == {}


def test_reset_from_another_thread_while_a_two_device_call_logs(monkeypatch):
    """Another thread resets the ledger while DEBUG logs two-device allocate() calls: no
    crash, and no counter goes negative (repro r01b)."""
    lord = MemLord(auto_gc_bytes=None)
    a = torch.ones(10)
    b = torch.ones(10).as_subclass(OnCuda)
    monkeypatch.setenv("DEBUG", "1")
    logging.getLogger("memlord").addHandler(logging.NullHandler())
    stop = threading.Event()

    def resetter():
        while not stop.is_set():
            lord.reset()

    t = threading.Thread(target=resetter)
    t.start()
    try:
        for _ in range(300):
            lord.allocate([a, b])
    finally:
        stop.set()
        t.join()
    s = lord.stats()
    assert all(v["allocated"] >= 0 for v in s.values())


# ---- a query never caches an answer older than the ledger (repro r12) ---------------------


def test_allocated_is_never_cached_across_a_gc():
    """allocated() right after a query whose allocation ran the cyclic GC (which freed a
    tracked tensor) answers the ledger as it is now, not as it was (repro r12)."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():

        class Node:
            pass

        n = Node()
        n.me = n
        n.t = torch.empty(1000)
        del n
        gc.disable()
        hold = [(i, -i) for i in range(5000)]  # noqa: F841  (empty the tuple free list)
        gc.set_threshold(1)
        gc.enable()
        try:
            lord.allocated()  # the GC this allocation runs frees the cycle's tensor
            second = lord.allocated()
            now = lord.stats()["cpu"]["allocated"]
        finally:
            gc.set_threshold(700)
        assert second[0] == now  # never the answer from before the collection


# ---- the strategy getter reads no freed memory (repro r22) --------------------------------


def test_strategy_getter_survives_a_finalizer_that_reconfigures_auto_gc():
    """auto_gc_strategy read while a finalizer turns auto-GC off answers the strategy
    before or after the change, never freed memory (repro r22)."""
    strategy = {
        (0, 50): {"metric": "max", "threshold": {"bytes": 1}},
        (50, 101): {"metric": "freed", "threshold": {"percent": 5.0}},
    }
    lord = MemLord(auto_gc_strategy=strategy)

    class Reconfigure:
        def __del__(self):
            lord.set_auto_gc(None)

    gc.disable()
    gc.set_threshold(1)
    try:
        r = Reconfigure()
        r.me = r
        del r
        hold = [(i, -i) for i in range(3000)]  # noqa: F841
        gc.enable()
        s = lord.auto_gc_strategy
    finally:
        gc.set_threshold(700)
        gc.enable()
    assert s in (strategy, None)


# ---- module state hygiene -----------------------------------------------------------------

HYGIENE = textwrap.dedent(
    """\
    import gc, importlib.util, sys, weakref
    import torch
    import memlord._core as loaded
    spec = importlib.util.find_spec("memlord._core")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m is not loaded
    lord = m.Lord()
    lord.allocate(torch.empty(3))
    lord.allocated(); lord.stats(); lord._hotspots(False)
    refs = [weakref.ref(t) for t in (m.Lord, m.TorchHooks, m.PythonHooks)]
    refs.append(weakref.ref(m))
    del lord, m
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    print("alive", alive)
    sys.exit(1 if alive else 0)
    """
)


@pytest.mark.skipif(under_asan(), reason="a second module instance under LSan reports torch")
def test_a_dropped_module_instance_frees_its_heap_types():
    r = subprocess.run([sys.executable, "-c", HYGIENE], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr


SUBINTERP = textwrap.dedent(
    """\
    import _xxsubinterpreters as interpreters
    import memlord
    path = memlord._core.__file__
    interp = interpreters.create()
    code = (
        "import importlib.machinery, importlib.util\\n"
        f"loader = importlib.machinery.ExtensionFileLoader('memlord._core', {path!r})\\n"
        "spec = importlib.util.spec_from_loader('memlord._core', loader)\\n"
        "try:\\n"
        "    m = importlib.util.module_from_spec(spec)\\n"
        "    spec.loader.exec_module(m)\\n"
        "except ImportError as e:\\n"
        "    assert 'more than one interpreter' in str(e), e\\n"
        "else:\\n"
        "    raise SystemExit('loaded in a second interpreter')\\n"
    )
    interpreters.run_string(interp, code)
    print("refused")
    """
)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="_xxsubinterpreters as in 3.11")
def test_a_second_interpreter_cannot_load_the_core():
    r = subprocess.run(
        [sys.executable, "-c", SUBINTERP], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0 and "refused" in r.stdout, r.stdout + r.stderr


# ---- sites ------------------------------------------------------------------------------


def test_site_ids_are_stable_and_resolved_on_demand():
    lord = MemLord(auto_gc_bytes=None)
    for _ in range(3):
        lord.allocate(torch.empty(4))
    line = sys._getframe().f_lineno - 1
    (row,) = lord._hotspots(False)
    dev, site, nbytes, _key = row
    assert (dev, nbytes) == ("cpu", 48)
    filename, resolved = _core._site(site)
    assert filename == __file__ and resolved == line
    assert _core._site(0) is None


# ---- the seam's plan: which sinks run follows their busy words --------------------------


def test_ring_started_after_events_records_and_reads_addresses():
    lord = MemLord(auto_gc_bytes=None)
    t = torch.empty(64)
    with lord.hook_into_torch():
        t.half()  # the seam plans without the ring: no address is read
        lord.record_events(8)
        h = t.half()
        (e,) = lord.decode_events(lord.events())
        assert (e["kind"], e["source"], e["bytes"]) == ("alloc", "convert", 128)
        assert e["address"] == h.untyped_storage().data_ptr() and e["t_ns"] > 0
        lord.record_events(0)
        t.half()
        assert len(lord.events()) == 0
        lord.record_events(8)
        t.double()
        assert [x["bytes"] for x in lord.decode_events(lord.events())] == [512]
    assert lord.allocated("cpu")[0] == 128 + 128 + 128 + 512


def test_hotspots_and_the_ring_both_see_every_hooked_event():
    """The seam's direct path (the hotspot table first, the ring after it) and the general
    one (a region open: its sink reserves too) give the same hotspots and records."""
    lord = MemLord(auto_gc_bytes=None)
    t = torch.empty(64)
    lord.record_events(16)
    with lord.hook_into_torch():
        for _ in range(3):
            t.half()
        line = sys._getframe().f_lineno - 1
        with lord.region("r"):
            t.half()
    hot = {(dev, _core._site(site)): n for dev, site, n, _key in lord._hotspots(False)}
    assert hot[("cpu", (__file__, line))] == 3 * 128
    assert sum(hot.values()) == 4 * 128
    events = lord.decode_events(lord.events())
    expected = [("alloc", 128, "")] * 3 + [("alloc", 128, "r")]
    assert [(e["kind"], e["bytes"], e["region"]) for e in events] == expected
    assert {_core._site(int(e["site"])) for e in lord.events()[:3]} == {(__file__, line)}


def test_region_opened_after_events_sees_them():
    lord = MemLord(auto_gc_bytes=None)
    a, b = torch.empty(10), torch.empty(20)
    lord.allocate(a)  # planned while no region is open
    with lord.region("late") as r:
        lord.allocate(b)
    lord.free(a)  # after the region: not its event
    assert r.stats["cpu"]["allocs"] == 1 and r.stats["cpu"]["delta"] == 80
    assert r.stats["cpu"]["frees"] == 0


WAKE = """
import torch
from memlord import MemLord, _core
lord = MemLord(auto_gc_bytes=1)
t = torch.ones(100)
lord.allocate(t); lord.free(t)  # cpu has no cache: auto-GC has nothing to do
_core._testing.safe_point()
before = lord.gc_runs
_core._testing.set_cache_type("cpu", True)  # now it has: the seam must plan auto-GC in
lord.allocate(t); lord.free(t)
_core._testing.safe_point()
print(before, lord.gc_runs)
"""


def test_auto_gc_wakes_when_a_device_with_a_cache_appears():
    # A fresh process: nothing has made a device with a cache count yet.
    r = warm.run([sys.executable, "-c", WAKE], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1"], (r.stdout, r.stderr)
