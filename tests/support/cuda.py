"""What torch's CUDA allocator holds beyond tensors' storages, measured by torch itself."""

from __future__ import annotations

import torch


def library_workspace_bytes(device: int = 0) -> int:
    """The bytes of the cuBLAS/cuBLASLt workspaces torch keeps allocated on ``device``
    (one per handle and stream, 32 MiB each on Hopper by default): the allocated bytes that
    ``torch._C._cuda_clearCublasWorkspaces()`` releases. They are raw allocations of the
    caching allocator, no tensor's storage, so memlord's ledger does not count them. Torch
    makes them again at the next matrix product."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch._C._cuda_clearCublasWorkspaces()
    return before - torch.cuda.memory_allocated(device)
