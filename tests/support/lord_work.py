"""A lord after real work, for the report tests (unit/python) and the browser tests
(integration): allocations and frees in nested regions and a module's forward and
backward, recorded in the event ring."""

from __future__ import annotations

import torch
from conftest import here

from memlord import MemLord
from memlord._sites import relative_path


class Work:
    """A lord, recording, after allocations and frees in nested regions and a module's
    forward and backward; the Region objects are kept to compare with."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.lord = lord = MemLord(auto_gc_bytes=None)
        lord.record_events(capacity)
        self.hooks = lord.hook_into_python()
        self.keep = []
        with lord.region("load") as self.load:
            self.keep.append(torch.zeros(1000))  # 4000 bytes
            self.site = f"{relative_path(__file__)}:{here() - 1}"
            with lord.region("scratch") as self.scratch:
                tmp = torch.zeros(250, dtype=torch.float64)  # 2000 bytes
                self.keep.append(torch.ones(100))  # 400 bytes
            del tmp
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        with lord.track_modules(self.model):
            x = torch.randn(4, 8, requires_grad=True)
            self.model(x).sum().backward()
        with lord.region("step") as self.step:
            self.keep.append(torch.empty(64, 64))  # 16384 bytes

    def close(self) -> None:
        self.hooks.disable()
