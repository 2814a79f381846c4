"""The device memory API of MemLord, named as ``torch.accelerator.memory`` names things.

Allocated bytes come from memlord's ledger.  Reserved and cached bytes come from the
backend's allocator where torch exposes one (CUDA: the caching allocator); a backend
without a cache (cpu) reports ``cached == 0`` and ``reserved == allocated``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, cast

import torch

from . import _backend
from ._bytes import format_bytes, human_bytes
from ._core import CATEGORIES

if TYPE_CHECKING:
    from ._core import Lord as _LordBase
    from ._types import DeviceStats
else:
    _LordBase = object  # the mixin's methods run on memlord.MemLord, a _core.Lord


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _dev_index(dev: str) -> int:
    return torch.device(dev).index or 0


def _torch_cuda(dev: str) -> bool:
    """Whether torch's caching allocator can answer for dev: an initialised CUDA and an
    index torch has.  A device memlord counted need not exist here (a tensor that only
    reports cuda:1, a profile from another host): torch.cuda.memory_stats(1) on a
    one-GPU host raises, and memlord's queries answer None or 0 there instead."""
    return dev.startswith("cuda") and _cuda_ready() and _dev_index(dev) < torch.cuda.device_count()


class MemoryProfile:
    """What ``lord.profile_memory()`` yields: a region over the block (so the global peak
    is left alone) with ``peak_memory(device=None)`` and ``memory_summary()``."""

    def __init__(self, lord: MemoryAPIMixin) -> None:
        self._lord = lord
        self._region = lord.region("profile_memory")
        self._started = False

    def __enter__(self) -> MemoryProfile:
        self._region.__enter__()
        self._started = True
        return self

    def _check_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(
                f"MemoryProfile.{what}(): the profile has not started: it measures its "
                "block, so read it inside or after `with lord.profile_memory() as p:`"
            )

    def __exit__(self, *exc: object) -> None:
        self._region.__exit__(None, None, None)

    @property
    def stats(self) -> dict[str, dict[str, Any]]:
        """The region's per-device stats (see lord.region)."""
        return self._region.stats

    @property
    def duration_s(self) -> float:
        return self._region.duration_s

    def peak_memory(self, device: Any = None) -> int:
        """The highest allocated bytes reached inside the block, summed over the selected
        devices (None: all); a device the block never touched counts its allocated
        bytes now.  RuntimeError before the block was entered."""
        self._check_started("peak_memory")
        devs = self._lord._select(device, "peak_memory")
        total = 0
        for dev in devs:
            s = self._region.stats.get(dev)
            total += s["peak"] if s is not None else self._lord.allocated(dev)[0]
        return total

    def memory_summary(self) -> str:
        """A table of the block: per device delta, peak, peak delta, allocations, frees,
        then per device its delta and peak delta by category.  RuntimeError before the
        block was entered."""
        self._check_started("memory_summary")
        lines = [f"memlord profile_memory: {self._region.duration_s:.6f} s"]
        lines.append(
            f"{'device':<10}{'delta':>14}{'peak':>14}{'peak delta':>14}{'allocs':>9}{'frees':>9}"
        )
        for dev, s in sorted(self._region.stats.items()):
            lines.append(
                f"{dev:<10}{_signed(s['delta']):>14}{format_bytes(s['peak']):>14}"
                f"{format_bytes(s['peak_delta']):>14}{s['allocs']:>9}{s['frees']:>9}"
            )
        if not self._region.stats:
            lines.append("(nothing allocated or freed inside)")
        for dev, s in sorted(self._region.stats.items()):
            cats = s.get("categories") or {}
            if not cats:
                continue
            lines.append(f"{dev + ' by category':<26}{'delta':>14}{'peak delta':>14}")
            for cat, c in cats.items():
                lines.append(
                    f"  {cat:<24}{_signed(c['delta']):>14}{format_bytes(c['peak_delta']):>14}"
                )
        return "\n".join(lines)


def _signed(n: int) -> str:
    return ("" if n < 0 else "+") + human_bytes(n)


