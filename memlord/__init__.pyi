# Type stubs for memlord (the runtime is memlord.lord.MemLord over the C extension
# memlord._core, re-exported by memlord/__init__.py).  docs/api.md is the reference.
#
# Names that start with an underscore exist only here, for type checkers:
# import them under `if typing.TYPE_CHECKING:`.

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar, final, overload

import numpy
import torch
import torch.distributed
from typing_extensions import Self

from ._types import (
    AutoGCBand,
    AutoGCMetric,
    AutoGCStrategy,
    AutoGCThreshold,
    CapacitySource,
    DeviceStats,
)

__all__ = [
    "AutoGCBand",
    "AutoGCMetric",
    "AutoGCStrategy",
    "AutoGCThreshold",
    "CATEGORIES",
    "CapacitySource",
    "DeviceStats",
    "EVENT_DTYPE",
    "EVENT_KINDS",
    "EVENT_SOURCES",
    "Hooks",
    "LeakCheck",
    "LifetimeAnalyzer",
    "MemLord",
    "MemoryFit",
    "MemoryProfile",
    "ModuleTracker",
    "OOMWatch",
    "PythonHooks",
    "Publisher",
    "Region",
    "ReusePlan",
    "TorchHooks",
    "find_batch_size",
    "fit_memory",
    "format_bytes",
    "oom_retry",
    "retry_on_oom",
    "__version__",
]

__version__: str

EVENT_DTYPE: numpy.dtype[numpy.void]
EVENT_KINDS: tuple[str, ...]
# what a tracked storage holds: "other", "parameter", "buffer", "gradient", "activation",
# "temporary", "optimizer_state", "input", "loaded" (in this order)
CATEGORIES: tuple[str, ...]
EVENT_SOURCES: tuple[str, ...]

# ---- argument and result shapes ---------------------------------------------------------

# One device or a set of devices: "cpu", "cuda" (every index), "cuda:1", torch.device(...).
_Device = str | torch.device

# What allocate()/free() accept: one object, or a flat tuple or list of them.
_Trackable = torch.nn.Module | torch.Tensor | numpy.ndarray[Any, Any]
_TrackArg = _Trackable | tuple[_Trackable, ...] | list[_Trackable]
# list is invariant: a list[nn.Linear] or list[torch.Tensor] takes the second overload
_T = TypeVar("_T", bound=_Trackable)
_F = TypeVar("_F", bound=Callable[..., Any])
_R = TypeVar("_R")

# (raw_bytes, human_string), e.g. (1536, "1.5 KiB")
_Bytes = tuple[int, str]

# (device, "file:line", cumulative_bytes)
_Site = tuple[torch.device, str, int]

# The names users annotate with live in memlord/_types.py and are exported above; the
# underscore names are kept for code that imported them under TYPE_CHECKING.
_DeviceStats = DeviceStats
_Threshold = AutoGCThreshold
_Band = AutoGCBand
_AutoGCStrategy = AutoGCStrategy
_CapacitySource = CapacitySource

# (total_bytes, used_bytes, used_percent), or three Nones when it cannot be read
_DeviceMemory = tuple[int, int, float] | tuple[None, None, None]

# ---- functions ------------------------------------------------------------------------

def format_bytes(n: int, /) -> str:
    """A byte count (0 <= n < 2**63) in binary units, at most two decimals: '1.5 KiB'."""

# ---- the ledger -----------------------------------------------------------------------

