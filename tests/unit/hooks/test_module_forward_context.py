"""``_core._module_forward(begin)``, which track_modules' hooks call around a tracked
module's forward so that activation checkpointing's recomputation in backward is
``activation`` (as torch's MemTracker counts it): its answer, and its bad input."""

from __future__ import annotations

import pytest
import torch

from memlord import MemLord, _core


class _Probe(torch.autograd.Function):
    """Calls _module_forward in its backward, inside the autograd engine's graph task,
    and makes a tensor there: the category it is born with says what the core noted."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        began = _core._module_forward(True)
        made = torch.ones(64)  # inside the "recomputed forward"
        _Probe.seen.append((began, made))  # kept alive: its address stays its own
        _core._module_forward(False)
        return g


def test_a_forward_in_backward_is_noted_and_what_it_makes_is_activation():
    lord = MemLord()
    lord.record_events(256)
    _Probe.seen.clear()
    with lord.hook_into_python(ops=True):
        assert _core._module_forward(True) is False  # outside backward: nothing noted
        _core._module_forward(False)
        x = torch.ones(4, requires_grad=True)
        _Probe.apply(x).sum().backward()
        recs = lord.decode_events(lord.events())
    ((began, kept),) = _Probe.seen
    ptr = kept.untyped_storage().data_ptr()
    assert began is True
    (made,) = [e for e in recs if e["kind"] == "alloc" and e["address"] == ptr]
    assert made["category"] == "activation"


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
    # nothing noted: a tensor made in a backward is a temporary, as without the call
    lord = MemLord()
    lord.record_events(256)

    class Make(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            Make.kept = torch.ones(64)  # kept alive: its address stays its own
            return g

    with lord.hook_into_python(ops=True):
        Make.apply(torch.ones(4, requires_grad=True)).sum().backward()
        recs = lord.decode_events(lord.events())
    ptr = Make.kept.untyped_storage().data_ptr()
    (made,) = [e for e in recs if e["kind"] == "alloc" and e["address"] == ptr]
    assert made["category"] == "temporary"
