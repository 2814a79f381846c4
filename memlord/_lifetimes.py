"""Storage lifetimes, what is live at the peak, suggestions and a reuse plan.

A :class:`LifetimeAnalyzer` reads a lord's event ring (``lord.record_events``) with
lifetime tracking on: each storage's alloc is paired with its free by device and data
pointer (vectorised: one lexsort), which gives its birth, death, bytes, call site,
region (the module, with ``track_modules``) and category; ``lord.step()`` marks split
the timeline into steps.  Or it is fed by hand, as the kitsune seed's analyzer is:
``record_usage(step, tensors)`` for the tensors in use at each step.

Every query is NumPy over those columns: the peak is a sort of the births and deaths and
a cumulative sum; the reuse plan assigns storages to shared buffers in one pass over the
same sorted endpoints.
"""

from __future__ import annotations

import bisect
import operator
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._bytes import human_bytes
from ._core import CATEGORIES
from ._errors import type_name

if TYPE_CHECKING:
    from ._core import _LiveEntry
    from .lord import MemLord

__all__ = ["LifetimeAnalyzer", "ReusePlan"]

#: A storage still alive when the analysis was made dies "never".
ALIVE = np.iinfo(np.int64).max
#: Times are doubled in sort keys: "alive" is clipped to this first.
_CLIP = 1 << 61
_BACKWARD = " (backward)"
#: Categories that hold state across steps: never "free earlier" candidates.
_STATE = frozenset({"parameter", "buffer", "gradient", "optimizer_state"})
_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
#: Suggestions kept per kind.
TOP = 10


def _name(fname: str, arg: str, value: Any, expected: str) -> TypeError:
    return TypeError(f"{fname}(): argument '{arg}' must be {expected}, not {type_name(value)}")


def _step_arg(fname: str, step: Any) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool):
        raise _name(fname, "step", step, "an int or None")
    try:
        return operator.index(step)
    except TypeError:
        raise _name(fname, "step", step, "an int or None") from None


class _Columns:
    """The storages, one row each, as NumPy columns, with the name tables."""

    def __init__(self) -> None:
        self.birth = np.empty(0, np.int64)
        self.death = np.empty(0, np.int64)
        self.nbytes = np.empty(0, np.int64)
        self.device = np.empty(0, np.int32)
        self.site = np.empty(0, np.int32)  # -1: unknown
        self.region = np.empty(0, np.int32)  # -1: none
        self.module = np.empty(0, np.int32)  # -1: none
        self.backward = np.empty(0, bool)  # born inside a "(backward)" region
        self.category = np.empty(0, np.int16)
        self.step = np.empty(0, np.int64)
        self.devices: list[str] = []
        self.sites: list[str] = []
        self.regions: list[str] = []
        self.modules: list[str] = []

    def __len__(self) -> int:
        return int(self.birth.shape[0])


def _table(codes: np.ndarray, name_of: Any, none: Any) -> tuple[np.ndarray, list[str]]:
    """Codes -> indices into a table of distinct names (-1 where ``name_of`` gives
    ``none``)."""
    if not codes.shape[0]:
        return np.empty(0, np.int32), []
    top = int(codes.max()) if codes.dtype != object else -1
    if 0 <= top < 1 << 24 and int(codes.min()) >= 0:  # small codes: a lookup, no sort
        uniq = np.flatnonzero(np.bincount(codes.astype(np.int64), minlength=top + 1))
        inverse = np.zeros(top + 1, np.int64)
        inverse[uniq] = np.arange(uniq.shape[0])
        inverse = inverse[codes]
    else:
        uniq, inverse = np.unique(codes, return_inverse=True)
    names: list[str] = []
    index: dict[str, int] = {}
    remap = np.empty(uniq.shape[0], np.int32)
    for i, code in enumerate(uniq.tolist()):
        name = name_of(code)
        if name == none:
            remap[i] = -1
            continue
        if name not in index:
            index[name] = len(names)
            names.append(name)
        remap[i] = index[name]
    return remap[inverse.reshape(-1)], names


def _module_names(modules: Any) -> set[str] | None:
    if modules is None:
        return None
    from ._regions import ModuleSpans

    if isinstance(modules, ModuleSpans):
        return set(modules._names.values())
    if isinstance(modules, torch.nn.Module):
        names = {n for n, _ in modules.named_modules() if n}
        names.add(type(modules).__name__)
        return names
    if isinstance(modules, Iterable) and not isinstance(modules, (str, bytes)):
        out = set(modules)
        if all(isinstance(n, str) for n in out):
            return out
    raise _name(
        "LifetimeAnalyzer",
        "modules",
        modules,
        "an nn.Module, a ModuleTracker, a set of module names or None",
    )


