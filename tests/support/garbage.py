"""Garbage that the cyclic collector frees over several passes."""

from __future__ import annotations

import weakref

import torch


def layered_garbage(layers: int = 6) -> list[weakref.ref]:
    """A model torch's MemTracker tracked through one training step, dropped: garbage that
    the collector frees one module at a time (objects that garbage refers to where the
    collector cannot see).  Returns weak references to its parameters."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(layers)))
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        model(torch.ones(2, 64)).sum().backward()
    return [weakref.ref(p) for p in model.parameters()]


def alive(refs: list[weakref.ref]) -> int:
    """How many of refs still refer to something."""
    return sum(r() is not None for r in refs)