class MemLord:
    """A per-device ledger of the memory a program allocated and freed."""

    # Passing auto_gc_strategy (None included) selects the banded strategy; passing it
    # together with auto_gc_bytes raises ValueError, so no overload takes both.  A dict as
    # the first positional argument is the strategy (as upstream MemLord takes it).
    @overload
    def __init__(
        self,
        auto_gc_bytes: int | Literal["auto"] | None = "auto",
        *,
        track_callsite: bool = True,
        region_history: int = 100_000,
    ) -> None: ...
    @overload
    def __init__(
        self,
        *,
        auto_gc_strategy: _AutoGCStrategy | None,
        track_callsite: bool = True,
        region_history: int = 100_000,
    ) -> None: ...
    @overload
    def __init__(
        self,
        auto_gc_bytes: _AutoGCStrategy,
        /,
        *,
        track_callsite: bool = True,
        region_history: int = 100_000,
    ) -> None: ...

    # explicit accounting
    @overload
    def allocate(self, obj: _TrackArg, /) -> None: ...
    @overload
    def allocate(self, obj: list[_T], /) -> None: ...
    @overload
    def free(self, obj: _TrackArg, /) -> None: ...
    @overload
    def free(self, obj: list[_T], /) -> None: ...

    # queries
    def allocated(self, device: _Device | None = None) -> _Bytes: ...
    def freed(self, device: _Device | None = None) -> _Bytes: ...
    def stats(self, device: _Device | None = None) -> dict[str, _DeviceStats]: ...
    def top_alloc_site(self, device: _Device | None = None) -> _Site | None: ...
    def top_free_site(self, device: _Device | None = None) -> _Site | None: ...
    def reset(self) -> None: ...

    # auto-GC policy
    def set_auto_gc(self, value: int | Literal["auto"] | None) -> None: ...
    @property
    def auto_gc_bytes(self) -> int | None: ...
    def set_auto_gc_strategy(self, strategy: _AutoGCStrategy | None) -> None: ...
    @property
    def auto_gc_strategy(self) -> _AutoGCStrategy | None: ...

    # device capacity
    def device_memory(self, device: _Device) -> _DeviceMemory: ...
    def set_capacity_source(self, source: _CapacitySource | None, /) -> None: ...
    @property
    def capacity_source(self) -> _CapacitySource | None: ...

    # call sites
    def set_callsite_tracking(self, enabled: bool, /) -> None: ...
    @property
    def track_callsite(self) -> bool: ...
    @property
    def gc_runs(self) -> int: ...  # auto-GC runs on every device since the last reset

    # hooks
    def hook_into_torch(self) -> Hooks: ...
    def hook_into_python(
        self,
        enable_factory_wrappers: bool = True,
        enable_deep_autowrap: bool = True,
        *,
        ops: bool = False,
    ) -> Hooks: ...

    # the device memory API (named as torch.accelerator.memory names things)
    def memory_allocated(self, device: _Device | None = None) -> int: ...
    def max_memory_allocated(self, device: _Device | None = None) -> int: ...
    # {category: {"current": int, "peak": int, "at_peak": int}}, summed over the devices
    def categories(self, device: _Device | None = None) -> dict[str, dict[str, int]]: ...
    def memory_reserved(self, device: _Device | None = None) -> int: ...
    def memory_cached(self, device: _Device | None = None) -> int: ...
    def max_memory_cached(self, device: _Device | None = None) -> int: ...
    def memory_stats(self, device: _Device | None = None) -> dict[str, int | float | None]: ...
    def memory_summary(self, device: _Device | None = None) -> str: ...
    def drift(self, device: _Device | None = None) -> int | None: ...
    def empty_cache(self, device: _Device | None = None) -> None: ...
    def reset_peak_memory_stats(self, device: _Device | None = None) -> None: ...
    def reset_memory_stats(self, device: _Device | None = None) -> None: ...
    def profile_memory(self) -> MemoryProfile: ...

    # the event ring
    def record_events(self, capacity: int) -> None: ...
    def events(self, clear: bool = False) -> numpy.ndarray[Any, numpy.dtype[numpy.void]]: ...
    @property
    def events_dropped(self) -> int: ...
    @property
    def events_capacity(self) -> int: ...
    @staticmethod
    def event_kind(code: int) -> str: ...
    @staticmethod
    def event_source(code: int) -> str: ...
    def event_device(self, code: int) -> str: ...
    @staticmethod
    def event_site(code: int) -> str: ...
    def event_region(self, code: int) -> str: ...
    def decode_events(
        self, events: numpy.ndarray[Any, numpy.dtype[numpy.void]]
    ) -> list[dict[str, Any]]: ...

    # live snapshots, leak checks, growth (lifetime tracking on: RuntimeError otherwise)
    def snapshot(
        self, top: int = 10, *, include_untracked: bool = False
    ) -> dict[str, _DeviceSnapshot]: ...
    def leak_check(self, *, collect: bool = True) -> LeakCheck: ...
    def assert_no_leak(self, *, collect: bool = True) -> LeakCheck: ...
    def step(self) -> int: ...
    @property
    def steps(self) -> int: ...
    def growth(self, min_steps: int = 3) -> list[_SiteGrowth]: ...

    # regions
    def region(self, name: str, /) -> Region: ...
    def regions(self, clear: bool = False) -> dict[str, _RegionSummary]: ...
    def track_modules(self, model: torch.nn.Module, *, backward: bool = True) -> ModuleTracker: ...

    # out of memory: post-mortems while the watch is enabled (docs/oom.md)
    def watch_oom(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        html: bool = True,
        top: int = 20,
        limit: int = 5,
    ) -> OOMWatch: ...

    # several processes on one host (docs/ranks.md)
    def publish(self, name: str | None = None, *, cooperate: bool | None = None) -> Publisher: ...
    def on_pressure(self, fn: _PressureFn) -> _PressureFn: ...
    def request_memory(self, device: _Device, nbytes: int, *, timeout: float = 10.0) -> bool: ...

    # several ranks: a collective over a torch.distributed group (docs/ranks.md)
    def gather(
        self, group: torch.distributed.ProcessGroup | None = None, *, top: int = 5
    ) -> list[dict[str, Any]]: ...

    # reports: the format by the file name (.json, .trace.json, .pickle/.pkl, .html/.htm)
    def export(self, path: str | os.PathLike[str], *, top: int = 10) -> str: ...

    # the floor of the query benchmarks: a method that does nothing
    def _bench_noop(self, *args: object, **kwargs: object) -> None: ...
    # bench/bench_events.py: n one-byte cpu events through the event seam (changes the ledger)
    def _bench_emit(self, n: int, /) -> None: ...