class MemoryStats(dict[str, Any]):
    """The dict ``memory_stats()`` returns: a plain dict, except that reading the
    deprecated key ``pending_free_bytes`` (``d[key]``, ``get``, ``pop``, ``setdefault``,
    ``popitem``, and so on a ``copy()``, which is one too) warns once per call site.  It
    was renamed ``freed_since_gc_bytes``: the bytes are frees since the last auto-GC,
    not frees waiting for a CUDA event (that is ``pending()``)."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        if key in _DEPRECATED_STATS:
            _warn_deprecated(key)
        return dict.__getitem__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in _DEPRECATED_STATS:
            _warn_deprecated(key)
        return dict.get(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in _DEPRECATED_STATS and key in self:
            _warn_deprecated(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in _DEPRECATED_STATS and key in self:
            _warn_deprecated(key)
        return dict.setdefault(self, key, default)

    def popitem(self) -> tuple[Any, Any]:
        item = dict.popitem(self)
        if item[0] in _DEPRECATED_STATS:
            _warn_deprecated(item[0])
        return item

    def copy(self) -> MemoryStats:
        return MemoryStats(self)


_DEPRECATED_STATS = {"pending_free_bytes": "freed_since_gc_bytes"}


def _warn_deprecated(key: str) -> None:
    warnings.warn(
        f"memory_stats()[{key!r}] is deprecated and will be removed in the next release: "
        f"use {_DEPRECATED_STATS[key]!r} (bytes freed since the last auto-GC; frees waiting "
        "for a CUDA event are lord.pending())",
        DeprecationWarning,
        stacklevel=3,
    )


def _categories(led: list[DeviceStats]) -> dict[str, dict[str, int]]:
    """{category: {"current", "peak", "at_peak"}} summed over devices' stats() entries."""
    return {
        cat: {
            "current": sum(s["categories"][cat] for s in led),
            "peak": sum(s["category_peaks"][cat] for s in led),
            "at_peak": sum(s["peak_categories"][cat] for s in led),
        }
        for cat in CATEGORIES
    }


