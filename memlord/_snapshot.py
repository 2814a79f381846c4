"""Live snapshots, leak checks and growth: ``lord.snapshot()``, ``lord.leak_check()``,
``lord.assert_no_leak()``, ``lord.step()`` and ``lord.growth()``.

All of them read memlord's own registry of the storages it tracks (lifetime tracking,
``lord.hook_into_python()``), not a scan of every Python object: each tracker remembers,
when memlord first counts its storage, the birth time, the call site, the innermost open
region of the thread, the storage's data pointer, and the dtype, shape and
``requires_grad`` of the tensor through which memlord saw the storage first.  The C core
(``src/snapshot.c``) walks the registry without running Python, copying plain values:
the per-device totals and each device's largest storages (or every storage born after a
time, or the live bytes per site); Python only shapes the result.

A snapshot is a dict keyed by device string (``"cpu"``, ``"cuda:0"``)::

    {"cpu": {"total_bytes": int, "count": int, "top": [entry, ...]}}

and an entry (largest first) is::

    {"nbytes": int, "shape": tuple | None, "dtype": "torch.float32" | None,
     "device": "cpu", "requires_grad": bool, "site": "file:line" | None,
     "region": str | None, "age_s": float | None, "tracked": bool,
     "category": str}   # memlord.CATEGORIES

See docs/api.md#live-snapshots for every field.
"""

from __future__ import annotations

import gc
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from ._bytes import format_bytes
from ._core import _gc_objects_of
from ._errors import type_name
from ._sites import site_text

if TYPE_CHECKING:
    from ._core import Lord, _LiveEntry
    from ._core import Lord as _LordBase
else:
    _LordBase = object  # the mixin's methods run on memlord.MemLord, a _core.Lord

#: Step samples kept for growth(): growth(min_steps) needs min_steps + 1 of them.
MAX_STEPS = 64
#: Step marks (``(steps, monotonic ns)`` of each ``step()``) kept for LifetimeAnalyzer.
MAX_STEP_MARKS = 1 << 16

_SINCE_ALL = -(2**63)


def _life_off(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} needs lifetime tracking, which is off: turn it on with "
        "lord.hook_into_python() (keep the handle, or use it as a context manager)"
    )


def _check_int(fname: str, name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fname}(): argument '{name}' must be an int, not {type_name(value)}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise ValueError(f"{fname}(): argument '{name}' must be {bound}, not {value}")
    return value


def _check_bool(fname: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{fname}(): argument '{name}' must be a bool, not {type_name(value)}")
    return value


class _Decoder:
    """Turns the C core's entry tuples into entry dicts (caching device names)."""

    def __init__(self, lord: Lord, now_ns: int) -> None:
        self._lord = lord
        self._now = now_ns
        self._names = lord._region_names()
        self._devices: dict[int, str] = {}

    def device(self, key: int) -> str:
        name = self._devices.get(key)
        if name is None:
            name = self._devices[key] = self._lord._device_name(key)
        return name

    def entry(self, raw: _LiveEntry) -> dict[str, Any]:
        dev, nbytes, _ptr, born_ns, site, region, dtype, requires_grad, shape, category = raw
        names = self._names
        return {
            "nbytes": nbytes,
            "shape": shape,
            "dtype": None if dtype is None else str(dtype),
            "device": self.device(dev),
            "requires_grad": requires_grad,
            "site": site_text(site) if site else None,
            "region": (names[region] or None) if 0 < region < len(names) else None,
            "age_s": max(self._now - born_ns, 0) / 1e9,
            "tracked": True,
            "category": category,
        }


#: The modules of tensors that hold no memory of their own (torch.compile's, AOT's,
#: make_fx's and FakeTensorMode's), and their classes: never imported here.
_TRACING_TYPES = (
    ("torch._subclasses.fake_tensor", "FakeTensor"),
    ("torch._subclasses.functional_tensor", "FunctionalTensor"),
)


def _tracing_types() -> tuple[type, ...]:
    """FakeTensor and FunctionalTensor, where loaded: tensors of tracing, whose data
    pointer must not be read (torch warns that it is deprecated and will raise)."""
    out = []
    for module, name in _TRACING_TYPES:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            out.append(cls)
    return tuple(out)


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor the cyclic GC tracks or gc.freeze() froze (FakeTensors and
    FunctionalTensors left out), for the caller's thread to inspect.

    ``gc.get_objects()`` returns a list holding a reference to every tracked object,
    including tuples another thread is still filling: a tuple that ``tuple(gen)`` is
    filling may be resized only while nothing else refers to it, and CPython fails with
    ``SystemError: bad argument to internal function`` in that thread otherwise.  So the
    list never reaches Python: one C call (``_core._gc_objects_of``) makes it, keeps the
    tensors and drops it, holding the GIL and running no Python meanwhile, so that no
    other thread runs while it exists.  With lifetime tracking on, memlord's registry
    of live storages answers instead (see :func:`_snapshot_section`)."""
    return _gc_objects_of(gc.get_objects, torch.Tensor, _tracing_types())


_is_functional = getattr(torch, "_is_functional_tensor", None)


def _skipped(t: Any) -> bool:
    """A tensor without memory of its own, whose storage is not read: meta tensors and
    functionalization's wrappers (their storage's data pointer is not real)."""
    return bool(t.is_meta) or (_is_functional is not None and bool(_is_functional(t)))


def _shape_or_none(t: Any) -> tuple[int, ...] | None:
    """t's shape, or None for a tensor without sizes (a jagged nested tensor)."""
    try:
        return tuple(t.shape)
    except Exception:  # noqa: BLE001 - NestedTensorImpl's sizes raise
        return None


