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
    (made,) = [e for e in recs if e["kind"] == "alloc" and e["address"] == ptr]
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
