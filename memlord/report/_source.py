"""Where the profiler's memory numbers come from: one small adapter over memlord's
public API, so the profiler and the CLI never reach into the ledger themselves.

Today it reads a :class:`memlord.MemLord` that the adapter owns (or is given):

* totals per device from ``lord.stats()`` (allocated from the ledger, the live storage
  count as ``allocs - frees``), pending deferred frees from the lord's deferred-free
  queue, reserved bytes from ``torch.cuda.memory_reserved`` where CUDA is initialised;
* lifetime tracking through ``lord.hook_into_python()`` (so the ledger equals the live
  storages created while profiling), and optionally ``hook_into_torch()``;
* the event ring (``lord.record_events``), regions and hotspots, turned into the
  document's sections by :mod:`memlord.report._lord`;
* the largest live tensors from :func:`_snapshot_section`, the one place that builds
  them for every snapshot and every report: memlord's registry of live storages
  (``lord.snapshot(top, include_untracked)``) when lifetime tracking is on, else a scan
  of ``gc.get_objects()`` (storages counted once), as the memory profiler always did.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memlord._snapshot import _live_tensors, _owner_rank, _skipped
from memlord.lord import MemLord  # memlord.MemLord, as the Python sources define it

log = logging.getLogger("memlord")


#: Where ``_snapshot_section`` found the tensors (metadata ``top_tensors_from``).
FROM_GC_SCAN = "gc scan"
FROM_REGISTRY = "lifetime registry"


def _snapshot_section(
    lord: MemLord | None, top: int = 10, include_untracked: bool = False
) -> tuple[dict[str, dict[str, Any]], str]:
    """The live tensors per device, in the shape of ``lord.snapshot()``: ``{device:
    {"total_bytes", "count", "top": [{"nbytes", "shape", "dtype", "device",
    "requires_grad", "site", "region", "age_s", "tracked", "category"}, ...]}}`` (largest
    first, at
    most ``top``; shapes as lists), and where they came from.

    This is the single place every snapshot and report gets its tensors from (the
    profiler's checkpoints and final snapshot, ``lord.export()``'s snapshot section).
    With lifetime tracking on, memlord's registry of live storages answers
    (``lord.snapshot(top, include_untracked=...)``: sites, regions and ages known; no
    scan, so any thread may ask).  Otherwise it is the scan of ``gc.get_objects()``,
    which knows no site, region, age or tracking (None), and must run on the caller's
    thread (see :func:`_live_tensors`)."""
    if lord is not None and lord._life_active():
        snap = lord.snapshot(top, include_untracked=include_untracked)
        for entry in snap.values():
            for t in entry["top"]:
                t["shape"] = None if t["shape"] is None else list(t["shape"])
        return snap, FROM_REGISTRY
    scan = LedgerSource.scan_tensors(top)
    out: dict[str, dict[str, Any]] = {}
    for dev, entry in scan.items():
        out[dev] = {
            "total_bytes": entry["total_bytes"],
            "count": entry["count"],
            "top": [
                {
                    "nbytes": t["nbytes"],
                    "shape": t["shape"],
                    "dtype": t["dtype"],
                    "device": t["device"],
                    "requires_grad": t["requires_grad"],
                    "site": None,
                    "region": None,
                    "age_s": None,
                    "tracked": None,
                    "category": None,
                }
                for t in entry["tensors"]
            ],
        }
    return out, FROM_GC_SCAN


def tensor_rows(top: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A section's ``top`` list as the memory profiler's snapshot rows: ``size_mb``,
    ``nbytes``, ``shape``, ``dtype``, ``device``, ``requires_grad``, ``operation`` (the
    region the storage was allocated in, None when unknown), plus ``site``, ``age_s``,
    ``tracked`` and ``category`` where known."""
    rows = []
    for t in top:
        nbytes = int(t.get("nbytes") or 0)
        row = {
            "size_mb": round(nbytes / (1024 * 1024), 4),
            "nbytes": nbytes,
            "shape": t.get("shape"),
            "dtype": t.get("dtype"),
            "device": t.get("device"),
            "requires_grad": t.get("requires_grad"),
            "operation": t.get("region") or None,
        }
        for key in ("site", "age_s", "tracked", "category"):
            if t.get(key) is not None:
                row[key] = t[key]
        rows.append(row)
    return rows


