"""The measures the tests compare memlord with: what a lord's CPU ledger holds once
garbage is collected, the bytes of the distinct storages some tensors use (read from
torch), and what torch.profiler's memory timeline saw of a block."""

from __future__ import annotations

import contextlib
import gc
import sys
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
    #: how many code objects exec() ran in the block (kept alive until the profile was read)
    kept_code: int = 0


#: the code objects run by exec() while a ``torch_memory()`` block records Python stacks,
#: one list per open block (see ``_keep_executed_code``)
_KEPT_CODE: list[list[Any]] = []


def _keep_executed_code(event: str, args: tuple[Any, ...]) -> None:
    if event == "exec" and _KEPT_CODE:
        _KEPT_CODE[-1].append(args[0])


# Audit hooks cannot be removed: one for the process, doing nothing outside a block.
sys.addaudithook(_keep_executed_code)


@contextlib.contextmanager
def torch_memory() -> Iterator[TorchMemory]:
    """Run the block under torch's profiler with memory profiling (the outside reference
    for what memlord counts of the same code).

    torch's profiler (2.11 and 2.13), recording Python stacks, keeps the name of each
    function it saw as a pointer into the function's code object, without a reference,
    and reads it when the profile ends: a module imported for the first time in the block
    (its top-level code, ``<module>``, is freed once it has run) left ASan a
    heap-use-after-free in torch (``torch::profiler::impl::Result::name``). The code that
    import and exec() run in the block is kept alive until the profile has been read."""
    seen = TorchMemory()
    kept: list[Any] = []
    _KEPT_CODE.append(kept)
    try:
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
        seen.kept_code = len(kept)
    finally:
        del _KEPT_CODE[next(i for i, k in enumerate(_KEPT_CODE) if k is kept)]