def _owner_rank(t: Any) -> int:
    """How well a tensor describes the storage it shares with others: the tensor that
    owns it (no view of another; a parameter first) ranks above a view of it, so that
    which one a scan meets first (the order of the collector's generations, which
    depends on when it last ran) does not decide the shape reported."""
    try:
        view = bool(t._is_view())
    except Exception:  # noqa: BLE001 - a subclass may refuse: it ranks as a view
        view = True
    return (0 if view else 2) + (1 if isinstance(t, torch.nn.Parameter) else 0)


def _untracked_storages(lord: Lord) -> list[dict[str, Any]]:
    """Entries for the storages of live tensors that lord does not track, found with a
    scan of the objects the cyclic GC knows; one per storage, its shape, dtype and
    requires_grad those of the tensor that owns it (see :func:`_owner_rank`; among
    equals, the first found)."""
    seen: dict[int, Any] = {}  # id(storage) -> storage, kept alive for the scan
    found: dict[int, tuple[int, dict[str, Any]]] = {}  # id(storage) -> (rank, entry)
    out = []
    for obj in _live_tensors():
        try:
            if _skipped(obj):
                continue
            storage = obj.untyped_storage()
            if id(storage) in seen:
                known = found.get(id(storage))
                rank = _owner_rank(obj)
                if known is not None and rank > known[0]:
                    known[1].update(_describe(obj))
                    found[id(storage)] = (rank, known[1])
                continue
            seen[id(storage)] = storage
            device = storage.device
            if device.type == "meta" or lord._tracks_storage(storage):
                continue
            nbytes = storage.nbytes()
            if nbytes <= 0:
                continue
            entry = {
                "nbytes": int(nbytes),
                "shape": None,
                "dtype": None,
                "device": str(device),
                "requires_grad": False,
                "site": None,
                "region": None,
                "age_s": None,
                "tracked": False,
                "category": "other",
            }
            entry.update(_describe(obj))
            found[id(storage)] = (_owner_rank(obj), entry)
        except Exception:  # noqa: BLE001 - a tensor without a readable storage (sparse, ...)
            continue
        out.append(entry)
    return out


def _describe(t: Any) -> dict[str, Any]:
    """The fields of an untracked storage's entry that come from a tensor of it."""
    return {
        "shape": _shape_or_none(t),
        "dtype": str(t.dtype),
        "requires_grad": bool(t.requires_grad),
        "category": "parameter" if isinstance(t, torch.nn.Parameter) else "other",
    }


def _sort_key(entry: dict[str, Any]) -> tuple[int, bool]:
    return (-entry["nbytes"], not entry["tracked"])