def build_snapshot(
    totals: dict[str, dict[str, Any]],
    section: dict[str, dict[str, Any]] | None,
    checkpoint_name: str | None,
    t_ns: int,
) -> dict[str, Any]:
    """One snapshot in the memory profiler's shape from the ledger's totals per device
    (``allocated``, ``live``, ``pending``, ``reserved``) and, when not None, a
    :func:`_snapshot_section` (the largest tensors); without a section, ``count`` is
    the ledger's live storages."""
    import datetime as _dt

    from ._util import mb

    breakdown = {}
    devices = set(totals) | set(section or {})
    for dev in sorted(devices, key=lambda d: (d != "cpu", d)):
        t = totals.get(dev, {})
        s = (section or {}).get(dev, {"count": 0, "total_bytes": 0, "top": []})
        allocated = t.get("allocated", 0)
        breakdown[dev] = {
            "total_mb": mb(allocated),
            "total_bytes": allocated,
            "count": s["count"] if section is not None else t.get("live", 0),
            "tensors": tensor_rows(s["top"]),
            "live_storages": t.get("live", 0),
            "pending_bytes": t.get("pending", 0),
            "reserved_bytes": t.get("reserved"),
            "visible_bytes": s["total_bytes"],
        }
        if t.get("categories") is not None:
            # the ledger's live bytes by category (they add up to total_bytes)
            breakdown[dev]["categories"] = dict(t["categories"])
    total = sum(b["total_bytes"] for b in breakdown.values())
    return {
        "timestamp": _dt.datetime.now().isoformat(timespec="microseconds"),
        "checkpoint_name": checkpoint_name,
        "t_ns": t_ns,
        "total_mb": mb(total),
        "total_bytes": total,
        "tensor_count": sum(b["count"] for b in breakdown.values()),
        "device_breakdown": breakdown,
    }


def reserved_bytes(device: str) -> int | None:
    """The backend's reserved bytes of ``device`` (CUDA, once initialised), else None."""
    if not device.startswith("cuda"):
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        index = int(device.partition(":")[2] or 0)
        return int(torch.cuda.memory_reserved(index))
    except (RuntimeError, ValueError, AssertionError):
        return None


def pending_bytes(lord: MemLord, device: str) -> int:
    """Bytes of the lord's deferred frees on ``device`` still waiting for their CUDA
    event (0 without the torch hooks)."""
    try:
        return int(lord._pending_bytes(device))
    except (TypeError, ValueError, RuntimeError):
        return 0


def lord_totals(lord: MemLord) -> dict[str, dict[str, Any]]:
    """Per device: allocated, live storages, pending, reserved (None: unknown) and the
    live bytes by category."""
    return {
        dev: {
            "allocated": st["allocated"],
            "live": st["allocs"] - st["frees"],
            "pending": pending_bytes(lord, dev),
            "reserved": reserved_bytes(dev),
            "categories": st["categories"],
        }
        for dev, st in lord.stats().items()
    }


def lord_counters(lord: MemLord) -> dict[str, dict[str, Any]]:
    """Per device: the lord's ``stats()`` (allocated, peak_allocated, gc_runs, ...) plus
    ``pending`` and ``reserved`` (None where unknown)."""
    out = {}
    for dev, st in lord.stats().items():
        row = dict(st)
        row["pending"] = pending_bytes(lord, dev)
        row["reserved"] = reserved_bytes(dev)
        out[dev] = row
    return out