class ReusePlan:
    """Storages grouped into shared buffers whose lifetimes do not overlap.

    ``buffer_of[i]`` is the buffer of storage ``i`` (of ``storages``: columns ``birth``,
    ``death``, ``nbytes``, ``site``), ``buffer_bytes[b]`` a buffer's size (its largest
    storage); ``bytes_before`` is what the storages take each in its own allocation,
    ``bytes_after`` what the buffers take, ``saved_bytes`` the difference."""

    def __init__(
        self,
        device: str,
        storages: dict[str, Any],
        buffer_of: np.ndarray,
        buffer_bytes: np.ndarray,
    ) -> None:
        self.device = device
        self.storages = storages
        self.buffer_of = buffer_of
        self.buffer_bytes = buffer_bytes
        self.bytes_before = int(storages["nbytes"].sum())
        self.bytes_after = int(buffer_bytes.sum())

    @property
    def saved_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def __len__(self) -> int:
        return int(self.buffer_bytes.shape[0])

    def groups(self) -> list[list[int]]:
        """For each buffer, the indices of its storages, in order of birth."""
        out: list[list[int]] = [[] for _ in range(len(self))]
        order = np.argsort(self.storages["birth"], kind="stable")
        for i, b in zip(order.tolist(), self.buffer_of[order].tolist(), strict=True):
            out[b].append(i)
        return out

    def __repr__(self) -> str:
        return (
            f"ReusePlan(device={self.device!r}, storages={self.buffer_of.shape[0]}, "
            f"buffers={len(self)}, bytes_before={self.bytes_before}, "
            f"bytes_after={self.bytes_after})"
        )

    def summary(self) -> str:
        n = self.buffer_of.shape[0]
        return (
            f"reuse plan on {self.device}: {n} storages in {len(self)} buffers, "
            f"{human_bytes(self.bytes_before)} -> {human_bytes(self.bytes_after)} "
            f"(saves {human_bytes(self.saved_bytes)})"
        )


