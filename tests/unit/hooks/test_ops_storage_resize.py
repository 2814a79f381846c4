"""``torch.UntypedStorage.resize_`` is no aten operator: memlord's dispatch mode never sees
it, yet FSDP2 frees and re-allocates parameters with it. With ops=True memlord wraps it (as
torch's MemTracker does): a tracked storage counts its change of size, its death credits
its size then; the wrapper goes with the last ops lord, leaving the class as it was,
and nests with MemTracker's own wrapper. Checked against the storage's own ``nbytes()``."""

from __future__ import annotations

import pytest
import torch

from memlord import MemLord

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")


def test_a_tracked_storage_resized_to_zero_and_back_is_counted_at_each_size():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        t = torch.ones(1000) * 2  # an operator's output (torch.ones' storage is gone)
        st = t.untyped_storage()
        assert lord.allocated("cpu")[0] == st.nbytes() == 4000
        base = 0
        st.resize_(0)
        assert lord.allocated("cpu")[0] - base == st.nbytes() == 0
        st.resize_(8000)
        assert lord.allocated("cpu")[0] - base == st.nbytes() == 8000
        del t, st
        assert lord.allocated("cpu")[0] == base


def test_the_class_is_left_as_it_was():
    own_before = "resize_" in torch.UntypedStorage.__dict__
    original = torch.UntypedStorage.resize_
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        assert torch.UntypedStorage.resize_ is not original
        assert torch.UntypedStorage.resize_.__wrapped__ is original
    assert torch.UntypedStorage.resize_ is original
    assert ("resize_" in torch.UntypedStorage.__dict__) == own_before
    with lord.hook_into_python(ops=False):
        assert torch.UntypedStorage.resize_ is original


def test_memtracker_inside_sees_the_same_resize():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        t = torch.zeros(500) + 1
        st = t.untyped_storage()
        mt = mem_tracker.MemTracker()
        mt.track_external(t)
        with mt:
            st.resize_(4000)
            theirs = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        ours = lord.stats("cpu")["cpu"]["categories"]["activation"]
        assert theirs == st.nbytes() == 4000
        assert ours == 4000
