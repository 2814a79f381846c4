"""``_core._module_forward(begin)``, which track_modules' hooks call around a tracked
module's forward so that activation checkpointing's recomputation in backward is
``activation`` (as torch's MemTracker counts it): its answer, and its bad input."""

from __future__ import annotations

import pytest
import torch

from memlord import MemLord, _core


class _Probe(torch.autograd.Function):
    """Makes a tensor in its backward, inside the autograd engine's graph task, between
    ``_module_forward(True)`` and ``(False)`` when ``note``: the category the tensor is
    born with says what the core noted."""

    note = True
    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        began = _core._module_forward(True) if _Probe.note else None
        made = torch.ones(64)  # inside the "recomputed forward" when noted
        _Probe.seen.append((began, made))  # kept alive: its address stays its own
        if _Probe.note:
            _core._module_forward(False)
        return g


def _category_made_in_backward(note: bool) -> tuple[object, str]:
    """(what _module_forward answered in the backward, the made tensor's category)."""
    lord = MemLord()
    lord.record_events(256)
    _Probe.seen.clear()
    _Probe.note = note
    with lord.hook_into_python(ops=True):
        _Probe.apply(torch.ones(4, requires_grad=True)).sum().backward()
        recs = lord.decode_events(lord.events())
    ((began, kept),) = _Probe.seen
    ptr = kept.untyped_storage().data_ptr()
    # its address may have served a storage freed before: its own is the last alloc
    made = [e for e in recs if e["kind"] == "alloc" and e["address"] == ptr][-1]
    assert made["bytes"] == kept.untyped_storage().nbytes()
    return began, made["category"]


def test_a_forward_in_backward_is_noted_and_what_it_makes_is_activation():
    assert _core._module_forward(True) is False  # outside backward: nothing noted
    _core._module_forward(False)
    assert _category_made_in_backward(note=True) == (True, "activation")


def test_bad_input_is_refused_and_changes_nothing():
    class Bad:
        def __bool__(self):
            raise ValueError("no truth")

    with pytest.raises(TypeError):
        _core._module_forward()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _core._module_forward(True, False)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="no truth"):
        _core._module_forward(Bad())  # type: ignore[arg-type]
    # nothing noted: a tensor made in a backward is a temporary, as without the calls
    assert _category_made_in_backward(note=False) == (None, "temporary")


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("disable", [False, True], ids=["tracking", "disabled_in_recompute"])
def test_backward_after_a_recomputed_forward_that_disabled_the_tracker_is_temporary(
    reentrant, disable
):
    """A tracker disable()d inside a recomputed forward (its hook after the call never
    runs) no longer counts that forward as open: what the rest of the backward makes is a
    temporary, as torch's MemTracker counts backward's own tensors (TEMP), and as when
    the tracker stays on."""
    import torch.utils.checkpoint as cp

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if disable and self.calls == 2:  # the recomputation, in backward
                tracker.disable()
            return self.lin(x).relu()

    inner = Inner()
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(4096)
    _Probe.seen.clear()
    _Probe.note = False  # its backward only makes its tensor
    with lord.hook_into_python(ops=True):
        tracker = lord.track_modules(inner)
        x = _Probe.apply(torch.randn(4, 16, requires_grad=True))
        cp.checkpoint(inner, x, use_reentrant=reentrant).sum().backward()
        tracker.disable()
        recs = lord.decode_events(lord.events())
    assert inner.calls == 2
    ((_, made),) = _Probe.seen  # made after the recomputation, in the same backward
    ptr = made.untyped_storage().data_ptr()
    # its address may have served a storage freed before: its own is the last alloc
    born = [e for e in recs if e["kind"] == "alloc" and e["address"] == ptr][-1]
    assert born["bytes"] == made.untyped_storage().nbytes()
    assert born["category"] == "temporary"
