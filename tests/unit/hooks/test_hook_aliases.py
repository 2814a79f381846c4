"""Where torch itself finds a hooked function (torch._C._VariableFunctionsClass for torch.zeros,
torch._C.TensorBase for torch.Tensor.to), the hook is installed too while hooked, and the very
same entries are back after disable(): what a TorchFunctionMode receives, and what unpickling
gives, is the object the program's name resolves to.  A mode that calls the function it
receives makes one allocation, counted once (repros r43, r44)."""

from __future__ import annotations

import pickle

import torch
from torch.overrides import TorchFunctionMode

from memlord import MemLord

VF = torch._C._VariableFunctionsClass
BASE = torch._C.TensorBase


def _entries():
    return {
        "zeros": VF.__dict__["zeros"],
        "empty_like": VF.__dict__["empty_like"],
        "clone": VF.__dict__["clone"],
        "to": BASE.__dict__["to"],
        "half": BASE.__dict__["half"],
        "tclone": BASE.__dict__["clone"],
    }


def test_aliases_installed_and_the_same_entries_restored():
    before = _entries()
    original_zeros = torch.zeros
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python():
        assert torch.zeros is not original_zeros  # hooked
        assert torch._C._VariableFunctions.zeros is torch.zeros
        assert torch._C._VariableFunctions.clone is torch.clone
        assert BASE.to is torch.Tensor.to and BASE.half is torch.Tensor.half
        assert BASE.clone is torch.Tensor.clone
        assert pickle.loads(pickle.dumps(torch.Tensor.half)) is torch.Tensor.half
    after = _entries()
    assert all(after[k] is before[k] for k in before), after
    assert torch.zeros is original_zeros
    assert torch._C._VariableFunctions.zeros is original_zeros
    assert type(BASE.__dict__["to"]).__name__ == "method_descriptor"


def test_python_hooks_alone_leave_tensorbase_conversions_alone():
    before = _entries()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        assert BASE.__dict__["to"] is before["to"]  # not patched by the python hooks
        assert BASE.clone is torch.Tensor.clone
    assert _entries() == before


class Passthrough(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_mode_calling_the_hook_counts_once():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        with Passthrough() as mode:
            t = torch.zeros(1000)
            u = torch.empty_like(t)
        assert mode.funcs[0] is torch.zeros and mode.funcs[1] is torch.empty_like
        expected = t.untyped_storage().nbytes() + u.untyped_storage().nbytes()
        assert lord.allocated()[0] == expected
        del t, u
        assert lord.allocated()[0] == 0


def test_direct_calls_through_torchs_own_names_are_counted():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        t = torch._C._VariableFunctions.ones(500)
        assert lord.allocated()[0] == t.untyped_storage().nbytes()
        del t
        assert lord.allocated()[0] == 0