# ---- snapshots and leak checks ---------------------------------------------------------

# One live storage: {"nbytes": int, "shape": tuple[int, ...] | None, "dtype": str | None,
#   "device": str, "requires_grad": bool, "site": str | None, "region": str | None,
#   "age_s": float | None, "tracked": bool, "category": str}  (docs/api.md#live-snapshots)
_SnapshotEntry = dict[str, Any]
# snapshot()[device]: {"total_bytes": int, "count": int, "top": list[_SnapshotEntry]}, and
# "untracked_bytes", "untracked_count" with include_untracked=True
_DeviceSnapshot = dict[str, Any]
# growth(): {"site": str | None, "bytes": list[int], "growth": int}
_SiteGrowth = dict[str, Any]

class LeakCheck:
    """What MemLord.leak_check() and MemLord.assert_no_leak() return."""

    # made by MemLord (as are the handles below); their constructors are not API
    def __init__(
        self, lord: MemLord, *, collect: bool = True, raise_on_leak: bool = False
    ) -> None: ...
    leaked: list[_SnapshotEntry]  # filled on exit (and by check())
    def check(self) -> list[_SnapshotEntry]: ...
    def by_site(self) -> dict[str | None, dict[str, int]]: ...
    def table(self, limit: int = 20) -> str: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> Literal[False]: ...

# ---- regions and memory profiles --------------------------------------------------------

# r.stats[device]: {"delta", "peak", "peak_delta", "allocs", "frees": int, "categories":
#   {category: {"delta", "peak_delta", "at_peak": int}}}
_RegionStats = dict[str, Any]
# lord.regions()[name]: {"count": int, "total_s": float, "devices": {device: {
#   "total_delta": int, "avg_delta": float, "max_delta": int, "max_peak_delta": int,
#   "categories": {category: {"total_delta", "max_delta", "max_peak_delta": int}}}}}
_RegionSummary = dict[str, Any]

