"""Backend cache release for auto-GC (called from C; not on a hot path)."""

from __future__ import annotations

import torch


def release_cache(device_type: str, index: int) -> bool:
    """Release the caching allocator's unused blocks after the counters of one device
    asked for it, and say whether a cache was released.  A backend that was never
    initialised holds no cache, so nothing runs (and nothing initialises it).

    CUDA: ``torch.cuda.empty_cache()`` releases the unused cached blocks of *every*
    device (c10's ``emptyCache`` loops over all device allocators); entering
    ``torch.cuda.device(index)`` first would change nothing about that, and for an
    index torch does not have (a counted device that this host lacks) it raises.  So
    nothing is entered, the caller's current device is never touched, and an index
    torch does not have releases nothing."""
    if device_type == "cuda":
        cuda = torch.cuda
        if not cuda.is_initialized() or not 0 <= index < cuda.device_count():
            return False
        cuda.empty_cache()
        return True
    backend = getattr(torch, device_type, None)
    if backend is None:
        return False
    is_initialized = getattr(backend, "is_initialized", None)
    if is_initialized is not None and not is_initialized():
        return False
    empty_cache = getattr(backend, "empty_cache", None)
    if empty_cache is None:
        return False
    device_ctx = getattr(backend, "device", None)
    if device_ctx is not None and index >= 0 and device_type != "mps":
        with device_ctx(index):
            empty_cache()
    else:
        empty_cache()
    return True


def module_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients a Module conversion converts with its parameters (the core counts the
    new ones after Module._apply, as it counts the parameters)."""
    try:
        return [p.grad for p in module.parameters() if p.grad is not None]
    except Exception:  # a broken module: its parameters were already walked
        return []
