"""Tensors that gc.freeze() moved out of the collector's reach are found by memlord's scans.

gc.get_objects() lists the cyclic collector's three generations and leaves out the
permanent one, where gc.freeze() puts every object alive at the call: a server that
freezes after loading its model (so that forked workers do not copy its pages) freezes
every weight. memlord's scan of live tensors (``snapshot(include_untracked=True)``,
and the reports' live-tensor source when lifetime tracking is off) read
gc.get_objects() alone and missed them all. The reference here is torch's own storage
size of the tensors the test holds.

conftest.py freezes the heap that imports leave; each test here unfreezes it, freezes
its own objects and restores a frozen heap at the end.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from memlord import MemLord
from memlord._snapshot import _live_tensors


@pytest.fixture
def freezer():
    """gc.freeze() for the test, after the garbage earlier tests left is collected (all
    of it: MemTracker's is freed a module per pass), so that only live objects are
    frozen; at the end everything alive is frozen again, as conftest.py left it."""

    def collect_all() -> None:
        for _ in range(100):
            if gc.collect() == 0:
                return

    collect_all()
    yield gc.freeze
    gc.unfreeze()
    collect_all()
    gc.freeze()


def test_frozen_tensors_are_in_the_live_tensor_scan(freezer):
    weights = [torch.empty(1000 + i) for i in range(5)]
    freezer()
    assert gc.get_freeze_count() > 0
    found = {id(t) for t in _live_tensors()}
    assert all(id(w) in found for w in weights)
    # gc.get_objects() itself does not list them: the reason for the walk
    listed = {id(o) for o in gc.get_objects()}
    assert not any(id(w) in listed for w in weights)


def test_snapshot_counts_frozen_untracked_tensors(freezer):
    weights = [torch.empty(2048), torch.ones(3, 5, dtype=torch.float64)]
    expected = sum(w.untyped_storage().nbytes() for w in weights)
    lord = MemLord()
    with lord.hook_into_python():
        # no collection between the two snapshots: garbage an earlier test left (freed a
        # little per pass, as MemTracker's) would leave the second one's count, not
        # because of the freeze
        gc.disable()
        try:
            before = lord.snapshot(include_untracked=True)
            freezer()
            after = lord.snapshot(include_untracked=True)
        finally:
            gc.enable()
    assert before["cpu"]["untracked_bytes"] >= expected
    assert after["cpu"]["untracked_bytes"] == before["cpu"]["untracked_bytes"]
    assert after["cpu"]["untracked_count"] == before["cpu"]["untracked_count"]


def test_frozen_scan_holds_references_only_to_matches(freezer):
    class Marker:
        pass

    markers = [Marker() for _ in range(3)]
    t = torch.empty(7)
    freezer()
    before = [sys.getrefcount(m) for m in markers], sys.getrefcount(t)
    found = _live_tensors()
    assert any(x is t for x in found)
    assert not any(isinstance(x, Marker) for x in found)
    del found
    assert ([sys.getrefcount(m) for m in markers], sys.getrefcount(t)) == before


def test_frozen_tensor_that_dies_leaves_the_scan(freezer):
    t = torch.empty(333)
    ident = id(t)
    freezer()
    assert any(id(x) == ident for x in _live_tensors())
    del t  # a frozen object freed by its refcount leaves the permanent generation
    # id first: the scan also meets what other tests left, a lazy module's
    # UninitializedParameter among them, whose numel() raises
    assert not any(id(x) == ident and x.numel() == 333 for x in _live_tensors())