@final
class Region:
    """What MemLord.region(name) returns: a context manager and a decorator (a fresh
    region of the same name around every call). Not instantiable."""

    @property
    def name(self) -> str: ...
    @property
    def stats(self) -> dict[str, _RegionStats]: ...  # filled at exit
    @property
    def duration_s(self) -> float: ...  # filled at exit
    @property
    def open(self) -> bool: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
    def __call__(self, fn: _F, /) -> _F: ...

class ModuleTracker:
    """What MemLord.track_modules(model) returns."""

    def __init__(self, lord: MemLord, model: torch.nn.Module, backward: bool = True) -> None: ...
    @property
    def enabled(self) -> bool: ...
    def disable(self) -> None: ...
    def regions(self, clear: bool = False) -> dict[str, _RegionSummary]: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...

class MemoryProfile:
    """What MemLord.profile_memory() yields."""

    def __init__(self, lord: MemLord) -> None: ...
    @property
    def stats(self) -> dict[str, _RegionStats]: ...
    @property
    def duration_s(self) -> float: ...
    def peak_memory(self, device: _Device | None = None) -> int: ...
    def memory_summary(self) -> str: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...

# ---- several processes on one host (docs/ranks.md) ---------------------------------------

_PressureFn = TypeVar("_PressureFn", bound=Callable[[str, int], object])

class Publisher:
    """What MemLord.publish() returns."""

    def __init__(self, lord: MemLord, name: str | None, cooperate: bool) -> None: ...
    name: str
    cooperate: bool
    path: Path
    @property
    def enabled(self) -> bool: ...
    @property
    def lord(self) -> MemLord | None: ...
    def disable(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...

# ---- out of memory (docs/oom.md) ----------------------------------------------------------

class OOMWatch:
    """What MemLord.watch_oom() returns."""

    def __init__(
        self, lord: MemLord, path: Path | None, html: bool, top: int, limit: int
    ) -> None: ...
    path: Path | None
    html: bool
    top: int
    limit: int
    written: list[dict[str, str]]  # {"json", "html", "pickle"} per post-mortem
    @property
    def enabled(self) -> bool: ...
    @property
    def lord(self) -> MemLord | None: ...
    def disable(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...

# summary passed to on_retry: {"type", "message", "device", "bytes", "attempt", "post_mortems"}
_OOMSummary = dict[str, Any]
_Shrink = Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]]

def retry_on_oom(
    fn: Callable[..., _R],
    /,
    *args: Any,
    attempts: int = 3,
    backoff: float = 0.5,
    max_backoff: float = 8.0,
    on_retry: Callable[[int, _OOMSummary], object] | None = None,
    shrink: _Shrink | None = None,
    **kwargs: Any,
) -> _R: ...
@overload
def oom_retry(fn: _F, /) -> _F: ...
@overload
def oom_retry(
    fn: None = None,
    /,
    *,
    attempts: int = 3,
    backoff: float = 0.5,
    max_backoff: float = 8.0,
    on_retry: Callable[[int, _OOMSummary], object] | None = None,
    shrink: _Shrink | None = None,
) -> Callable[[_F], _F]: ...

# ---- hook handles (created by MemLord only; not instantiable) --------------------------

