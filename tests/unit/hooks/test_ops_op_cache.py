"""hook_into_python(ops=True) remembers each operator's schema facts (its callable, which
returns are new, whether it resizes) by the overload object: a repeated operator is
counted exactly as its first call was, whatever other operators ran between.

The reference is torch's own: the bytes of the storages the outputs hold
(``untyped_storage().nbytes()``), deduplicated by storage."""

from __future__ import annotations

import gc

import torch

from memlord import MemLord


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _workload(x: torch.Tensor) -> list[torch.Tensor]:
    """New outputs (counted), views and in-place ops (nothing new), two-output ops,
    resize_ (counted at its new size), interleaved so that the operators alternate."""
    out = []
    a = x + 1
    out.append(a)
    out.append(a.view(-1))  # a view: nothing new
    b = torch.mul(a, 2)
    out.append(b)
    b.add_(1)  # in place: nothing new
    values, indices = torch.topk(x, 3)
    out += [values, indices]
    c = torch.empty(0)
    c.resize_(64)  # grows: counted at 64 x 4 bytes
    out.append(c)
    out += list(torch.split(b, 2))  # views of b
    out.append(torch.cat([a, b]))
    return out


def test_repeated_operators_count_as_their_first_call_did():
    x = torch.randn(8)
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        held = []
        for _ in range(5):  # first calls fill the cache; the rest hit it
            held += _workload(x)
            assert lord.allocated("cpu")[0] == _storage_bytes(held)
        del held
        gc.collect()
        assert lord.allocated("cpu")[0] == 0


def test_an_operator_first_seen_under_another_lord_is_counted_alike():
    """The cache outlives a lord and its hooks: a fresh lord with fresh hooks counts
    the same operators exactly."""
    x = torch.randn(8)
    first = MemLord()
    with first.hook_into_python(ops=True):
        _workload(x)
    second = MemLord()
    with second.hook_into_python(ops=True):
        held = _workload(x)
        assert second.allocated("cpu")[0] == _storage_bytes(held)