def lord_hotspots(lord: MemLord, limit: int = 10) -> list[dict[str, Any]]:
    """Per device and kind (``alloc``, ``free``), the ``limit`` sites with the most
    cumulative bytes, folded by ``file:line``, largest first: ``device``, ``kind``,
    ``site``, ``bytes``."""
    from memlord._sites import site_location, site_text

    out: list[dict[str, Any]] = []
    for kind, free in (("alloc", False), ("free", True)):
        totals: dict[tuple[str, str], int] = {}
        for dev, site, nbytes, _key in lord._hotspots(free, None):
            if site_location(site) is None:
                continue
            k = (str(dev), site_text(site))
            totals[k] = totals.get(k, 0) + nbytes
        by_dev: dict[str, list[tuple[str, int]]] = {}
        for (dev, where), nbytes in totals.items():
            by_dev.setdefault(dev, []).append((where, nbytes))
        for dev in sorted(by_dev, key=lambda d: (d != "cpu", d)):
            rows = sorted(by_dev[dev], key=lambda r: (-r[1], r[0]))[:limit]
            out.extend({"device": dev, "kind": kind, "site": w, "bytes": b} for w, b in rows)
    return out


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
        ops: bool = True,
    ) -> None:
        if lord is not None and not isinstance(lord, MemLord):
            raise TypeError(f"lord must be a memlord.MemLord, got {type(lord).__name__}")
        self.lord = lord if lord is not None else MemLord(auto_gc_bytes=None)
        self._want_lifetime = bool(lifetime)
        self._want_torch = bool(torch_hooks)
        # op outputs (activations, gradients, what autograd makes) are most of a step's
        # memory: without them an operation's delta and peak see only the factories
        self._want_ops = bool(ops)
        self._python_hooks: Any = None
        self._torch_hooks: Any = None

    # ---- hooks ------------------------------------------------------------------------

    def start(self) -> None:
        # hooks the program turned on itself are the program's: hook_into_*() would
        # return its own handle, and stop() would disable them under it
        torch_on, python_on = self.lord._enabled_hooks()
        if self._want_lifetime and self._python_hooks is None and python_on is None:
            self._python_hooks = self.lord.hook_into_python(ops=self._want_ops)
        if self._want_torch and self._torch_hooks is None and torch_on is None:
            self._torch_hooks = self.lord.hook_into_torch()

    def stop(self) -> None:
        for name in ("_torch_hooks", "_python_hooks"):
            handle = getattr(self, name)
            setattr(self, name, None)
            if handle is not None:
                handle.disable()

    # ---- numbers ----------------------------------------------------------------------

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per device: allocated, live storages, pending, reserved (None: unknown) and the
        live bytes by category."""
        return lord_totals(self.lord)

    def counters(self) -> dict[str, dict[str, Any]]:
        """Per device: memlord's stats plus pending and reserved."""
        return lord_counters(self.lord)

    def hotspots(self) -> list[dict[str, Any]]:
        """The top allocation and free sites per device (:func:`lord_hotspots`)."""
        return lord_hotspots(self.lord)

    def snapshot_section(self, top: int = 10) -> tuple[dict[str, dict[str, Any]], str]:
        """The largest live tensors per device (:func:`_snapshot_section`), those made
        before tracking or out of its sight included, as the memory profiler's scan saw
        every tensor."""
        return _snapshot_section(self.lord, top, include_untracked=True)

    @staticmethod
    def scan_tensors(top: int = 10) -> dict[str, dict[str, Any]]:
        """The live tensors Python can see, per device: count, total bytes (each storage
        once) and the ``top`` largest, found by scanning ``gc.get_objects()``."""
        devices: dict[str, dict[str, Any]] = {}
        # each storage once, described by the tensor that owns it rather than a view of
        # it (whichever the scan meets first): (rank, its row)
        seen: dict[tuple[str, int, int], tuple[int, dict[str, Any]]] = {}
        for obj in _live_tensors():
            try:
                if _skipped(obj):
                    continue
                storage = obj.untyped_storage()
                device = str(obj.device)
                nbytes = int(storage.nbytes())
                key = (device, int(storage.data_ptr()), nbytes)
                meta = _tensor_meta(obj)
                rank = _owner_rank(obj)
            except Exception:  # noqa: BLE001 - a subclass or fake tensor may refuse
                continue
            entry = devices.setdefault(device, {"count": 0, "total_bytes": 0, "tensors": []})
            entry["count"] += 1
            known = seen.get(key)
            if known is not None:
                if rank > known[0]:
                    known[1].update(meta)
                    seen[key] = (rank, known[1])
                continue
            entry["total_bytes"] += nbytes
            row = {
                "size_mb": round(nbytes / (1024 * 1024), 4),
                "nbytes": nbytes,
                **meta,
                "device": device,
                "operation": None,
            }
            seen[key] = (rank, row)
            entry["tensors"].append(row)
        for entry in devices.values():
            entry["tensors"].sort(key=lambda t: -t["nbytes"])
            del entry["tensors"][top:]
        return devices