@final
class Hooks:
    """What MemLord.hook_into_torch() and MemLord.hook_into_python() return (one type for
    both kinds; TorchHooks and PythonHooks are its other names)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def lord(self) -> MemLord: ...
    @property
    def kind(self) -> Literal["torch", "python"]: ...
    @property
    def ops(self) -> bool: ...
    @property
    def tracked(self) -> int: ...
    def disable(self) -> None: ...
    def poll(self) -> None: ...
    def pending(self, device: _Device | None = None) -> int: ...
    def __enter__(self) -> Hooks: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
        /,
    ) -> Literal[False]: ...

TorchHooks = Hooks
PythonHooks = Hooks

# ---- sizing and lifetimes (docs/sizing.md) ----------------------------------------------

_Term = Literal["fixed", "linear", "quadratic"]

def fit_memory(
    step: Callable[[int], object],
    batch_sizes: Iterable[int] = (2, 4, 8),
    *,
    device: _Device | None = None,
    warmup: int = 1,
    terms: Iterable[_Term] = ("fixed", "linear"),
) -> MemoryFit: ...
def find_batch_size(
    step: Callable[[int], object],
    start: int,
    *,
    device: _Device | None = None,
    batch_sizes: Iterable[int] | None = None,
    budget: int | None = None,
    headroom: float = 0.05,
    warmup: int = 1,
) -> tuple[int, MemoryFit]: ...

class MemoryFit:
    """What fit_memory() measured and fitted."""

    # made by fit_memory() (samples: its measurements per batch size); not API
    def __init__(
        self,
        step: Callable[[int], object],
        sizes: tuple[int, ...],
        terms: tuple[_Term, ...],
        samples: list[dict[str, Any]],
        device: str | None,
    ) -> None: ...
    batch_sizes: tuple[int, ...]
    terms: tuple[_Term, ...]
    devices: tuple[str, ...]
    device: str
    measured: dict[str, tuple[int, ...]]
    reserved_measured: dict[str, tuple[int, ...]]
    @property
    def fixed_bytes(self) -> float: ...
    @property
    def per_sample_bytes(self) -> float: ...
    @property
    def quadratic_bytes(self) -> float: ...
    @property
    def residuals(self) -> tuple[float, ...]: ...
    def categories(self, device: _Device | None = None) -> dict[str, dict[str, float]]: ...
    def predict(self, batch_size: int, device: _Device | None = None) -> int: ...
    def max_batch_size(
        self, budget: int | None = None, *, headroom: float = 0.05, device: _Device | None = None
    ) -> int: ...
    def validate(self, batch_size: int) -> float: ...
    def summary(self) -> str: ...

class ReusePlan:
    """Storages grouped into shared buffers whose lifetimes do not overlap."""

    # made by LifetimeAnalyzer.compute_reuse_plan(); not API
    def __init__(
        self,
        device: str,
        storages: dict[str, numpy.ndarray[Any, Any]],
        buffer_of: numpy.ndarray[Any, Any],
        buffer_bytes: numpy.ndarray[Any, Any],
    ) -> None: ...
    device: str
    storages: dict[str, numpy.ndarray[Any, Any]]
    buffer_of: numpy.ndarray[Any, Any]
    buffer_bytes: numpy.ndarray[Any, Any]
    bytes_before: int
    bytes_after: int
    @property
    def saved_bytes(self) -> int: ...
    def __len__(self) -> int: ...
    def groups(self) -> list[list[int]]: ...
    def summary(self) -> str: ...

class LifetimeAnalyzer:
    """Storage lifetimes from a lord's event ring, or recorded by hand."""

    def __init__(
        self,
        lord: MemLord | None = None,
        *,
        steps: int | Iterable[int] | None = None,
        modules: torch.nn.Module | ModuleTracker | Iterable[str] | None = None,
    ) -> None: ...
    def record_usage(
        self, step: int, tensors: torch.Tensor | Iterable[torch.Tensor] | dict[Any, torch.Tensor]
    ) -> None: ...
    def steps(self) -> list[int]: ...
    def storages(self) -> dict[str, Any]: ...
    def peak_composition(
        self, step: int | None = None, *, device: _Device | None = None
    ) -> dict[str, Any]: ...
    def get_optimization_suggestions(
        self, step: int | None = None, *, device: _Device | None = None
    ) -> dict[str, Any]: ...
    def compute_reuse_plan(
        self, step: int | None = None, *, device: _Device | None = None
    ) -> ReusePlan: ...