def assign_buffers(
    birth: np.ndarray, death: np.ndarray, nbytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Interval assignment: storages (half-open lifetimes ``[birth, death)``) to buffers
    no two overlapping members of which share one.  In time order (a death before a
    birth at the same moment), a birth takes the smallest free buffer that holds it,
    else the largest free one (which grows to it), else a new buffer.  With storages of
    one size every free buffer fits, which is greedy interval partitioning: as many
    buffers as the most storages alive at once, the optimum.  Returns each storage's
    buffer and each buffer's bytes."""
    n = birth.shape[0]
    buffer_of = np.full(n, -1, np.int64)
    if not n:
        return buffer_of, np.empty(0, np.int64)
    times = np.concatenate([death, birth])
    is_birth = np.concatenate([np.zeros(n, np.int8), np.ones(n, np.int8)])
    ids = np.concatenate([np.arange(n), np.arange(n)])
    order = np.lexsort((ids, is_birth, times))
    sizes: list[int] = []
    free_sizes: list[int] = []  # sorted sizes of the free buffers
    free_of: dict[int, list[int]] = {}  # size -> free buffers of that size
    nb = nbytes.tolist()
    out = [0] * n
    for births, i in zip(is_birth[order].tolist(), ids[order].tolist(), strict=True):
        if not births:
            b = out[i]
            s = sizes[b]
            bisect.insort(free_sizes, s)
            free_of.setdefault(s, []).append(b)
            continue
        need = nb[i]
        if free_sizes:
            k = bisect.bisect_left(free_sizes, need)
            s = free_sizes.pop(k if k < len(free_sizes) else -1)
            b = free_of[s].pop()
            if s < need:
                sizes[b] = need
        else:
            b = len(sizes)
            sizes.append(need)
        out[i] = b
    buffer_of[:] = out
    return buffer_of, np.array(sizes, np.int64)


def max_overlap(birth: np.ndarray, death: np.ndarray) -> int:
    """The most half-open intervals ``[birth, death)`` alive at once."""
    if not birth.shape[0]:
        return 0
    times = np.concatenate([death, birth])
    delta = np.concatenate([-np.ones(birth.shape[0], np.int64), np.ones(birth.shape[0], np.int64)])
    order = np.lexsort((delta, times))
    return int(np.cumsum(delta[order]).max())


def _device_name(device: Any) -> str:
    """``device`` as the analysis names devices (``"cpu"``, ``"cuda:0"``), or the error
    naming the argument."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"argument 'device' must be a str, a torch.device or None, not {type_name(device)}"
        )
    try:
        return str(torch.device(device))
    except (RuntimeError, ValueError):
        raise ValueError(f"argument 'device' is not a device: {device!r}") from None


class LifetimeAnalyzer:
    """The lifetimes of every storage a lord's event ring saw, or of the tensors given to
    :meth:`record_usage`; see docs/sizing.md.

    ``LifetimeAnalyzer(lord=None, *, steps=None, modules=None)``: ``lord`` with a ring
    (``record_events``) and lifetime tracking; ``steps`` the window (None: every step
    the ring holds; an int: the last ``steps`` steps marked with ``lord.step()``; a
    range or iterable of step numbers); ``modules`` which region names are modules (an
    ``nn.Module``, the ``ModuleTracker`` of ``track_modules``, a set of names; None:
    every region, ``" (backward)"`` stripped).  The ring is read once, here."""

    def __init__(self, lord: Any = None, *, steps: Any = None, modules: Any = None) -> None:
        from .lord import MemLord

        if lord is not None and not isinstance(lord, MemLord):
            raise _name("LifetimeAnalyzer", "lord", lord, "a memlord.MemLord or None")
        self._lord = lord
        self._module_names = _module_names(modules)
        self._usage: dict[tuple[str, int], list[Any]] = {}
        self._recorded: set[int] = set()
        # (step, device name) -> what _find_peak found
        self._peaks: dict[tuple[int | None, Any], tuple[int, int, int, np.ndarray]] = {}
        self._unit = "ns" if lord is not None else "step"
        self._window_arg = self._check_steps(steps)
        self._cols: _Columns | None = None
        self._marks: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.int64),) * 2
        if lord is not None:
            if not lord.events_capacity:
                raise ValueError(
                    "LifetimeAnalyzer(): argument 'lord' records no events: call "
                    "lord.record_events(capacity) before the steps"
                )
            self._cols = self._from_lord(lord)
            # a window of step numbers the ring does not hold would be an empty analysis
            # (and peak_composition(step=k) of such a step raises): refused here, before
            # any query, as peak_composition refuses its step
            self._check_window("LifetimeAnalyzer")

    @staticmethod
    def _check_steps(steps: Any) -> Any:
        if steps is None:
            return None
        if isinstance(steps, bool):
            raise _name("LifetimeAnalyzer", "steps", steps, "an int, a range of steps or None")
        if isinstance(steps, int):
            if steps < 1:
                raise ValueError(f"LifetimeAnalyzer(): argument 'steps' must be >= 1, not {steps}")
            return steps
        if isinstance(steps, Iterable) and not isinstance(steps, (str, bytes)):
            got = list(steps)
            if not got or not all(isinstance(s, int) and not isinstance(s, bool) for s in got):
                raise ValueError(
                    "LifetimeAnalyzer(): argument 'steps' must hold step numbers (ints)"
                )
            return sorted(set(got))
        raise _name("LifetimeAnalyzer", "steps", steps, "an int, a range of steps or None")

    # ---- feeding by hand -----------------------------------------------------------------

    def record_usage(self, step: int, tensors: Any) -> None:
        """Note that ``tensors`` (a tensor, or an iterable or dict of them) are in use at
        ``step`` (an int): each storage lives from the first step it is noted at to the
        step after the last."""
        if self._lord is not None:
            raise RuntimeError(
                "record_usage(): this analyzer reads a lord's event ring; make one with "
                "LifetimeAnalyzer() to feed it by hand"
            )
        s = _step_arg("record_usage", step)
        if s is None:
            raise _name("record_usage", "step", step, "an int")
        if isinstance(tensors, torch.Tensor):
            items: Iterable[Any] = (tensors,)
        elif isinstance(tensors, dict):
            items = tensors.values()
        elif isinstance(tensors, Iterable) and not isinstance(tensors, (str, bytes)):
            items = tensors
        else:
            raise _name(
                "record_usage", "tensors", tensors, "a tensor, or an iterable or dict of tensors"
            )
        items = list(items)
        for t in items:
            if not isinstance(t, torch.Tensor):
                raise _name("record_usage", "tensors", t, "tensors only")
        self._recorded.add(s)
        for t in items:
            st = t.untyped_storage()
            key = (str(st.device), st.data_ptr())
            row = self._usage.get(key)
            if row is None:
                cat = "parameter" if isinstance(t, torch.nn.Parameter) else "other"
                self._usage[key] = [s, s, int(st.nbytes()), cat]
            else:
                row[0] = min(row[0], s)
                row[1] = max(row[1], s)
                row[2] = max(row[2], int(st.nbytes()))
        self._cols = None
        self._peaks.clear()

    def _from_usage(self) -> _Columns:
        c = _Columns()
        rows = list(self._usage.items())
        n = len(rows)
        c.birth = np.fromiter((r[1][0] for r in rows), np.int64, n)
        c.death = np.fromiter((r[1][1] + 1 for r in rows), np.int64, n)
        c.nbytes = np.fromiter((r[1][2] for r in rows), np.int64, n)
        c.category = np.fromiter((_CAT_INDEX[r[1][3]] for r in rows), np.int16, n)
        c.device, c.devices = _table(np.array([r[0][0] for r in rows], dtype=object), str, None)
        c.site = c.region = c.module = np.full(n, -1, np.int32)
        c.backward = np.zeros(n, bool)
        c.step = c.birth.copy()
        return c

    # ---- reading the ring ------------------------------------------------------------------

    def _from_lord(self, lord: MemLord) -> _Columns:
        from ._events import EVENT_KINDS
        from ._sites import site_text

        alloc_k, free_k, reset_k = (EVENT_KINDS.index(k) for k in ("alloc", "free", "reset"))
        recs = lord.events()
        resets = np.flatnonzero(recs["kind"] == reset_k)
        if resets.size:
            recs = recs[int(resets[-1]) + 1 :]
        # contiguous copies of the columns read: indexing a field of a structured array
        # strides over 64-byte records
        col = {f: np.ascontiguousarray(recs[f]) for f in ("kind", "address", "device", "t_ns")}
        cat = recs["category"].astype(np.int16)
        kind, addr, dev, t = col["kind"], col["address"], col["device"], col["t_ns"]
        one = (recs["count"] == 1) & (addr != 0)
        alloc = (kind == alloc_k) & one
        free = (kind == free_k) & one
        idx = np.flatnonzero(alloc | free)
        # lexsort is stable: within one address the events keep their order
        if idx.size and dev[idx].min() == dev[idx].max():
            order = idx[np.argsort(addr[idx], kind="stable")]
        else:
            order = idx[np.lexsort((addr[idx], dev[idx]))]
        a, b = order[:-1], order[1:]
        same = (dev[a] == dev[b]) & (addr[a] == addr[b])
        # an alloc dies at the next event of its address (its free; or, when the free was
        # not seen one by one, the next alloc there: the address was given back)
        nxt = np.full(order.shape[0], -1, np.int64)
        nxt[:-1] = np.where(same, b, -1)
        is_alloc = alloc[order]
        born = order[is_alloc]
        dies_at = nxt[is_alloc]
        death = np.where(dies_at >= 0, t[np.maximum(dies_at, 0)], ALIVE)
        # each storage under the category it ended with (a gradient made in backward is
        # a gradient): its free's, or for one still alive its category in the registry
        born_cat = cat[born]
        freed = dies_at >= 0
        freed &= free[np.maximum(dies_at, 0)]
        born_cat[freed] = cat[dies_at[freed]]
        # a free nothing before it was born of (the storage was born before the ring)
        prev = np.full(order.shape[0], -1, np.int64)
        prev[1:] = np.where(same, a, -1)
        orphan = order[~is_alloc & ((prev < 0) | ~alloc[np.maximum(prev, 0)])]
        life = recs["lifetime_ns"][orphan]
        start = int(t[0]) if recs.shape[0] else 0
        o_birth = np.where(life > 0, t[orphan] - life, start)

        # storages alive now that the ring never saw born (before recording started)
        extra: list[_LiveEntry] = []
        try:  # the registry outlives the hooks: its storages are still tracked
            live_now = lord._live(sys.maxsize, -(2**63))[2]
        except Exception:  # noqa: BLE001 - no registry: the ring alone
            live_now = []
        if live_now:
            now = {(e[0], e[2]): _CAT_INDEX.get(e[-1], 0) for e in live_now if e[2]}
            alive = np.flatnonzero(death == ALIVE)
            keys = zip(dev[born[alive]].tolist(), addr[born[alive]].tolist(), strict=True)
            for j, key in zip(alive.tolist(), keys, strict=True):
                cat_ix = now.pop(key, None)
                if cat_ix is not None:
                    born_cat[j] = cat_ix
            extra = [e for e in live_now if e[2] and (e[0], e[2]) in now]
        names = lord._region_names()

        c = _Columns()
        ne = len(extra)
        c.birth = np.concatenate(
            [t[born], o_birth, np.fromiter((e[3] for e in extra), np.int64, ne)]
        )
        c.death = np.concatenate([death, t[orphan], np.full(ne, ALIVE, np.int64)])
        c.nbytes = np.concatenate(
            [
                recs["bytes"][born],
                recs["bytes"][orphan],
                np.fromiter((e[1] for e in extra), np.int64, ne),
            ]
        )
        dev_codes = np.concatenate(
            [dev[born], dev[orphan], np.fromiter((e[0] for e in extra), np.uint32, ne)]
        )
        site_codes = np.concatenate(
            [
                recs["site"][born],
                np.zeros(orphan.shape[0], np.uint32),
                np.fromiter((e[4] for e in extra), np.uint32, ne),
            ]
        )
        region_codes = np.concatenate(
            [
                recs["region"][born],
                np.zeros(orphan.shape[0], np.uint32),
                np.fromiter((e[5] for e in extra), np.uint32, ne),
            ]
        )
        c.category = np.concatenate(
            [
                born_cat,
                cat[orphan],
                np.fromiter((_CAT_INDEX.get(e[-1], 0) for e in extra), np.int16, ne),
            ]
        ).astype(np.int16)
        c.device, c.devices = _table(dev_codes, lord._device_name, None)
        c.site, c.sites = _table(site_codes, lambda s: site_text(s) if s else None, None)
        c.region, c.regions = _table(
            region_codes, lambda r: (names[r] if 0 < r < len(names) else "") or None, None
        )
        # module: the region's name without " (backward)", if it names a module
        wanted = self._module_names
        mod_of: list[int] = []
        mods: dict[str, int] = {}
        back_of: list[bool] = []
        for r in c.regions:
            base = r.removesuffix(_BACKWARD)
            back_of.append(base != r)
            if wanted is not None and base not in wanted:
                mod_of.append(-1)
                continue
            mod_of.append(mods.setdefault(base, len(mods)))
        c.modules = list(mods)
        lut = np.array(mod_of + [-1], np.int32)
        c.module = lut[c.region]  # -1 indexes the trailing -1
        c.backward = np.array(back_of + [False], bool)[c.region]
        # steps: the k-th mark's step holds what was born after the previous mark
        marks = list(lord.__dict__.get("_step_marks", ()))
        numbers = np.array([m[0] for m in marks], np.int64)
        times = np.array([m[1] for m in marks], np.int64)
        self._marks = (numbers, times)
        c.step = self._step_of(c.birth)
        return c

    def _step_of(self, when: np.ndarray) -> np.ndarray:
        numbers, times = self._marks
        if self._unit == "step":
            same: np.ndarray = when.copy()  # typed: see report/_series.py's peak
            return same
        if not numbers.shape[0]:
            return np.zeros(when.shape[0], np.int64)
        lut = np.append(numbers, numbers[-1] + 1)
        steps: np.ndarray = lut[np.searchsorted(times, when, side="left")]
        return steps

    def _columns(self) -> _Columns:
        if self._cols is None:
            self._cols = self._from_usage()
        return self._cols

    def storages(self) -> dict[str, Any]:
        """Every storage, one row each, as NumPy columns: ``birth``, ``death`` (ns, or
        steps when fed by hand; ``ALIVE``, the int64 maximum, for one still alive),
        ``nbytes``, ``step`` (the step it was born in), and ``device``, ``site``,
        ``region``, ``module``, ``category`` as indices into the lists under
        ``"tables"`` (-1: none)."""
        c = self._columns()
        return {
            "birth": c.birth.copy(),
            "death": c.death.copy(),
            "nbytes": c.nbytes.copy(),
            "step": c.step.copy(),
            "device": c.device.copy(),
            "site": c.site.copy(),
            "region": c.region.copy(),
            "module": c.module.copy(),
            "category": c.category.copy(),
            "tables": {
                "device": list(c.devices),
                "site": list(c.sites),
                "region": list(c.regions),
                "module": list(c.modules),
                "category": list(CATEGORIES),
            },
        }

    # ---- windows -------------------------------------------------------------------------

    def _held_steps(self) -> list[int]:
        """Every step number the data holds: the ring's (births' steps and marks), or the
        steps given to record_usage."""
        c = self._columns()
        if self._unit == "step":
            return sorted(self._recorded)
        return sorted(set(np.unique(c.step).tolist()) | set(self._marks[0].tolist()))

    def _check_window(self, fname: str) -> None:
        """A window of step numbers (``steps=[...]``) must name steps the data holds: a
        ValueError naming the argument, the missing steps and the held ones otherwise."""
        w = self._window_arg
        if w is None or isinstance(w, int):
            return
        held = self._held_steps()
        have = set(held)
        missing = [k for k in w if k not in have]
        if not missing:
            return
        if fname == "LifetimeAnalyzer":
            raise ValueError(
                f"LifetimeAnalyzer(): argument 'steps' names steps the ring does not hold: "
                f"{missing}; it holds steps {held}"
            )
        raise ValueError(
            f"{fname}(): the window (argument 'steps' of LifetimeAnalyzer()) names steps "
            f"not recorded: {missing}; recorded steps: {held}"
        )

    def steps(self) -> list[int]:
        """The step numbers the analysis covers (births' steps in the window)."""
        got = self._held_steps()
        w = self._window_arg
        if w is None:
            return got
        if isinstance(w, int):
            numbers = self._marks[0]
            if self._unit == "ns" and numbers.shape[0]:
                keep = set(numbers[-w:].tolist())
            else:
                keep = set(got[-w:])
            return [s for s in got if s in keep]
        return [s for s in got if s in set(w)]

    def _span(self, steps: list[int]) -> tuple[int, int]:
        """The time range ``[t0, t1]`` of a set of steps."""
        c = self._columns()
        if self._unit == "step":
            return (min(steps), max(steps)) if steps else (0, -1)
        numbers, times = self._marks
        lo, hi = min(steps), max(steps)
        t0 = -(2**63)
        t1 = ALIVE
        if numbers.shape[0]:
            before = times[numbers < lo]
            if before.shape[0]:
                t0 = int(before[-1]) + 1
            at = times[numbers >= hi]
            if at.shape[0]:
                t1 = int(at[0])
        if not len(c):
            return t0, t1
        return t0, t1

    def _window(self, step: int | None, fname: str) -> tuple[int, int, list[int]]:
        self._check_window(fname)
        covered = self.steps()
        steps = covered if step is None else [step]
        if step is not None and step not in covered:
            raise ValueError(
                f"{fname}(): argument 'step' is not a step of this analysis: {step}; "
                f"its steps: {covered}"
            )
        t0, t1 = self._span(steps) if steps else (0, -1)
        return t0, t1, steps

    # ---- the peak --------------------------------------------------------------------------

    def _peak(self, step: int | None, device: Any, fname: str) -> tuple[int, int, int, np.ndarray]:
        """(device index, peak time, peak bytes, mask of storages live then)."""
        if device is not None:
            device = _device_name(device)
        key = (step, device)
        got = self._peaks.get(key)
        if got is None:
            got = self._peaks[key] = self._find_peak(step, device, fname)
        return got

    def _find_peak(
        self, step: int | None, device: Any, fname: str
    ) -> tuple[int, int, int, np.ndarray]:
        c = self._columns()
        t0, t1, _steps = self._window(step, fname)
        best = (-1, 0, -1, np.zeros(len(c), bool))
        devs: Sequence[int] = range(len(c.devices))
        if device is not None:
            name = _device_name(device)
            if name not in c.devices:
                raise ValueError(
                    f"{fname}(): argument 'device' has no storage in this analysis: {name!r}"
                )
            devs = [c.devices.index(name)]
        for d in devs:
            on = c.device == d
            birth, death, nbytes = c.birth[on], c.death[on], c.nbytes[on]
            # one int64 key per end: time * 2, + 1 for a birth (a death sorts first at
            # the same moment); "alive" clipped so that it doubles without overflow
            key = np.concatenate([np.minimum(death, _CLIP) * 2, birth * 2 + 1])
            order = np.argsort(key)
            sorted_key = key[order]
            level = np.cumsum(np.concatenate([-nbytes, nbytes])[order])
            tt = sorted_key >> 1
            cand = (sorted_key & 1).astype(bool) & (tt >= t0) & (tt <= t1)
            if not cand.any():
                # nothing born in the window: the level at its start
                before = tt < t0
                k = int(np.flatnonzero(before)[-1]) if before.any() else -1
                value, when = (int(level[k]) if k >= 0 else 0), t0
            else:
                masked = np.where(cand, level, np.iinfo(np.int64).min)
                k = int(np.argmax(masked))
                value, when = int(level[k]), int(tt[k])
            if value > best[2]:
                live = on & (c.birth <= when) & (c.death > when)
                best = (d, when, value, live)
        return best

    def peak_composition(self, step: int | None = None, *, device: Any = None) -> dict[str, Any]:
        """What was live at the peak moment of the window (or of ``step``) on the device
        with the highest peak (or ``device``): ``{"device", "time", "step", "bytes",
        "count", "by_category", "by_module", "by_region", "by_site"}``, each ``by_*`` a
        dict of bytes, largest first (``None`` for storages without a module, region or
        site)."""
        s = _step_arg("peak_composition", step)
        c = self._columns()
        d, when, value, live = self._peak(s, device, "peak_composition")
        if d < 0:
            return {
                "device": None,
                "time": None,
                "step": s,
                "bytes": 0,
                "count": 0,
                "by_category": {},
                "by_module": {},
                "by_region": {},
                "by_site": {},
            }
        nb = c.nbytes[live]

        def by(codes: np.ndarray, names: list[str]) -> dict[Any, int]:
            sums = np.bincount(codes[live] + 1, weights=nb, minlength=len(names) + 1)
            pairs = [
                (names[i - 1] if i else None, int(v)) for i, v in enumerate(sums.tolist()) if v
            ]
            pairs.sort(key=lambda kv: (-kv[1], str(kv[0])))
            return dict(pairs)

        cats = by(c.category.astype(np.int32), list(CATEGORIES))
        return {
            "device": c.devices[d],
            "time": when,
            "step": int(self._step_of(np.array([when], np.int64))[0]),
            "bytes": int(nb.sum()),
            "count": int(live.sum()),
            "by_category": {k: v for k, v in cats.items() if k is not None},
            "by_module": by(c.module, c.modules),
            "by_region": by(c.region, c.regions),
            "by_site": by(c.site, c.sites),
        }

    # ---- the reuse plan ----------------------------------------------------------------------

    def compute_reuse_plan(self, step: int | None = None, *, device: Any = None) -> ReusePlan:
        """The storages born and dead inside the window (or ``step``) on the peak device
        (or ``device``), assigned to shared buffers whose members' lifetimes do not
        overlap (:func:`assign_buffers`)."""
        s = _step_arg("compute_reuse_plan", step)
        t0, t1, _ = self._window(s, "compute_reuse_plan")
        d = self._peak(s, device, "compute_reuse_plan")[0]
        return self._plan(t0, t1, d, device)

    def _plan(self, t0: int, t1: int, d: int, device: Any = None) -> ReusePlan:
        c = self._columns()
        if d < 0:
            empty = {k: np.empty(0, np.int64) for k in ("birth", "death", "nbytes", "site")}
            return ReusePlan(
                str(device or "cpu"), empty, np.empty(0, np.int64), np.empty(0, np.int64)
            )
        inside = (c.device == d) & (c.birth >= t0) & (c.death <= t1) & (c.death != ALIVE)
        storages = {
            "birth": c.birth[inside],
            "death": c.death[inside],
            "nbytes": c.nbytes[inside],
            "site": c.site[inside],
        }
        buffer_of, sizes = assign_buffers(storages["birth"], storages["death"], storages["nbytes"])
        return ReusePlan(c.devices[d], storages, buffer_of, sizes)

    # ---- suggestions ---------------------------------------------------------------------

    def get_optimization_suggestions(
        self, step: int | None = None, *, device: Any = None
    ) -> dict[str, Any]:
        """``{"reusable_bytes", "peak_bytes", "device", "step", "suggestions"}``:
        ``reusable_bytes`` what the reuse plan of the peak's step saves, ``suggestions`` a
        list ranked by bytes, each ``{"kind", "target", "bytes", "evidence", "text"}``
        with ``kind`` one of ``"checkpoint"`` (a module's saved activations),
        ``"preallocate"`` (same-size storages made and freed at one site every step),
        ``"free_earlier"`` (storages from an earlier step alive across the peak),
        ``"offload_optimizer"`` (the optimizer state's share of the peak)."""
        s = _step_arg("get_optimization_suggestions", step)
        c = self._columns()
        d, when, peak, live = self._peak(s, device, "get_optimization_suggestions")
        if d < 0:
            return {
                "reusable_bytes": 0,
                "peak_bytes": 0,
                "device": None,
                "step": s,
                "suggestions": [],
            }
        peak_step = int(self._step_of(np.array([when], np.int64))[0])
        pt0, pt1, _ = self._window(peak_step if s is None else s, "get_optimization_suggestions")
        plan = self._plan(pt0, pt1, d)
        out: list[dict[str, Any]] = []
        share = (lambda b: b / peak) if peak else (lambda b: 0.0)

        # activation checkpointing: a module's forward activations alive at the peak
        act = live & (c.category == _CAT_INDEX["activation"]) & (c.module >= 0) & ~c.backward
        if act.any():
            mods = c.module[act]
            nb = c.nbytes[act]
            births = c.birth[act]
            total = np.bincount(mods, weights=nb, minlength=len(c.modules))
            count = np.bincount(mods, minlength=len(c.modules))
            # its output, the last-born of its live activations, stays (the next module
            # holds it); the rest is what recomputing in backward saves
            order = np.lexsort((births, mods))
            last = order[np.r_[mods[order][1:] != mods[order][:-1], True]]
            output = np.zeros(len(c.modules))
            output[mods[last]] = nb[last]
            saves = total - output
            for m in np.argsort(-saves)[:TOP].tolist():
                if saves[m] <= 0:
                    continue
                b = int(saves[m])
                out.append(
                    {
                        "kind": "checkpoint",
                        "target": c.modules[m],
                        "bytes": b,
                        "evidence": {
                            "activation_bytes_at_peak": int(total[m]),
                            "storages": int(count[m]),
                            "output_bytes": int(output[m]),
                            "share_of_peak": share(int(total[m])),
                        },
                        "text": (
                            f"checkpoint {c.modules[m]}: its {int(count[m])} saved activations "
                            f"hold {human_bytes(int(total[m]))} at the peak "
                            f"({share(int(total[m])):.0%}); recomputing them in backward "
                            f"saves about {human_bytes(b)}"
                        ),
                    }
                )

        # preallocate: same-size storages born and freed at one site in every step
        t0, t1, steps = self._window(s, "get_optimization_suggestions")
        inside = (
            (c.device == d) & (c.site >= 0) & (c.death != ALIVE) & (c.birth >= t0) & (c.death <= t1)
        )
        inside &= c.step == self._step_of(c.death)  # freed within the step it was born in
        full_steps = [k for k in steps if self._unit == "step" or k in set(self._marks[0].tolist())]
        if inside.any() and len(full_steps) >= 2:
            # one int64 key per (site, size, step): each factorised, then combined
            site_i = c.site[inside].astype(np.int64)
            sizes, size_i = np.unique(c.nbytes[inside], return_inverse=True)
            step_u, step_i = np.unique(c.step[inside], return_inverse=True)
            nsz, nst = len(sizes), len(step_u)
            key = (site_i * nsz + size_i.reshape(-1)) * nst + step_i.reshape(-1)
            per, g, counts = np.unique(key, return_inverse=True, return_counts=True)
            g = g.reshape(-1)
            # the most storages of one (site, size) alive at once within a step: the
            # buffers a preallocation keeps (each group's births and deaths balance, so
            # the running count starts each group at 0; a death sorts before a birth at
            # the same moment)
            m = g.shape[0]
            ends = np.concatenate([c.death[inside] * 2, c.birth[inside] * 2 + 1])
            delta = np.concatenate([-np.ones(m, np.int64), np.ones(m, np.int64)])
            gg = np.concatenate([g, g])
            order = np.lexsort((ends, gg))
            level = np.cumsum(delta[order])
            starts = np.flatnonzero(np.r_[True, gg[order][1:] != gg[order][:-1]])
            overlap = np.maximum.reduceat(level, starts)
            ok = np.isin(step_u[per % nst], full_steps)
            per, counts, overlap = per[ok], counts[ok], overlap[ok]
            if per.shape[0]:
                pair_key, inv = np.unique(per // nst, return_inverse=True)
                inv = inv.reshape(-1)
                pair = np.stack([pair_key // nsz, sizes[pair_key % nsz]], 1)
                nsteps = np.bincount(inv, minlength=pair.shape[0])
                most = np.zeros(pair.shape[0], np.int64)
                np.maximum.at(most, inv, overlap)
                allocs = np.bincount(inv, weights=counts, minlength=pair.shape[0])
                every = np.flatnonzero(nsteps >= len(full_steps))
                kept = pair[every, 1] * most[every]
                for j in every[np.argsort(-kept)][:TOP].tolist():
                    site, size = c.sites[int(pair[j, 0])], int(pair[j, 1])
                    b = size * int(most[j])
                    out.append(
                        {
                            "kind": "preallocate",
                            "target": site,
                            "bytes": b,
                            "evidence": {
                                "nbytes": size,
                                "per_step": int(most[j]),
                                "steps": int(nsteps[j]),
                                "allocations": int(allocs[j]),
                            },
                            "text": (
                                f"preallocate at {site}: {int(allocs[j])} storages of "
                                f"{human_bytes(size)} made and freed there over "
                                f"{int(nsteps[j])} steps; {int(most[j])} reused buffer(s) "
                                f"({human_bytes(b)}) would serve them"
                            ),
                        }
                    )

        # free earlier: non-state storages from an earlier step alive across the peak
        state = np.array([_CAT_INDEX[k] for k in _STATE], np.int16)
        held = live & ~np.isin(c.category, state) & (c.step < peak_step)
        if held.any():
            sites = c.site[held] + 1
            sums = np.bincount(sites, weights=c.nbytes[held], minlength=len(c.sites) + 1)
            cnt = np.bincount(sites, minlength=len(c.sites) + 1)
            for i in np.argsort(-sums)[:TOP].tolist():
                if sums[i] <= 0:
                    continue
                b = int(sums[i])
                target = c.sites[i - 1] if i else None
                out.append(
                    {
                        "kind": "free_earlier",
                        "target": target,
                        "bytes": b,
                        "evidence": {"storages": int(cnt[i]), "share_of_peak": share(b)},
                        "text": (
                            f"free earlier: {int(cnt[i])} storage(s) made at "
                            f"{target or 'an unknown site'} in an earlier step are still "
                            f"alive at the peak ({human_bytes(b)})"
                        ),
                    }
                )

        # optimizer state: an offload candidate
        opt = live & (c.category == _CAT_INDEX["optimizer_state"])
        if opt.any():
            b = int(c.nbytes[opt].sum())
            out.append(
                {
                    "kind": "offload_optimizer",
                    "target": "optimizer state",
                    "bytes": b,
                    "evidence": {"storages": int(opt.sum()), "share_of_peak": share(b)},
                    "text": (
                        f"optimizer state is {human_bytes(b)} of the peak ({share(b):.0%}): "
                        "offload it (CPU offload, a sharded or 8-bit optimizer)"
                    ),
                }
            )
        out.sort(key=lambda e: -e["bytes"])
        return {
            "reusable_bytes": plan.saved_bytes,
            "peak_bytes": peak,
            "device": c.devices[d],
            "step": peak_step,
            "suggestions": out,
        }

    def __repr__(self) -> str:
        c = self._columns()
        src = "lord" if self._lord is not None else "record_usage"
        return f"LifetimeAnalyzer(storages={len(c)}, steps={len(self.steps())}, source={src})"
