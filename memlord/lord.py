"""memlord.MemLord: the Python face of the C ledger.

Python validates the configuration and shapes what people read (hotspots, repr); the
hot paths (allocate/free, the queries, the hooks and lifetime tracking) are the C core's
methods, inherited unchanged.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from . import _config, _core, _oom, _publish, _ranks
from ._errors import type_name
from ._events import EventsMixin
from ._memapi import MemoryAPIMixin
from ._regions import REGION_HISTORY, RegionsMixin, _Aggregate
from ._sites import site_location, site_text
from ._snapshot import SnapshotMixin
from ._types import AutoGCStrategy

_PressureFn = TypeVar("_PressureFn", bound=Callable[[str, int], object])

#: {thread ident: name} of the threads whose idents memlord's events and regions carry,
#: recorded on each thread the first time (the C core asks at the thread's next safe
#: point), so an export names a thread that has ended since.  A later thread given the
#: same ident (the system reuses them) replaces the name.  At most THREAD_NAMES_MAX.
THREAD_NAMES: dict[int, str] = {}
THREAD_NAMES_MAX = 1 << 16


def _name_this_thread() -> None:
    ident = threading.get_ident()
    # threading._active, not current_thread() or enumerate(): no lock taken (this may
    # run between any two bytecodes of the main thread, inside threading's own code)
    # and no dummy Thread made for a thread threading did not start
    thread = getattr(threading, "_active", {}).get(ident)
    if thread is not None and (ident in THREAD_NAMES or len(THREAD_NAMES) < THREAD_NAMES_MAX):
        THREAD_NAMES[ident] = str(thread.name)


_core._set_thread_namer(_name_this_thread)

_NOT_GIVEN: Any = ...


class _DefaultAuto(str):
    """The default of auto_gc_bytes: "auto", told apart from an explicit "auto"."""

    __slots__ = ()


_AUTO: Any = _DefaultAuto("auto")


class MemLord(MemoryAPIMixin, RegionsMixin, EventsMixin, SnapshotMixin, _core.Lord):
    """A per-device ledger of the memory a program allocated and freed.

    ``MemLord(auto_gc_bytes="auto", *, auto_gc_strategy=..., track_callsite=True)``

    - ``auto_gc_bytes``: bytes-mode auto-GC: release a device's cache once it has freed
      this many bytes since its last auto-GC.  ``"auto"`` (the default) is the smallest
      visible GPU's total memory / 3, read from the driver at first use; ``None`` or ``0``
      turns auto-GC off.  A dict given here (positionally, as upstream MemLord takes its
      strategy) is taken as ``auto_gc_strategy``.
    - ``auto_gc_strategy``: banded auto-GC (see docs/policy.md); ``None`` installs the
      default bands, ``{}`` turns auto-GC off.  Leaving it out (``...``) keeps bytes mode.
      Give one of the two, not both.
    - ``track_callsite``: record the user's ``file:line`` of each event (hotspots, logs).
    - ``region_history``: how many closed regions are kept one by one (the newest) for
      ``export()``'s region slices (default ``REGION_HISTORY``, 100,000; 0 keeps none).

    Errors: TypeError/ValueError naming the argument and field; nothing is configured
    when one is raised.
    """

    def __init__(
        self,
        auto_gc_bytes: int | str | None | AutoGCStrategy = _AUTO,
        *,
        auto_gc_strategy: AutoGCStrategy | None = _NOT_GIVEN,
        track_callsite: bool = True,
        region_history: int = _NOT_GIVEN,
    ) -> None:
        if region_history is _NOT_GIVEN:
            region_history = REGION_HISTORY
        if isinstance(region_history, bool) or not isinstance(region_history, int):
            raise TypeError(
                "MemLord(): argument 'region_history' must be an int, not "
                + type(region_history).__name__
            )
        if not 0 <= region_history < 2**63:  # it sizes a deque
            raise ValueError(
                f"MemLord(): argument 'region_history' must be >= 0 and < 2**63, not "
                f"{region_history}"
            )
        self._region_aggregate = _Aggregate(region_history)
        bytes_given = auto_gc_bytes is not _AUTO
        if isinstance(auto_gc_bytes, dict):
            if auto_gc_strategy is not _NOT_GIVEN:
                raise ValueError(
                    "MemLord(): a strategy dict was given positionally and as 'auto_gc_strategy'"
                )
            auto_gc_strategy, auto_gc_bytes, bytes_given = auto_gc_bytes, "auto", False
        if not isinstance(track_callsite, bool):
            raise TypeError(
                "MemLord(): argument 'track_callsite' must be a bool, not "
                + type_name(track_callsite)
            )
        if auto_gc_strategy is not _NOT_GIVEN:
            if bytes_given:
                raise ValueError(
                    "MemLord(): pass either 'auto_gc_bytes' or 'auto_gc_strategy', not both"
                )
            bands, normalized = _config.parse_strategy(auto_gc_strategy)
            self._set_bands(bands)
            self._strategy: AutoGCStrategy | None = normalized
        else:
            self._set_bytes(_config.parse_bytes(auto_gc_bytes))
            self._strategy = None
        self.set_callsite_tracking(track_callsite)

    # ---- configuration -------------------------------------------------------------

    def set_auto_gc(self, value: int | str | None) -> None:
        """Switch to bytes-mode auto-GC with this threshold: ``"auto"``, an int >= 0 (0
        disables) or None.  A bad value raises and changes nothing."""
        parsed = _config.parse_bytes(value)
        self._set_bytes(parsed)
        self._strategy = None

    def set_auto_gc_strategy(self, strategy: AutoGCStrategy | None) -> None:
        """Switch to banded auto-GC: ``{(lo_pct, hi_pct): {'metric': 'allocated'|'freed'|
        'max', 'threshold': {'bytes': int, 'percent': float}}}``.  None installs the
        default bands; ``{}`` disables auto-GC.  A malformed strategy raises
        TypeError/ValueError and changes nothing."""
        bands, normalized = _config.parse_strategy(strategy)
        self._set_bands(bands)
        self._strategy = normalized

    @property
    def auto_gc_strategy(self) -> AutoGCStrategy | None:
        """The banded strategy in force (a fresh dict), or None in bytes mode."""
        if self._gc_mode != "strategy" or self._strategy is None:
            return None
        return _config.strategy_dict(_config.parse_strategy(self._strategy)[0])

    # ---- hotspots ----------------------------------------------------------------------

    def _top_site(
        self, free: bool, device: str | torch.device | None
    ) -> tuple[torch.device, str, int] | None:
        totals: dict[tuple[int, str, str], int] = {}
        for dev, site, nbytes, key in self._hotspots(free, device):
            if site_location(site) is not None:
                k = (key, dev, site_text(site))
                totals[k] = totals.get(k, 0) + nbytes
        if not totals:
            return None
        (_, dev, where), nbytes = min(totals.items(), key=lambda kv: (-kv[1], kv[0][0]))
        return torch.device(dev), where, nbytes

    def top_alloc_site(
        self, device: str | torch.device | None = None
    ) -> tuple[torch.device, str, int] | None:
        """``(torch.device, "file:line", bytes)`` of the biggest cumulative allocation
        site (on ``device``: None for all, a type, or one device), or None.  The path is
        relative to the working directory when under it."""
        return self._top_site(False, device)

    def top_free_site(
        self, device: str | torch.device | None = None
    ) -> tuple[torch.device, str, int] | None:
        """``(torch.device, "file:line", bytes)`` of the biggest cumulative free site, or
        None."""
        return self._top_site(True, device)

    # ---- several processes --------------------------------------------------------------

    def publish(
        self, name: str | None = None, *, cooperate: bool | None = None
    ) -> _publish.Publisher:
        """Keep this lord's memory readable by the other processes of this user on the host
        (``python -m memlord top``) while the returned handle is enabled: a fixed-size
        record the C core updates as the ledger changes.  ``name`` defaults to the
        script and its arguments.  ``cooperate=True`` answers other processes'
        ``request_memory`` calls: the cache is released and the ``on_pressure``
        callbacks run on the main thread (``None``: a new record does not; a second
        call keeps what the record says).  One record per lord: a second call updates
        it.  See docs/ranks.md."""
        return _publish.publish(self, name, cooperate=cooperate)

    def on_pressure(self, fn: _PressureFn) -> _PressureFn:
        """Register ``fn(device, nbytes)``, run on the main thread when another process
        asks for memory while this lord publishes with ``cooperate=True``.  Returns
        ``fn``."""
        return _publish.on_pressure(self, fn)

    def request_memory(self, device: Any, nbytes: int, *, timeout: float = 10.0) -> bool:
        """Ask the cooperating processes of this user on the host to give memory back on
        ``device``: True once the device's free memory (the driver's, or ``MemAvailable``
        for cpu) reaches ``nbytes``, False after ``timeout`` seconds (at once for a CUDA
        device this process does not have)."""
        return _publish.request_memory(self, device, nbytes, timeout=timeout)

    def hook_into_torch(self) -> Any:
        handle = super().hook_into_torch()
        _publish.publish_from_env(self)
        return handle

    def hook_into_python(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().hook_into_python(*args, **kwargs)
        _publish.publish_from_env(self)
        return handle

    # ---- out of memory ---------------------------------------------------------------------

    def watch_oom(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        html: bool = True,
        top: int = 20,
        limit: int = _oom.DEFAULT_LIMIT,
    ) -> _oom.OOMWatch:
        """While the returned handle is enabled, every out-of-memory error this lord sees
        (through its hooks, or torch's CUDA OOM observer) writes a post-mortem into
        ``path`` (a directory, default the working directory; or a ``.json`` file name):
        ``memlord-oom-<host>-<pid>[-rank<r>]-<n>.json``, with an ``.html`` (``html=True``)
        and a memory_viz ``.pickle`` beside it, naming the ``top`` largest holders.  At
        most ``limit`` post-mortems per process.  One watch per lord: calling again
        updates it.  See docs/oom.md."""
        return _oom.watch_oom(self, path, html=html, top=top, limit=limit)

    # ---- several ranks -------------------------------------------------------------------

    def gather(
        self, group: torch.distributed.ProcessGroup | None = None, *, top: int = 5
    ) -> list[dict[str, Any]]:
        """A collective (every rank of ``group`` calls it): every rank's compact summary
        of its lord (host, pid, rank, devices' live and peak bytes by category, OOMs, the
        ``top`` allocation sites and regions), in the group's rank order.  RuntimeError
        when torch.distributed is not initialised.  See docs/ranks.md."""
        return _ranks.gather(self, group, top=top)

    # ---- reports -------------------------------------------------------------------------

    def export(self, path: str | os.PathLike[str], *, top: int = 10) -> str:
        """Write this lord's profile to ``path``, the format chosen by the name:
        ``.json`` (read back with ``memlord.report.load``), ``.trace.json`` (Perfetto),
        ``.pickle``/``.pkl`` (torch's memory_viz) or ``.html``/``.htm`` (needs
        ``memlord[report]``).  The document holds the event ring's records (when
        recording), the closed regions (the newest ``region_history``, as slices), the
        hotspots, per-device counters and a snapshot with the ``top`` largest live
        tensors per device.  Returns the format; an unknown name is a ValueError naming
        the accepted ones, and nothing is written then."""
        from .report import export, format_of
        from .report._lord import profile_from_lord

        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                "export(): argument 'path' must be a str or os.PathLike, not " + type(path).__name__
            )
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"export(): argument 'top' must be an int >= 0, not {top!r}")
        format_of(path)  # refuse an unknown name before any work
        return export(profile_from_lord(self, top=top), path)


def _qualify(cls: type) -> None:
    """Name the public methods ``cls`` inherits from memlord's mixins as its own
    (``MemLord.memory_stats``): CPython's argument errors, ``help()`` and reprs name a
    function by its ``__qualname__`` (3.10) or its code's ``co_qualname`` (3.11+), and
    users know MemLord, not the private mixins the methods are written in."""
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("memlord.") or base.__module__ == _core.__name__:
            continue
        for name, attr in vars(base).items():
            if name.startswith("_") or inspect.getattr_static(cls, name) is not attr:
                continue
            if isinstance(attr, (staticmethod, classmethod)):
                functions = [attr.__func__]
            elif isinstance(attr, property):
                functions = [f for f in (attr.fget, attr.fset, attr.fdel) if f is not None]
            else:
                functions = [attr]
            for fn in functions:
                if not isinstance(fn, types.FunctionType):
                    continue
                qualname = f"{cls.__name__}.{name}"
                fn.__qualname__ = qualname
                if sys.version_info >= (3, 11):  # co_qualname is new in 3.11
                    fn.__code__ = fn.__code__.replace(co_qualname=qualname)


_qualify(MemLord)
