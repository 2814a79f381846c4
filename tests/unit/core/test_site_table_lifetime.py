"""The module-wide site table keeps no code object alive: code generated at run time (exec,
FX's ``<eval_with_key>``, templated kernels) is collected once its user drops it, while the
sites it left stay resolvable for the hotspot tables (repro r25)."""

import gc
import weakref

import torch

from memlord import MemLord, _core


def _generated(src, filename):
    ns = {"torch": torch}
    exec(compile(src, filename, "exec"), ns)
    return ns["f"]


def test_generated_code_dies_after_allocating_through_the_hooks():
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    try:
        f = _generated("def f():\n    return torch.zeros(1000)\n", "<generated-hooks>")
        f()
        code = weakref.ref(f.__code__)
        del f
        gc.collect()
        # dead while the lord and its hooks are alive: no table holds it
        assert code() is None
        # and its site still resolves for the hotspot tables
        assert lord.top_alloc_site() == (torch.device("cpu"), "<generated-hooks>:2", 4000)
    finally:
        h.disable()


def test_generated_code_dies_after_allocate_and_free():
    lord = MemLord(auto_gc_bytes=None)
    t = torch.ones(10)
    f = _generated(
        "def f(lord, t):\n    lord.allocate(t)\n    lord.free(t)\n", "<generated-explicit>"
    )
    for _ in range(10):
        f(lord, t)
    code = weakref.ref(f.__code__)
    del f
    gc.collect()
    assert code() is None
    assert lord.top_alloc_site() == (torch.device("cpu"), "<generated-explicit>:2", 400)
    assert lord.top_free_site() == (torch.device("cpu"), "<generated-explicit>:3", 400)


def test_generated_code_dies_with_lifetime_tracking_and_the_event_ring():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(64)
    h = lord.hook_into_python()
    try:
        f = _generated("def f():\n    return torch.zeros(10)\n", "<generated-tracked>")
        kept = f()  # tracked: its tracker remembers the site
        code = weakref.ref(f.__code__)
        del f
        gc.collect()
        assert code() is None
        [entry] = [e for e in lord.snapshot()["cpu"]["top"] if e["nbytes"] == 40]
        assert entry["site"] == "<generated-tracked>:2"
        assert "<generated-tracked>:2" in {e["site"] for e in lord.decode_events(lord.events())}
        del kept
    finally:
        h.disable()


def test_repeated_generated_code_shares_its_sites():
    """The same source generated again and again is one location, and the table's cache of
    recent code is bounded: memory does not grow with the number of code objects."""
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    try:
        src = "def f():\n    return torch.zeros(1)\n"
        refs = []
        for i in range(3000):
            if i == 2:  # the generated line, and this loop's (where each result dies)
                stacks, locs, _raw, *_ = _core._testing.sites_info()
            f = _generated(src, "<generated-same>")
            f()
            refs.append(weakref.ref(f.__code__))
            del f
        gc.collect()
        assert all(r() is None for r in refs)
        stacks2, locs2, raw2, *_ = _core._testing.sites_info()
        assert (stacks2, locs2) == (stacks, locs)
        assert raw2 <= 1024
    finally:
        h.disable()


def test_a_new_code_object_at_a_dead_ones_address_gets_its_own_line():
    """Nothing is keyed by a code object's address alone: code that reuses a dead code
    object's memory, with another line table, reports its own lines."""
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    try:
        for i in range(50):
            pad = "\n" * (i % 7)
            f = _generated(f"{pad}def f():\n    return torch.zeros(1)\n", "<generated-reuse>")
            lord.reset()
            f()
            assert lord.top_alloc_site()[1] == f"<generated-reuse>:{2 + i % 7}"
            code = weakref.ref(f.__code__)
            f.__globals__.clear()  # no cycle left: it dies now, not at a collection
            del f
            assert code() is None
    finally:
        h.disable()


def test_the_table_keeps_strings_and_no_gc_tracked_object():
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    try:
        f = _generated("def f():\n    return torch.zeros(1)\n", "<generated-referrers>")
        f()
        code = f.__code__
        del f
        gc.collect()
        # only this frame's local refers to the code object
        assert [r for r in gc.get_referrers(code) if r is not globals()] == []
    finally:
        h.disable()
