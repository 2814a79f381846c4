"""The measures the tests compare memlord with: what a lord's CPU ledger holds once
garbage is collected, the bytes of the distinct storages some tensors use (read from
torch), and what torch.profiler's memory timeline saw of a block."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch


def ledger(lord: Any) -> int:
    """The lord's allocated CPU bytes after a garbage collection."""
    gc.collect()
    return int(lord.allocated("cpu")[0])


def storage_bytes(*tensors: torch.Tensor) -> int:
    """The bytes of the distinct storages the tensors use (torch's own figure)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


class TorchMemory:
    """What torch.profiler's memory timeline saw in a ``with torch_memory()`` block (every
    CPU allocation and free, torch.profiler._memory_profiler): its net bytes and its peak
    over the start, both set when the block ends."""

    net: int = 0
    peak: int = 0


@contextlib.contextmanager
def torch_memory() -> Iterator[TorchMemory]:
    """Run the block under torch's profiler with memory profiling (the outside reference
    for what memlord counts of the same code)."""
    seen = TorchMemory()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        yield seen
    net = peak = 0
    for _t, action, _key, size in prof._memory_profile().timeline:
        net += {"CREATE": size, "DESTROY": -size}.get(action.name, 0)
        peak = max(peak, net)
    seen.net, seen.peak = net, peak
