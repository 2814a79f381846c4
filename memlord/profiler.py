"""The memory profiler: periodic snapshots, checkpoints, operation tracking and PyTorch
operator statistics, saved as ``memory_profile_YYYYMMDD_HHMMSS_<pid>_<n>.json``.

    from memlord.profiler import (
        initialize_memory_tracker, memory_checkpoint, stop_memory_tracker, get_memory_tracker,
    )

    initialize_memory_tracker(output_dir="./profiles", enabled=True, interval=5.0)
    tracker = get_memory_tracker()
    with tracker.track_operation("model_forward"):
        out = model(x)
    memory_checkpoint("after_forward")
    stop_memory_tracker()          # also written at exit and on SIGTERM / SIGINT

The numbers come from a lord the tracker owns: its event ring (every allocation and
free, with its site, thread and region; the newest ``EVENTS`` records), its regions
(each ``track_operation`` call is a region, so its per-device delta and peak are the
ledger's own) and snapshots (:func:`memlord.report._source._snapshot_section`).
docs/reports.md describes the file; :mod:`memlord.report` turns it into a trace, a
pickle for torch's memory_viz, or an HTML report.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import functools
import itertools
import logging
import math
import os
import platform
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import __version__, _core, _oom
from ._ranks import rank_info, rank_metadata
from .report import Events, Profile, SampleBuilder, Span, export, format_of
from .report._lord import (
    category_baseline,
    read_consistent,
    region_span,
    region_spans,
    ring_events,
    site_frames_table,
    thread_names,
)
from .report._source import FROM_GC_SCAN, LedgerSource, build_snapshot
from .report._util import MiB

if TYPE_CHECKING:
    from ._core import _RegionRaw

__all__ = [
    "MemoryTracker",
    "get_memory_tracker",
    "initialize_memory_tracker",
    "memory_checkpoint",
    "stop_memory_tracker",
]

log = logging.getLogger("memlord")

#: The event ring's capacity a tracker turns on by default: the newest 262,144
#: allocation and free records (64 bytes each: 16 MiB, allocated when the tracker
#: starts).  ``events=N`` changes it, ``events=0`` records none.
EVENTS = 1 << 18

_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), signal.SIGINT) if s is not None)


def _check_interval(interval: object) -> float | None:
    if interval is None:
        return None
    if isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise TypeError(f"interval must be a number of seconds or None, got {interval!r}")
    if not math.isfinite(interval) or interval <= 0:
        raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
    return float(interval)


#: numbers the default file names of this process's trackers (with the pid and the time,
#: no two trackers of any processes share one)
_name_counter = itertools.count(1)


def _check_path(path: object, what: str, fmt: str | None = None) -> Path:
    """``path`` as an absolute path (relative ones against the working directory now, so
    a later ``os.chdir`` of the program does not move the report), of format ``fmt``
    (any report format when None)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what} must be a str or os.PathLike, got {path!r}")
    found = format_of(path)  # ValueError naming the known endings
    if fmt is not None and found != fmt:
        raise ValueError(f"{what} {os.fspath(path)!r} names a {found} file, not {fmt}")
    return Path(os.path.abspath(path))


def _check_name(name: object, what: str = "name") -> str:
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, got {type(name).__name__}")
    return name


class _NamedAsFrozen:
    """A lord whose region names are those read when its ring was frozen (the frozen
    records' codes name them; the lord may have freed them since)."""

    def __init__(self, lord: Any, names: list[str]) -> None:
        self._lord, self._names = lord, names

    def _region_names(self) -> list[str]:
        return list(self._names)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lord, name)