class LeakCheck:
    """What ``lord.leak_check()`` returns: a context manager that notes when it is
    entered and, on exit, lists the tracked storages born inside that are still alive.

    - ``leaked``: entries like a snapshot's (largest first), filled on exit;
    - ``by_site()``: ``{"file:line" or None: {"bytes": int, "count": int}}``, largest
      first;
    - ``table()``: the same as readable text.

    Storages born on any thread count.  With ``collect=True`` (the default) the cyclic
    garbage collector runs before the check, so that garbage in reference cycles is not
    reported.
    """

    def __init__(self, lord: Lord, *, collect: bool = True, raise_on_leak: bool = False) -> None:
        self._lord = lord
        self._collect = collect
        self._raise = raise_on_leak
        self._since: int | None = None
        self.leaked: list[dict[str, Any]] = []

    def __enter__(self) -> LeakCheck:
        if not self._lord._life_active():
            raise _life_off("leak_check()")
        self.leaked = []
        self._since = self._lord._now_ns()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        self.check()
        if self._raise and self.leaked and exc_type is None:
            raise AssertionError(self.table())
        return False

    def check(self) -> list[dict[str, Any]]:
        """Look again (inside or after the block): the storages born since entry that
        are alive now.  Also fills ``leaked``."""
        if self._since is None:
            raise RuntimeError("leak_check(): check() before the block was entered")
        if self._collect:
            gc.collect()
        now, _totals, raw = self._lord._live(-1, self._since)
        dec = _Decoder(self._lord, now)
        entries = [dec.entry(e) for e in raw]
        entries.sort(key=_sort_key)
        self.leaked = entries
        return entries

    def by_site(self) -> dict[str | None, dict[str, int]]:
        """Leaked bytes and storages per call site, largest first."""
        sites: dict[str | None, dict[str, int]] = {}
        for e in self.leaked:
            s = sites.setdefault(e["site"], {"bytes": 0, "count": 0})
            s["bytes"] += e["nbytes"]
            s["count"] += 1
        return dict(sorted(sites.items(), key=lambda kv: (-kv[1]["bytes"], str(kv[0]))))

    def table(self, limit: int = 20) -> str:
        """The leak as text: a summary line, bytes per site and the largest storages."""
        limit = _check_int("table", "limit", limit, 0)
        total = sum(e["nbytes"] for e in self.leaked)
        n = len(self.leaked)
        lines = [
            f"memlord: {n} storage{'s' if n != 1 else ''} ({format_bytes(total)}) born inside "
            "the leak check still alive"
        ]
        sites = self.by_site()
        if sites:
            width = max(len(str(s)) for s in sites)
            width = max(width, 4)
            lines.append(f"  {'site':<{width}}  {'count':>7}  {'bytes':>12}")
            for site, s in list(sites.items())[:limit]:
                name = site if site is not None else "<unknown>"
                lines.append(f"  {name:<{width}}  {s['count']:>7}  {format_bytes(s['bytes']):>12}")
            lines.append("  largest:")
            for e in self.leaked[: min(limit, 5)]:
                shape = "?" if e["shape"] is None else "x".join(map(str, e["shape"])) or "()"
                region = f"  region {e['region']}" if e["region"] else ""
                lines.append(
                    f"    {format_bytes(e['nbytes']):>12}  {e['device']}  {e['dtype']}  "
                    f"[{shape}]  {e['site'] or '<unknown>'}{region}"
                )
        return "\n".join(lines)

    def __repr__(self) -> str:
        total = sum(e["nbytes"] for e in self.leaked)
        return f"<LeakCheck leaked={len(self.leaked)} bytes={total}>"