class MemoryAPIMixin(_LordBase):
    """memory_allocated & co. on MemLord."""

    # ---- which devices a query covers ----------------------------------------------

    def _select(self, device: Any, fname: str) -> list[str]:
        """The device strings a device argument covers: the ledger's devices, plus the
        initialised CUDA devices the selector names; validates like the queries do."""
        try:
            ledger = list(self.stats(device))
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("stats()", f"{fname}()")) from None
        out = set(ledger)
        if _cuda_ready():
            sel = None if device is None else torch.device(device)
            if sel is None or sel.type == "cuda":
                for i in range(torch.cuda.device_count()):
                    if sel is None or sel.index is None or sel.index == i:
                        out.add(f"cuda:{i}")
        return sorted(out)

    def _backend_reserved(self, dev: str) -> int | None:
        if _torch_cuda(dev):
            return torch.cuda.memory_reserved(_dev_index(dev))
        return None

    def _ledger(self, dev: str) -> DeviceStats:
        s = self.stats(dev)
        got = s.get(dev)
        if got:
            return got
        out: dict[str, Any] = dict.fromkeys(
            (
                "allocated",
                "freed",
                "allocated_total",
                "freed_total",
                "peak_allocated",
                "allocs",
                "frees",
                "gc_runs",
                "ooms",
            ),
            0,
        )
        for key in ("categories", "peak_categories", "category_peaks"):
            out[key] = dict.fromkeys(CATEGORIES, 0)
        return cast("DeviceStats", out)

    def categories(self, device: Any = None) -> dict[str, dict[str, int]]:
        """Bytes by category (``memlord.CATEGORIES``), summed over the selected devices:
        ``{category: {"current", "peak", "at_peak"}}`` with ``current`` the live bytes
        (they add up to ``memory_allocated``), ``peak`` the category's own highest live
        bytes and ``at_peak`` its bytes when the device's ``peak_allocated`` was reached
        (they add up to ``max_memory_allocated``)."""
        return _categories([self._ledger(d) for d in self._select(device, "categories")])

    # ---- the ints ---------------------------------------------------------------------

    def memory_allocated(self, device: Any = None) -> int:
        """Live bytes memlord counts on the selected devices (the ledger)."""
        return self.allocated(device)[0]

    def max_memory_allocated(self, device: Any = None) -> int:
        """The peak of live bytes since the last reset, summed over the selected devices
        (each device's own peak)."""
        return sum(
            self._ledger(d)["peak_allocated"] for d in self._select(device, "max_memory_allocated")
        )

    def memory_reserved(self, device: Any = None) -> int:
        """Bytes the backend's allocator reserves (CUDA: torch.cuda.memory_reserved); a
        device without a cache (cpu) reports its allocated bytes."""
        total = 0
        for dev in self._select(device, "memory_reserved"):
            r = self._backend_reserved(dev)
            total += r if r is not None else self._ledger(dev)["allocated"]
        return total

    def memory_cached(self, device: Any = None) -> int:
        """Bytes held in the allocator's cache: reserved minus allocated (CUDA, both from
        the caching allocator); 0 for a device without a cache (cpu)."""
        total = 0
        for dev in self._select(device, "memory_cached"):
            if _torch_cuda(dev):
                i = _dev_index(dev)
                total += torch.cuda.memory_reserved(i) - torch.cuda.memory_allocated(i)
        return total

    def max_memory_cached(self, device: Any = None) -> int:
        """The allocator's peak reserved bytes (CUDA: torch.cuda.max_memory_reserved,
        which torch once called max_memory_cached); 0 for a device without a cache."""
        total = 0
        for dev in self._select(device, "max_memory_cached"):
            if _torch_cuda(dev):
                total += torch.cuda.max_memory_reserved(_dev_index(dev))
        return total

    def drift(self, device: Any = None) -> int | None:
        """Bytes the backend's allocator holds as allocated that memlord does not count
        (autograd buffers, untracked tensors): allocator allocated minus memlord's
        allocated.  None where the backend does not say (cpu, an uninitialised CUDA)."""
        devs = self._select(device, "drift")
        if not devs or not all(_torch_cuda(d) for d in devs):
            return None
        return sum(
            torch.cuda.memory_allocated(_dev_index(d)) - self._ledger(d)["allocated"] for d in devs
        )

    # ---- stats and the summary ---------------------------------------------------------

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        """A flat dict over the selected devices (sums): the ledger's numbers and, where
        every selected device is an initialised CUDA device, the caching allocator's
        (else those keys are None).  See docs/api.md for each key.

        One reading of the ledger per device: every figure of the dict comes from it (a
        device without a cache reports that reading's allocated bytes as reserved), so
        they agree with each other while other threads allocate."""
        devs = self._select(device, "memory_stats")
        led = [self._ledger(d) for d in devs]
        cuda = bool(devs) and all(_torch_cuda(d) for d in devs)
        reserved = cached = peak_cached = 0
        for d, s in zip(devs, led, strict=True):
            r = self._backend_reserved(d)
            reserved += r if r is not None else s["allocated"]
            if _torch_cuda(d):
                i = _dev_index(d)
                cached += torch.cuda.memory_reserved(i) - torch.cuda.memory_allocated(i)
                peak_cached += torch.cuda.max_memory_reserved(i)
        out: dict[str, Any] = {
            "allocated_bytes": sum(s["allocated"] for s in led),
            "peak_allocated": sum(s["peak_allocated"] for s in led),
            "cached_bytes": cached,
            "reserved_bytes": reserved,
            "peak_cached": peak_cached,
            "freed_since_gc_bytes": sum(s["freed"] for s in led),
            "num_allocations": sum(s["allocs"] for s in led),
            "num_frees": sum(s["frees"] for s in led),
            "num_gc_runs": sum(s["gc_runs"] for s in led),
            "allocator_allocated_bytes": None,
            "active_bytes": None,
            "inactive_split_bytes": None,
            "num_alloc_retries": None,
            # memlord's own count (where torch has one, CUDA, torch's below)
            "num_ooms": sum(s["ooms"] for s in led),
            "cache_hit_rate": None,
            # requests the caching allocator served from its cache / with a new segment
            "num_cache_hits": None,
            "num_cache_misses": None,
        }
        if cuda:
            keys = {
                "allocator_allocated_bytes": "allocated_bytes.all.current",
                "active_bytes": "active_bytes.all.current",
                "inactive_split_bytes": "inactive_split_bytes.all.current",
                "num_alloc_retries": "num_alloc_retries",
                "num_ooms": "num_ooms",
            }
            requests = mallocs = 0
            for k in keys:
                out[k] = 0
            for d in devs:
                ts = torch.cuda.memory_stats(_dev_index(d))
                for k, tk in keys.items():
                    out[k] += int(ts.get(tk, 0))
                requests += int(ts.get("allocation.all.allocated", 0))
                mallocs += int(ts.get("segment.all.allocated", 0))
            # no request served yet: no hit (the spec formats the rate at its start)
            out["cache_hit_rate"] = 1.0 - mallocs / requests if requests else 0.0
            out["num_cache_misses"] = mallocs
            out["num_cache_hits"] = max(requests - mallocs, 0)
        for cat, c in _categories(led).items():
            for key in ("current", "peak", "at_peak"):
                out[f"category.{cat}.{key}"] = c[key]
        # the old name of freed_since_gc_bytes, kept one release (reading it warns)
        out["pending_free_bytes"] = out["freed_since_gc_bytes"]
        return MemoryStats(out)

    def memory_summary(self, device: Any = None) -> str:
        """A human table per device: the ledger, the backend and the drift between them."""
        devs = self._select(device, "memory_summary")
        head = (
            f"{'device':<10}{'allocated':>12}{'peak':>12}{'reserved':>12}{'cached':>12}"
            f"{'backend alloc':>15}{'drift':>12}{'allocs':>9}{'frees':>9}{'gc':>5}"
        )
        lines = ["memlord memory summary", head, "-" * len(head)]
        readings = {dev: self.memory_stats(dev) for dev in devs}
        for dev, s in readings.items():
            back = s["allocator_allocated_bytes"]
            # the allocator's allocated bytes (torch.cuda.memory_allocated) minus the
            # ledger's, as drift(dev), from this one reading
            drift = None if back is None else back - s["allocated_bytes"]
            lines.append(
                f"{dev:<10}{format_bytes(s['allocated_bytes']):>12}"
                f"{format_bytes(s['peak_allocated']):>12}{format_bytes(s['reserved_bytes']):>12}"
                f"{format_bytes(s['cached_bytes']):>12}"
                f"{'n/a' if back is None else format_bytes(back):>15}"
                f"{'n/a' if drift is None else _signed(drift):>12}"
                f"{s['num_allocations']:>9}{s['num_frees']:>9}{s['num_gc_runs']:>5}"
            )
        if not devs:
            lines.append("(no device seen)")
        lines.append(
            "drift: bytes the backend's allocator holds that memlord does not count "
            "(library workspaces such as cuBLAS's, block rounding)"
        )
        blocks = 0
        for dev, s in readings.items():
            cats = {
                c: {k: s[f"category.{c}.{k}"] for k in ("current", "at_peak", "peak")}
                for c in CATEGORIES
            }
            shown = [(c, v) for c, v in cats.items() if any(v.values())]
            if not shown:
                continue
            blocks += 1
            lines.append("")
            lines.append(f"{dev + ' by category':<26}{'current':>12}{'at peak':>12}{'peak':>12}")
            for cat, v in shown:
                lines.append(
                    f"  {cat:<24}{format_bytes(v['current']):>12}"
                    f"{format_bytes(v['at_peak']):>12}{format_bytes(v['peak']):>12}"
                )
        if blocks:
            lines.append(
                "at peak: a category's bytes when the device's peak was reached; "
                "peak: the category's own highest"
            )
        return "\n".join(lines)

    # ---- actions ---------------------------------------------------------------------------

    def empty_cache(self, device: Any = None) -> None:
        """Release the backend's cache of the selected devices (cpu: nothing to do)."""
        for dev in self._select(device, "empty_cache"):
            d = torch.device(dev)
            if d.type != "cpu":
                _backend.release_cache(d.type, -1 if d.index is None else d.index)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        """Each selected device's peak becomes its live bytes now (the ledger's, and the
        CUDA allocator's).  Open regions keep their own peaks."""
        devs = self._select(device, "reset_peak_memory_stats")
        self._reset_peak(device)
        for dev in devs:
            if _torch_cuda(dev):
                torch.cuda.reset_peak_memory_stats(_dev_index(dev))

    def reset_memory_stats(self, device: Any = None) -> None:
        """Reset the peaks and zero the cumulative counters (allocated_total, freed_total,
        allocs, frees, gc_runs) of the selected devices, and the CUDA allocator's; live
        bytes and the auto-GC counters are kept."""
        devs = self._select(device, "reset_memory_stats")
        self._reset_accumulated(device)
        for dev in devs:
            if _torch_cuda(dev):
                torch.cuda.reset_peak_memory_stats(_dev_index(dev))
                torch.cuda.reset_accumulated_memory_stats(_dev_index(dev))

    def profile_memory(self) -> MemoryProfile:
        """``with lord.profile_memory() as p: ...`` then ``p.peak_memory()`` and
        ``p.memory_summary()``; a region underneath, so the global peak is kept."""
        return MemoryProfile(self)
