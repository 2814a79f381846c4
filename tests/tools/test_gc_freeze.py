"""The suite freezes the heap (gc.freeze()) after each test module, so that thousands of
later gc.collect() calls do not walk it again (tests/conftest.py).  Garbage left at that
moment is frozen too, never collected, and live to every later scan of the heap: it must
be collected first, however many passes that takes."""

from __future__ import annotations

import gc

import pytest
from conftest import collect_all_garbage
from support.garbage import alive, layered_garbage

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")


def test_one_pass_leaveslayered_garbage():
    """The premise: one gc.collect() leaves some of it (what the conftest froze before)."""
    gc.collect()
    refs = layered_garbage()
    gc.collect()
    assert alive(refs) > 0
    collect_all_garbage()


def test_collect_all_garbage_frees_it_before_a_freeze():
    """test_fit_memory's parameters after test_ops_vs_memtracker.py counted 133,120 B of
    that module's models, frozen after one pass."""
    gc.collect()
    refs = layered_garbage()
    passes = collect_all_garbage()
    assert alive(refs) == 0
    assert passes > 2  # it took more than one pass that found something
    assert collect_all_garbage() == 1  # and nothing is left to find
