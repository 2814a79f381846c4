"""The types users annotate with, exported by the package (``memlord.AutoGCStrategy``, ...).

A strategy kept in a variable is inferred by a type checker as a plain dict of dicts,
which ``MemLord(auto_gc_strategy=...)`` does not accept; annotated with these types it
passes::

    from memlord import AutoGCStrategy, MemLord

    strategy: AutoGCStrategy = {
        (0, 50): {"metric": "max", "threshold": {"percent": 60.0}},
        (50, 101): {"metric": "freed", "threshold": {"bytes": 2 << 30, "percent": 20.0}},
    }
    lord = MemLord(auto_gc_strategy=strategy)

They are ordinary typing constructs at run time too (TypedDicts and aliases), so they can
be used in annotations that are evaluated. docs/policy.md is the reference of the format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypedDict

__all__ = [
    "AutoGCBand",
    "AutoGCMetric",
    "AutoGCStrategy",
    "AutoGCThreshold",
    "CapacitySource",
    "DeviceStats",
]

#: What a band compares with its threshold: bytes allocated or freed on the device since
#: its last auto-GC, or the larger of the two.
AutoGCMetric = Literal["allocated", "freed", "max"]


class AutoGCThreshold(TypedDict, total=False):
    """A band's threshold: one or both keys; with both the smaller wins."""

    bytes: int  # an int in [0, 2**63)
    percent: float  # 0..100, of the device's total capacity


class AutoGCBand(TypedDict):
    """One band of a strategy: the metric and the threshold it must reach."""

    metric: AutoGCMetric
    threshold: AutoGCThreshold


#: ``{(lo_pct, hi_pct): band}``: each band covers the half-open range [lo_pct, hi_pct) of
#: the device's used percentage, 0 <= lo_pct < hi_pct <= 101, bands must not overlap.
#: Integer bounds are fine (an int is a float to a type checker).
AutoGCStrategy = dict[tuple[float, float], AutoGCBand]

#: ``source(device) -> (total_bytes, used_bytes)``, or None for "unknown"
#: (``MemLord.set_capacity_source``).
CapacitySource = Callable[[str], tuple[int, int] | None]


class DeviceStats(TypedDict):
    """One device's entry in ``MemLord.stats()``."""

    allocated: int  # live bytes (never below 0)
    freed: int  # bytes freed since this device's last auto-GC
    allocated_total: int  # every byte ever allocated (since reset())
    freed_total: int  # every byte ever freed (since reset())
    peak_allocated: int  # highest `allocated` seen (since reset())
    allocs: int  # storages counted as allocated
    frees: int  # storages counted as freed
    gc_runs: int  # auto-GC runs of this device
    ooms: int  # out-of-memory errors seen for this device (docs/oom.md)
    # live bytes by category (memlord.CATEGORIES; they add up to `allocated`)
    categories: dict[str, int]
    # the categories of `allocated` when `peak_allocated` was reached
    peak_categories: dict[str, int]
    # each category's own highest live bytes (since reset() or reset_peak_memory_stats())
    category_peaks: dict[str, int]