class MemoryTracker:
    """Collects snapshots, operations and operator statistics into a profile.

    ``enabled=False`` makes every method a cheap no-op: no thread, no hooks, no file.
    ``interval`` (seconds, or None for none) is the period of the background snapshots.
    ``exports`` are extra report paths (``.html``, ``.trace.json``, ``.pickle``) written
    with the JSON; ``json_path`` replaces the default
    ``memory_profile_<time>_<pid>_<n>.json`` in ``output_dir`` (``False``: no JSON).
    Relative paths are resolved against the working directory when the tracker is
    made.  ``source`` is where the numbers come from (default: a fresh lord with
    lifetime tracking on).  ``events`` is the capacity of the lord's event ring the
    tracker turns on (default :data:`EVENTS`; ``0``: none; a lord already recording
    keeps its own ring).  ``oom`` (default True) writes a post-mortem into ``output_dir``
    for each out-of-memory error while the tracker runs (``lord.watch_oom``, unless the
    lord has a watch of its own; docs/oom.md).  A tracker writes only in the process
    that started it: a child made by ``os.fork()`` writes nothing (it starts a tracker
    of its own for a file of its own)."""

    def __init__(
        self,
        output_dir: str | os.PathLike[str] = ".",
        enabled: bool = True,
        interval: float | None = 5.0,
        *,
        top: int = 10,
        exports: Sequence[str | os.PathLike[str]] = (),
        json_path: str | os.PathLike[str] | bool | None = None,
        source: LedgerSource | None = None,
        torch_hooks: bool = False,
        install_handlers: bool = True,
        title: str | None = None,
        events: int = EVENTS,
        oom: bool = True,
    ) -> None:
        if not isinstance(output_dir, (str, os.PathLike)):
            raise TypeError(f"output_dir must be a str or os.PathLike, got {output_dir!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}")
        self.interval = _check_interval(interval)
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise ValueError(f"top must be an int >= 0, got {top!r}")
        if isinstance(events, bool) or not isinstance(events, int) or events < 0:
            raise ValueError(f"events must be an int >= 0, got {events!r}")
        if not isinstance(oom, bool):
            raise TypeError(f"oom must be a bool, got {oom!r}")
        if isinstance(exports, (str, os.PathLike)):
            raise TypeError(f"exports must be a sequence of paths, got {exports!r}")
        self.output_dir = Path(os.path.abspath(output_dir))
        self.enabled = enabled
        self.top = top
        self.exports = [_check_path(p, "exports: path") for p in exports]
        if json_path not in (None, True, False):
            json_path = _check_path(json_path, "json_path", "json")
        self._json_path = json_path
        self._pid = os.getpid()
        self._source = source
        self._torch_hooks = torch_hooks
        self._install_handlers = install_handlers
        self.title = title
        self.events = events
        self.oom = oom
        self._oom_watch: Any = None  # the lord's OOM watch this tracker turned on
        self._oom_written: list[str] = []
        self._own_ring = False
        self._frozen: tuple[Any, dict[str, Any]] | None = None  # the ring at stop
        self._frozen_dropped = 0
        self._frozen_names: list[str] = []  # the region names the frozen records name
        self._ring_capacity = 0
        # id -> closed region item of an operation
        self._op_items: dict[int, tuple[str, _RegionRaw]] = {}
        self._top_from = FROM_GC_SCAN
        self._lock = threading.RLock()
        self._local = threading.local()
        self._snapshots: list[dict[str, Any]] = []
        self._operations: list[Span] = []
        self._open: dict[int, Span] = {}
        self._next_token = 0
        self._samples = SampleBuilder()
        self._pytorch_ops: dict[tuple[str, str], dict[str, Any]] = {}
        self._threads: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        self._prev_handlers: dict[int, Any] = {}
        # the handler installed for SIGTERM and SIGINT: a builtin (no Python frame) that
        # calls _on_signal, then the handler installed before, so what that one raises
        # has the traceback it has without the profiler
        self._signal_handler = functools.partial(_core._chain_signal, self._on_signal)
        self._atexit_registered = False
        self._written_path: Path | None = None
        self._running = False
        self.start_ns = time.monotonic_ns()
        self.start_unix = time.time()

    # ---- life cycle ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running

    @property
    def oom_post_mortems(self) -> list[str]:
        """The OOM post-mortems (JSON paths) written while this tracker ran."""
        if self._oom_watch is not None:
            return [p["json"] for p in self._oom_watch.written]
        return list(self._oom_written)

    @property
    def source(self) -> LedgerSource | None:
        return self._source

    def start(self) -> MemoryTracker:
        """Turn the hooks on, start the snapshot thread (when ``interval`` is set) and
        install the exit and signal handlers.  Does nothing when disabled."""
        if not self.enabled or self._running:
            return self
        if self._source is None:
            self._source = LedgerSource(torch_hooks=self._torch_hooks)
        lord = self._source.lord
        if self.events and lord.events_capacity == 0:
            lord.record_events(self.events)
            self._own_ring = True
        self._ring_capacity = lord.events_capacity
        self._source.start()
        if self.oom and hasattr(lord, "watch_oom") and _oom.watch_of(lord) is None:
            # out-of-memory post-mortems beside the profile (a watch the program set
            # up itself is kept as it is)
            self._oom_watch = lord.watch_oom(self.output_dir)
        self._pid = os.getpid()
        self.start_ns = time.monotonic_ns()
        self.start_unix = time.time()
        self._running = True
        self._sample()
        if self.interval is not None:
            self._stop_event.clear()
            self._thread = threading.Thread(
                target=self._periodic, name="memlord-profiler", daemon=True
            )
            self._thread.start()
        atexit.register(self._at_exit)
        self._atexit_registered = True
        if self._install_handlers and threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                try:
                    self._prev_handlers[sig] = signal.getsignal(sig)
                    signal.signal(sig, self._signal_handler)
                except (ValueError, OSError) as exc:  # pragma: no cover - embedded interpreters
                    log.debug("memlord profiler: cannot handle signal %s: %s", sig, exc)
        return self

    def _forked(self) -> bool:
        """True in a child process made by ``os.fork()`` after the tracker started: the
        parent writes the reports, the child writes nothing."""
        return os.getpid() != self._pid

    def _stop_thread(self) -> None:
        self._stop_event.set()
        thread = self._thread
        self._thread = None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def stop(self) -> list[Path]:
        """Stop the thread, write the reports, restore the handlers, turn the hooks
        off.  Returns the paths written (none when disabled or already stopped, and in
        a forked child, which writes nothing)."""
        if not self.enabled or not self._running:
            return []
        self._stop_thread()
        written = []
        if not self._forked():
            self.take_snapshot("stop")
            written = self.write()
        if self._own_ring and self._source is not None:
            # keep what the ring holds for profile(), and give its memory back
            self._frozen = read_consistent(self._source.lord)
            self._frozen_dropped = self._source.lord.events_dropped
            # record_events(0) frees the names only the ring's records referred to
            self._frozen_names = self._source.lord._region_names()
            self._source.lord.record_events(0)
            self._own_ring = False
        self._running = False
        self._restore_handlers()
        if self._atexit_registered:
            atexit.unregister(self._at_exit)
            self._atexit_registered = False
        if self._oom_watch is not None:
            self._oom_written = [p["json"] for p in self._oom_watch.written]
            self._oom_watch.disable()
            self._oom_watch = None
        if self._source is not None:
            self._source.stop()
        return written

    def _restore_handlers(self) -> None:
        for sig, prev in self._prev_handlers.items():
            try:
                if signal.getsignal(sig) is self._signal_handler:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):  # pragma: no cover - not the main thread
                pass
        self._prev_handlers.clear()

    def _at_exit(self) -> None:
        if self._running and not self._forked():
            self._stop_thread()
            self.take_snapshot("exit")
            self.write()

    def _on_signal(self, signum: int, frame: Any) -> Any:
        """Write the files; return the handler installed before, for the caller
        (``_core._chain_signal``) to call, or None where that was SIG_IGN or SIG_DFL
        (the default behaviour is delivered again from here)."""
        try:
            if not self._forked():
                # no join: the snapshot thread may wait for a lock this thread holds
                self._stop_event.set()
                # a write this signal interrupted goes on when the handlers return: this
                # one has its own temporary file, and the last complete one stays
                self.write()
        except Exception:  # noqa: BLE001 - a signal handler must reach the chained one
            log.exception("memlord profiler: writing the profile on signal %s failed", signum)
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        if callable(prev):
            return prev
        if prev == signal.SIG_IGN:
            return None
        # the default behaviour: restore it and deliver the signal again
        self._restore_handlers()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    def _periodic(self) -> None:
        assert self.interval is not None
        # any finite interval is valid; a wait past TIMEOUT_MAX raises OverflowError
        wait_s = min(self.interval, threading.TIMEOUT_MAX)
        while not self._stop_event.wait(wait_s):
            try:
                # totals only: scanning objects from this thread is not safe
                self.take_snapshot(None, tensors=False)
            except Exception:  # noqa: BLE001 - the thread must outlive a failed snapshot
                log.exception("memlord profiler: periodic snapshot failed")

    # ---- recording ---------------------------------------------------------------------

    def _sample(self) -> dict[str, dict[str, Any]]:
        src = self._source
        if src is None:
            return {}
        totals = src.totals()
        now = time.monotonic_ns()
        with self._lock:
            for dev, t in totals.items():
                self._samples._add(now, dev, t["allocated"], t["pending"], t["reserved"])
        return totals

    def take_snapshot(
        self, checkpoint_name: str | None = None, *, tensors: bool = True
    ) -> dict[str, Any] | None:
        """A snapshot now: totals from the ledger and, with ``tensors``, the largest live
        tensors per device (``_snapshot_section``: the lord's registry of live storages
        plus a scan of Python's objects for the tensors it never saw, so only on the
        caller's thread).  None when the tracker is not running."""
        if checkpoint_name is not None:
            _check_name(checkpoint_name, "checkpoint_name")
        if not self._running or self._source is None:
            return None
        totals = self._sample()
        section = None
        if tensors:
            try:
                section, self._top_from = self._source.snapshot_section(self.top)
            except Exception:  # noqa: BLE001 - a snapshot never raises into the caller
                log.exception("memlord profiler: finding the live tensors failed")
                section = {}
        snap = build_snapshot(totals, section, checkpoint_name, time.monotonic_ns())
        with self._lock:
            self._snapshots.append(snap)
        return snap

    def _stack(self) -> list[tuple[int, Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _sink(self) -> list[tuple[str, _RegionRaw]]:
        # per thread, so the item a region appends at exit is the last one of this list
        sink = getattr(self._local, "sink", None)
        if sink is None:
            sink = self._local.sink = []
        return sink

    def begin(self, name: str, kind: str = "operation") -> int:
        """Open a span (the low-level half of :meth:`track_operation`) and a lord region
        of the same name under it; returns a token for :meth:`end`, or -1 when the
        tracker is not running."""
        name = _check_name(name)
        kind = _check_name(kind, "kind")  # a profile's span kind is a string
        if not self._running or self._source is None:
            return -1
        totals = self._sample()
        thread = threading.current_thread()
        stack = self._stack()
        span = Span(
            name=name,
            start_ns=time.monotonic_ns(),
            end_ns=0,
            thread=thread.ident or 0,
            depth=len(stack),
            kind=kind,
            pre_total=sum(t["allocated"] for t in totals.values()),
            tensor_delta=-sum(t["live"] for t in totals.values()),
            delta={d: -t["allocated"] for d, t in totals.items()},
            finished=False,
        )
        region = None
        try:
            region = self._source.lord._region_with_sink(name, self._sink())
            region.__enter__()
        except Exception:  # noqa: BLE001 - the operation runs, measured by the totals only
            log.exception("memlord profiler: opening the region of %r failed", name)
            region = None
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._open[token] = span
            self._threads[str(span.thread)] = thread.name
        stack.append((token, region))
        return token

    def end(self, token: int) -> None:
        """Close the span ``begin`` opened (and any span opened inside it and left open
        on this thread, e.g. by a module whose forward raised)."""
        if not isinstance(token, int) or isinstance(token, bool):
            raise TypeError(f"token must be an int, got {type(token).__name__}")
        if token < 0:
            return
        stack = self._stack()
        if not any(t == token for t, _ in stack):
            return
        while stack:
            top, region = stack.pop()
            item = None
            if region is not None:
                sink = self._sink()
                try:
                    region.__exit__(None, None, None)
                    item = sink.pop() if sink else None
                except Exception:  # noqa: BLE001 - accounting never raises into the caller
                    log.exception("memlord profiler: closing a region failed")
                sink.clear()
            totals = self._sample() if self._running else {}
            end_ns = time.monotonic_ns()
            with self._lock:
                span = self._open.pop(top, None)
                if span is not None:
                    self._finish(span, totals, end_ns, item=item)
            if top == token:
                break

    def _finish(
        self,
        span: Span,
        totals: dict[str, dict[str, Any]],
        end_ns: int,
        record: bool = True,
        item: tuple[str, _RegionRaw] | None = None,
    ) -> None:
        """Close ``span``: totals from the ledger; with the operation's closed region
        (``item``), its exact start, end, per-device delta, peak and storages."""
        span.end_ns = end_ns
        span.post_total = sum(t["allocated"] for t in totals.values())
        span.tensor_delta += sum(t["live"] for t in totals.values())
        for dev, t in totals.items():
            span.delta[dev] = span.delta.get(dev, 0) + t["allocated"]
        if item is not None:
            exact = region_span(item[0], item[1])
            span.start_ns, span.end_ns = exact.start_ns, exact.end_ns
            span.delta, span.peak, span.tensor_delta = exact.delta, exact.peak, exact.tensor_delta
            span.categories = exact.categories
            self._op_items[id(item)] = item
        span.finished = True
        if record:
            self._operations.append(span)

    @contextlib.contextmanager
    def track_operation(self, name: str) -> Iterator[None]:
        """Record the memory delta of the block as one call of operation ``name``
        (nestable; counted per name in ``operation_summary``)."""
        token = self.begin(_check_name(name))
        try:
            yield
        finally:
            self.end(token)

    @contextlib.contextmanager
    def track_pytorch_ops(self) -> Iterator[None]:
        """Record per-operator statistics (count, CPU and CUDA time, memory, input
        shapes) with ``torch.profiler`` for the block.  Opt-in: it costs what
        torch.profiler costs.  Another active torch profiler makes it a no-op."""
        if not self._running:
            yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # a profiler the program runs: torch 2.13 lets a second one start, which takes
        # the session and leaves the program's with no event at all
        # torch.autograd has it from torch._C._autograd without re-exporting it
        if torch.autograd._profiler_enabled():  # type: ignore[attr-defined]
            log.warning(
                "memlord profiler: torch.profiler is busy (another profiler is "
                "active); ops not recorded"
            )
            yield
            return
        prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True
        )
        try:
            prof.__enter__()
        except RuntimeError as exc:
            log.warning("memlord profiler: torch.profiler is busy (%s); ops not recorded", exc)
            yield
            return
        try:
            yield
        finally:
            prof.__exit__(None, None, None)
            try:
                self._add_pytorch_ops(prof)
            except Exception:  # noqa: BLE001 - statistics must not break the caller
                log.exception("memlord profiler: reading torch.profiler's results failed")

    def _add_pytorch_ops(self, prof: Any) -> None:
        # the lord's own dispatch mode (op outputs) is a row of torch.profiler's, not an
        # operator of the program
        own_mode = bool(getattr(self._source, "_want_ops", False))
        for evt in prof.key_averages(group_by_input_shape=True):
            if own_mode and evt.key == "PythonDispatchMode":
                continue
            shapes = [list(s) for s in (evt.input_shapes or [])]
            key = (evt.key, repr(shapes))
            cuda_time = getattr(evt, "device_time_total", getattr(evt, "cuda_time_total", 0))
            cuda_mem = getattr(evt, "device_memory_usage", getattr(evt, "cuda_memory_usage", 0))
            with self._lock:
                row = self._pytorch_ops.setdefault(
                    key,
                    {
                        "op_name": evt.key,
                        "count": 0,
                        "cpu_time_us": 0.0,
                        "cuda_time_us": 0.0,
                        "cpu_memory_mb": 0.0,
                        "cuda_memory_mb": 0.0,
                        "input_shapes": shapes,
                    },
                )
                row["count"] += int(evt.count)
                row["cpu_time_us"] += float(evt.cpu_time_total)
                row["cuda_time_us"] += float(cuda_time or 0)
                row["cpu_memory_mb"] += float(evt.cpu_memory_usage or 0) / MiB
                row["cuda_memory_mb"] += float(cuda_mem or 0) / MiB

    # ---- output ------------------------------------------------------------------------

    def profile(self) -> Profile:
        """Everything recorded so far as a :class:`memlord.report.Profile` (spans still
        open are included, ending now, marked unfinished)."""
        src = self._source
        totals = src.totals() if src is not None and self._running else {}
        now = time.monotonic_ns()
        with self._lock:
            operations = list(self._operations)
            for span in self._open.values():
                copy = Span(**{**span.__dict__, "delta": dict(span.delta)})
                self._finish(copy, totals, now, record=False)
                copy.finished = False
                operations.append(copy)
            operations.sort(key=lambda s: (s.start_ns, -s.end_ns))
            snapshots = list(self._snapshots)
            samples = self._samples.build()
            pytorch_ops = sorted(self._pytorch_ops.values(), key=lambda r: -r["cpu_time_us"])
            threads = dict(self._threads)
            op_items = set(self._op_items)
        baseline: dict[str, int]
        regions: list[Span]
        events, baseline, regions = None, {}, []
        ring_meta: dict[str, Any] = {}
        if src is not None:
            lord = src.lord
            # each part on its own: a profile is written even without one of them
            try:
                recs, stats = self._frozen or read_consistent(lord)
                events, baseline, skipped = ring_events(
                    lord if self._frozen is None else _NamedAsFrozen(lord, self._frozen_names),
                    recs,
                    stats,
                )
                ring_meta = {
                    "category_baseline": category_baseline(events, stats),
                    "events_capacity": self._ring_capacity,
                    "events_dropped": (
                        lord.events_dropped if self._frozen is None else self._frozen_dropped
                    ),
                    "events_before_reset": skipped,
                    "site_frames": site_frames_table(recs),
                }
            except Exception:  # noqa: BLE001 - never raises into the caller
                log.exception("memlord profiler: reading the event ring failed")
            try:
                regions, kept, seen = region_spans(lord, exclude=op_items)
                ring_meta.update({"regions_kept": kept, "regions_closed": seen})
            except Exception:  # noqa: BLE001 - never raises into the caller
                log.exception("memlord profiler: reading the closed regions failed")
            # a region's thread, alive or ended, by its name (thread_names)
            threads.update(
                thread_names({s.thread for s in regions if str(s.thread) not in threads})
            )
        metadata = {
            "generated_at": _dt.datetime.now().isoformat(timespec="seconds"),
            "operation_tracking_enabled": True,
            "title": self.title or "memlord memory profile",
            "start_ns": self.start_ns,
            "start_unix": self.start_unix,
            "interval_s": self.interval,
            "pid": os.getpid(),
            "argv": list(sys.argv),
            "python_version": platform.python_version(),
            "torch_version": torch.__version__,
            "memlord_version": __version__,
            "threads": threads,
            "top_tensors_from": self._top_from,
            "event_baseline": baseline,
            **ring_meta,
            **rank_metadata(),
        }
        return Profile(
            metadata=metadata,
            snapshots=snapshots,
            operations=operations,
            regions=regions,
            events=events if events is not None else Events(),
            samples=samples,
            hotspots=src.hotspots() if src is not None else [],
            counters=src.counters() if src is not None else {},
            pytorch_operations=pytorch_ops,
        )

    def json_path(self) -> Path | None:
        """Where the JSON goes: fixed at the first call (one file per session).  The
        default name, ``memory_profile_<YYYYmmdd_HHMMSS>_<pid>_<n>.json`` (the time, the
        process, a counter of the process's trackers), is one no other tracker of any
        process uses, and not the name of a file already there."""
        if self._json_path is False:
            return None
        if self._json_path not in (None, True):
            return Path(self._json_path)  # type: ignore[arg-type]
        with self._lock:
            if self._written_path is None:
                while True:
                    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
                    rank = rank_info().get("rank")
                    tail = "" if rank is None else f"_rank{rank}"
                    name = f"memory_profile_{stamp}_{os.getpid()}_{next(_name_counter)}{tail}.json"
                    path = self.output_dir / name
                    if not path.exists():
                        break
                self._written_path = path
            return self._written_path

    def write(self) -> list[Path]:
        """Write the JSON and the extra exports now; returns the paths written.  A path
        that cannot be written is logged, never raised.  Each file is written whole or
        not at all (a temporary file of its own, renamed), so a signal whose handler
        writes while this write is interrupted, or another thread writing at once,
        cannot spoil it.  Nothing is written in a forked child."""
        if not self.enabled or self._forked():
            return []
        doc = self.profile()
        paths = [p for p in [self.json_path(), *self.exports] if p is not None]
        written = []
        for path in paths:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                export(doc, path)
                written.append(path)
            except Exception:  # noqa: BLE001 - exit and signal paths must not raise
                log.exception("memlord profiler: writing %s failed", path)
        return written


# ---- the module-level API (the memory profiler's) ------------------------------------------

_tracker: MemoryTracker | None = None
# re-entrant: a finalizer run while the disabled tracker is made may ask for it
_tracker_lock = threading.RLock()


def initialize_memory_tracker(
    output_dir: str | os.PathLike[str] = ".",
    enabled: bool = True,
    interval: float | None = 5.0,
    **options: Any,
) -> MemoryTracker:
    """Start the process-wide tracker (stopping, and writing, a previous one).  With
    ``enabled=False`` it records nothing and writes nothing.  ``options`` are
    :class:`MemoryTracker`'s keyword arguments."""
    global _tracker
    tracker = MemoryTracker(output_dir, enabled, interval, **options)
    with _tracker_lock:
        previous, _tracker = _tracker, tracker
    if previous is not None:
        previous.stop()
    return tracker.start()


def get_memory_tracker() -> MemoryTracker:
    """The process-wide tracker; a disabled one (every method a no-op) before
    :func:`initialize_memory_tracker`."""
    global _tracker
    with _tracker_lock:
        if _tracker is None:
            disabled = MemoryTracker(enabled=False)
            if _tracker is None:  # a finalizer meanwhile may have made one
                _tracker = disabled
        return _tracker


def memory_checkpoint(name: str) -> dict[str, Any] | None:
    """A named snapshot now (None when no tracker is running)."""
    return get_memory_tracker().take_snapshot(_check_name(name))


def stop_memory_tracker() -> Path | None:
    """Stop the process-wide tracker and write its profile; returns the JSON path
    (None when nothing was written)."""
    global _tracker
    with _tracker_lock:
        tracker, _tracker = _tracker, None
    if tracker is None:
        return None
    written = tracker.stop()
    json_path = tracker.json_path() if written else None
    return json_path if json_path in written else (written[0] if written else None)
