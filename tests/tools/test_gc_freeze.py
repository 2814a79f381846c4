"""The suite freezes the heap (gc.freeze()) after each test module, so that thousands of
later gc.collect() calls do not walk it again (tests/conftest.py).  Garbage left at that
moment is frozen too, never collected, and live to every later scan of the heap: it must
be collected first, however many passes that takes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import collect_all_garbage

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")


def _layered_garbage(layers: int = 6) -> list[weakref.ref]:
    """A model torch's MemTracker tracked through one training step, dropped: garbage that
    the collector frees one module at a time (a pass per layer)."""
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(layers)))
    mt = mem_tracker.MemTracker()
    mt.track_external(model)
    with mt:
        model(torch.ones(2, 64)).sum().backward()
    return [weakref.ref(p) for p in model.parameters()]


def _alive(refs: list[weakref.ref]) -> int:
    return sum(r() is not None for r in refs)


def test_one_pass_leaves_layered_garbage():
    """The premise: one gc.collect() leaves some of it (what the conftest froze before)."""
    gc.collect()
    refs = _layered_garbage()
    gc.collect()
    assert _alive(refs) > 0
    collect_all_garbage()


def test_collect_all_garbage_frees_it_before_a_freeze():
    """test_fit_memory's parameters after test_ops_vs_memtracker.py counted 133,120 B of
    that module's models, frozen after one pass."""
    gc.collect()
    refs = _layered_garbage()
    passes = collect_all_garbage()
    assert _alive(refs) == 0
    assert passes > 2  # it took more than one pass that found something
    assert collect_all_garbage() == 1  # and nothing is left to find
