"""Where the profiler's memory numbers come from: one small adapter over memlord's
public API, so the profiler and the CLI never reach into the ledger themselves.

Today it reads a :class:`memlord.MemLord` that the adapter owns (or is given):

* totals per device from ``lord.stats()`` (allocated from the ledger, the live storage
  count as ``allocs - frees``), pending deferred frees from ``TorchHooks.pending()``,
  reserved bytes from ``torch.cuda.memory_reserved`` where CUDA is initialised;
* lifetime tracking through ``lord.hook_into_python()`` (so the ledger equals the live
  storages created while profiling), and optionally ``hook_into_torch()``;
* hotspots from ``top_alloc_site``/``top_free_site``;
* the largest live tensors from a scan of ``gc.get_objects()`` (storages counted once),
  as the memory profiler always did.  When memlord's own registry of live storages
  (``lord.snapshot()``) and its event ring exist, this module is the one place to switch.
"""

from __future__ import annotations

import gc
import logging
from itertools import compress
from typing import Any

import torch

from memlord import MemLord

log = logging.getLogger("memlord")


def _tensor_types() -> set[type]:
    """torch.Tensor and every subclass defined so far."""
    out: set[type] = set()
    todo = [torch.Tensor]
    while todo:
        t = todo.pop()
        if t not in out:
            out.add(t)
            todo.extend(type.__subclasses__(t))
    return out


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the cyclic GC tracks, for the caller's thread to inspect.

    ``gc.get_objects()`` returns a list holding a reference to every tracked object,
    including objects another thread is still building: a tuple that ``tuple(gen)`` is
    filling may be resized only while nothing else refers to it, and CPython fails with
    ``SystemError: bad argument to internal function`` otherwise.  So the list lives as
    briefly as possible: it is filtered down to tensors by C code only (no bytecode, so
    no thread switch, inside the filter), with the collector off (no finalizers).  A
    switch can still happen between the two calls, so the profiler never scans from its
    background thread: periodic snapshots carry the ledger's totals only.  memlord's own
    registry of live storages will replace this scan."""
    contains = _tensor_types().__contains__
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        objs = gc.get_objects()
        try:
            return list(compress(objs, map(contains, map(type, objs))))
        finally:
            del objs
    finally:
        if was_enabled:
            gc.enable()


def _tensor_meta(t: torch.Tensor) -> dict[str, Any]:
    """shape, dtype and requires_grad; a tensor without sizes (nested, some subclasses)
    has shape None."""
    try:
        shape: list[int] | None = list(t.shape)
    except RuntimeError:
        shape = None
    return {"shape": shape, "dtype": str(t.dtype), "requires_grad": bool(t.requires_grad)}


class LedgerSource:
    """Memory numbers for the profiler, from a MemLord and its hooks."""

    def __init__(
        self,
        lord: MemLord | None = None,
        *,
        lifetime: bool = True,
        torch_hooks: bool = False,
    ) -> None:
        if lord is not None and not isinstance(lord, MemLord):
            raise TypeError(f"lord must be a memlord.MemLord, got {type(lord).__name__}")
        self.lord = lord if lord is not None else MemLord(auto_gc_bytes=None)
        self._want_lifetime = bool(lifetime)
        self._want_torch = bool(torch_hooks)
        self._python_hooks: Any = None
        self._torch_hooks: Any = None

    # ---- hooks ------------------------------------------------------------------------

    def start(self) -> None:
        if self._want_lifetime and self._python_hooks is None:
            self._python_hooks = self.lord.hook_into_python()
        if self._want_torch and self._torch_hooks is None:
            self._torch_hooks = self.lord.hook_into_torch()

    def stop(self) -> None:
        for name in ("_torch_hooks", "_python_hooks"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                handle.disable()

    # ---- numbers ----------------------------------------------------------------------

    def _pending(self, device: str) -> int:
        hooks = self._torch_hooks
        if hooks is None or not hooks.enabled:
            return 0
        try:
            return int(hooks.pending(device))
        except (TypeError, ValueError, RuntimeError):
            return 0

    @staticmethod
    def _reserved(device: str) -> int | None:
        if not device.startswith("cuda"):
            return None
        try:
            if not torch.cuda.is_initialized():
                return None
            index = int(device.partition(":")[2] or 0)
            return int(torch.cuda.memory_reserved(index))
        except (RuntimeError, ValueError, AssertionError):
            return None

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per device: allocated, live storages, pending and reserved (None: unknown)."""
        out = {}
        for dev, st in self.lord.stats().items():
            out[dev] = {
                "allocated": st["allocated"],
                "live": st["allocs"] - st["frees"],
                "pending": self._pending(dev),
                "reserved": self._reserved(dev),
            }
        return out

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per device: memlord's stats plus pending and reserved."""
        out = {}
        for dev, st in self.lord.stats().items():
            row = dict(st)
            row["pending"] = self._pending(dev)
            row["reserved"] = self._reserved(dev)
            out[dev] = row
        return out

    def hotspots(self) -> list[dict[str, Any]]:
        out = []
        for dev in self.lord.stats():
            for kind, query in (
                ("alloc", self.lord.top_alloc_site),
                ("free", self.lord.top_free_site),
            ):
                site = query(dev)
                if site is not None:
                    device, where, nbytes = site
                    row = {"device": str(device), "kind": kind, "site": where, "bytes": nbytes}
                    out.append(row)
        return out

    @staticmethod
    def scan_tensors(top: int = 10) -> dict[str, dict[str, Any]]:
        """The live tensors Python can see, per device: count, total bytes (each storage
        once) and the ``top`` largest, found by scanning ``gc.get_objects()``."""
        devices: dict[str, dict[str, Any]] = {}
        seen: set[tuple[str, int, int]] = set()
        for obj in _live_tensors():
            try:
                if obj.is_meta:
                    continue
                storage = obj.untyped_storage()
                device = str(obj.device)
                nbytes = int(storage.nbytes())
                key = (device, int(storage.data_ptr()), nbytes)
                meta = _tensor_meta(obj)
            except Exception:  # noqa: BLE001 - a subclass or fake tensor may refuse
                continue
            entry = devices.setdefault(device, {"count": 0, "total_bytes": 0, "tensors": []})
            entry["count"] += 1
            if key in seen:
                continue
            seen.add(key)
            entry["total_bytes"] += nbytes
            entry["tensors"].append(
                {
                    "size_mb": round(nbytes / (1024 * 1024), 4),
                    "nbytes": nbytes,
                    **meta,
                    "device": device,
                    "operation": None,
                }
            )
        for entry in devices.values():
            entry["tensors"].sort(key=lambda t: -t["nbytes"])
            del entry["tensors"][top:]
        return devices