class SnapshotMixin(_LordBase):
    """Snapshots, leak checks and growth for MemLord."""

    def snapshot(
        self, top: int = 10, *, include_untracked: bool = False
    ) -> dict[str, dict[str, Any]]:
        """The live tracked storages, per device: ``{"cpu": {"total_bytes", "count",
        "top": [entry, ...]}}`` with each device's ``top`` largest storages, largest
        first.  ``include_untracked=True`` also scans the objects the cyclic GC knows for
        tensors whose storage memlord does not track (made before tracking, by code it
        does not see): they count in ``total_bytes``/``count``, in ``untracked_bytes``/
        ``untracked_count`` and in ``top`` (``"tracked": False``).  Requires lifetime
        tracking (RuntimeError otherwise).  See docs/api.md#live-snapshots."""
        top = _check_int("snapshot", "top", top, 0)
        include_untracked = _check_bool("snapshot", "include_untracked", include_untracked)
        lord = self
        if not lord._life_active():
            raise _life_off("snapshot()")
        # a top beyond any possible count of storages means all of them
        now, totals, raw = lord._live(min(top, sys.maxsize), _SINCE_ALL)
        dec = _Decoder(lord, now)
        out: dict[str, dict[str, Any]] = {}
        for dev, nbytes, count in sorted(totals):
            out[dec.device(dev)] = {"total_bytes": nbytes, "count": count, "top": []}
        for e in raw:
            entry = dec.entry(e)
            out[entry["device"]]["top"].append(entry)
        if include_untracked:
            for d in out.values():
                d["untracked_bytes"] = 0
                d["untracked_count"] = 0
            for entry in _untracked_storages(lord):
                d = out.setdefault(
                    entry["device"],
                    {
                        "total_bytes": 0,
                        "count": 0,
                        "top": [],
                        "untracked_bytes": 0,
                        "untracked_count": 0,
                    },
                )
                d["total_bytes"] += entry["nbytes"]
                d["count"] += 1
                d["untracked_bytes"] += entry["nbytes"]
                d["untracked_count"] += 1
                d["top"].append(entry)
            for d in out.values():
                d["top"].sort(key=_sort_key)
                del d["top"][top:]
        return out

    def leak_check(self, *, collect: bool = True) -> LeakCheck:
        """A context manager: after the block, ``.leaked`` lists the tracked storages
        born inside that are still alive, ``.by_site()`` their bytes and count per call
        site.  ``collect`` runs the cyclic GC before looking.  Requires lifetime
        tracking (RuntimeError otherwise)."""
        collect = _check_bool("leak_check", "collect", collect)
        if not self._life_active():
            raise _life_off("leak_check()")
        return LeakCheck(self, collect=collect)

    def assert_no_leak(self, *, collect: bool = True) -> LeakCheck:
        """As ``leak_check()``, and leaving the block raises AssertionError with a table
        of what is left when anything is (not when the block itself raised)."""
        collect = _check_bool("assert_no_leak", "collect", collect)
        if not self._life_active():
            raise _life_off("assert_no_leak()")
        return LeakCheck(self, collect=collect, raise_on_leak=True)

    # ---- growth -----------------------------------------------------------------------

    def _step_samples(self) -> deque[dict[int, int]]:
        samples: deque[dict[int, int]] | None = self.__dict__.get("_steps_seen")
        if samples is None:
            samples = self.__dict__.setdefault("_steps_seen", deque(maxlen=MAX_STEPS))
        return samples

    def step(self) -> int:
        """Mark the end of a training step: note the live tracked bytes per call site.
        Returns the number of steps marked.  Requires lifetime tracking."""
        lord = self
        if not lord._life_active():
            raise _life_off("step()")
        sample = lord._live_by_site()
        self.__dict__["_step_count"] = self.__dict__.get("_step_count", 0) + 1
        self._step_samples().append(sample)
        marks = self.__dict__.get("_step_marks")
        if marks is None:
            marks = self.__dict__.setdefault("_step_marks", deque(maxlen=MAX_STEP_MARKS))
        marks.append((self.__dict__["_step_count"], time.monotonic_ns()))
        return cast(int, self.__dict__["_step_count"])

    @property
    def steps(self) -> int:
        """The number of ``step()`` calls so far."""
        return cast(int, self.__dict__.get("_step_count", 0))

    def growth(self, min_steps: int = 3) -> list[dict[str, Any]]:
        """The call sites whose live tracked bytes grew at every one of the last
        ``min_steps`` steps: ``[{"site": "file:line" or None, "bytes": [...], "growth":
        int}]``, ``bytes`` being the site's live bytes at each of the last ``min_steps +
        1`` steps, largest growth first.  Empty until enough steps were marked."""
        min_steps = _check_int("growth", "min_steps", min_steps, 1, MAX_STEPS - 1)
        samples = list(self._step_samples())[-(min_steps + 1) :]
        if len(samples) < min_steps + 1:
            return []
        by_text: list[dict[str | None, int]] = []
        for sample in samples:
            folded: dict[str | None, int] = {}
            for site_id, nbytes in sample.items():
                key = site_text(site_id) if site_id else None
                folded[key] = folded.get(key, 0) + nbytes
            by_text.append(folded)
        sites = set().union(*by_text)
        out: list[dict[str, Any]] = []
        for site in sites:
            series = [s.get(site, 0) for s in by_text]
            if all(b > a for a, b in zip(series[:-1], series[1:], strict=True)):
                out.append({"site": site, "bytes": series, "growth": series[-1] - series[0]})
        out.sort(key=lambda d: (-d["growth"], str(d["site"])))
        return out
