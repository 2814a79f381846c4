"""The ops-mode tests' two measures: what a lord's CPU ledger holds once garbage is
collected, and the bytes of the distinct storages some tensors use, read from torch."""

from __future__ import annotations

import gc
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
