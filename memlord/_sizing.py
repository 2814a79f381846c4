"""Predict a step's peak from a few measured batch sizes, and the largest batch that fits.

``fit_memory(step, batch_sizes)`` runs ``step(n)`` for each size under a private lord
(lifetime tracking with ``ops=True``), measures each device's peak of live bytes (the
storages it saw, plus the live tensors it did not track, found by a scan of the objects
the cyclic GC knows: the model's parameters made before), and fits ``fixed + linear * n
(+ quadratic * n**2)`` by least squares, per device and per category.  On CUDA it also
fits the allocator's reserved peak (``torch.cuda.max_memory_reserved``), which includes
its rounding and fragmentation.

``find_batch_size(step, start)`` fits, predicts the largest batch within the device's
budget, and confirms it with a real step, shrinking only when that step runs out of
memory (handled outside the ``except`` frame, so the failed step's tensors can go).
"""

from __future__ import annotations

import gc
import math
import operator
import os
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
import torch

from ._bytes import human_bytes
from ._core import CATEGORIES
from ._errors import type_name

__all__ = ["MemoryFit", "find_batch_size", "fit_memory"]

#: The terms a fit may use, in the order of the design matrix's columns.
TERMS = ("fixed", "linear", "quadratic")
#: The public names of the terms' coefficients.
_FIELD = {"fixed": "fixed_bytes", "linear": "per_sample_bytes", "quadratic": "quadratic_bytes"}
#: How find_batch_size shrinks a batch that ran out of memory (accelerate's factor).
SHRINK = 0.9
#: The most cyclic GC passes before a measured step (see :func:`_collect_garbage`).
MAX_COLLECTIONS = 100


# ---- argument checks -------------------------------------------------------------------


def _check_step(fname: str, step: Any) -> Callable[[int], Any]:
    if not callable(step):
        raise TypeError(
            f"{fname}(): argument 'step' must be a callable taking the batch size, "
            f"not {type_name(step)}"
        )
    return cast("Callable[[int], Any]", step)


def _check_size(fname: str, name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{fname}(): argument '{name}' must be an int, not bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{fname}(): argument '{name}' must be an int, not {type_name(value)}"
        ) from None
    if n < low:
        raise ValueError(f"{fname}(): argument '{name}' must be >= {low}, not {n}")
    return n


def _check_terms(fname: str, terms: Any) -> tuple[str, ...]:
    if isinstance(terms, str) or not isinstance(terms, Iterable):
        raise TypeError(
            f"{fname}(): argument 'terms' must be a tuple of {TERMS}, not {type_name(terms)}"
        )
    got = tuple(terms)
    bad = [t for t in got if t not in TERMS]
    if bad or not got or len(set(got)) != len(got):
        raise ValueError(
            f"{fname}(): argument 'terms' must name distinct terms among {TERMS}, not {got!r}"
        )
    return tuple(t for t in TERMS if t in got)


def _check_sizes(fname: str, sizes: Any, need: int) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(
            f"{fname}(): argument 'batch_sizes' must be a sequence of ints, not {type_name(sizes)}"
        )
    got = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise TypeError(f"{fname}(): argument 'batch_sizes' must hold ints, not {type_name(s)}")
        got.append(int(s))
    bad = [s for s in got if s < 1]
    if bad:
        raise ValueError(
            f"{fname}(): argument 'batch_sizes' must hold positive sizes, not {bad[0]}"
        )
    if len(set(got)) != len(got):
        dup = next(s for s in got if got.count(s) > 1)
        raise ValueError(f"{fname}(): argument 'batch_sizes' holds {dup} twice")
    if len(got) < need:
        raise ValueError(
            f"{fname}(): argument 'batch_sizes' needs at least {need} distinct sizes for "
            f"the terms asked, not {len(got)}"
        )
    return tuple(got)


def _check_device(fname: str, device: Any) -> str | None:
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{fname}(): argument 'device' must be a str or torch.device, not {type_name(device)}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"{fname}(): argument 'device' is not a device: {device!r}") from None
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device() if _cuda_ready() else 0)
    elif dev.type == "cpu":
        # torch has one CPU device: "cpu:0" is where torch.empty(device="cpu:0") lives
        # and what memlord's ledger counts as "cpu"
        dev = torch.device("cpu")
    return str(dev)


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _note(error: BaseException, text: str) -> None:
    add = getattr(error, "add_note", None)
    if add is not None:  # Python 3.11+
        add(text)


# ---- measuring one step ------------------------------------------------------------------


class _Sample:
    """One device's peak during one step: live bytes, their categories, and on CUDA the
    allocator's reserved and allocated peaks."""

    __slots__ = ("categories", "live", "reserved", "torch_allocated")

    def __init__(self) -> None:
        self.live = 0
        self.categories: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.reserved: int | None = None
        self.torch_allocated: int | None = None


def _adopt_untracked(lord: Any) -> None:
    """Track the live tensors' storages ``lord`` does not track yet (found by a scan of
    the objects the cyclic GC knows: the model's parameters and whatever was made before
    the lord), so that their bytes count in its peaks and their deaths are credited;
    parameters, their gradients and the state of live optimizers under their categories,
    the rest as ``other``."""
    from ._core import _gc_objects_of
    from ._ops import _categorize
    from ._snapshot import _live_tensors, _skipped

    found, params, grads = [], [], []
    for t in _live_tensors():
        try:
            if _skipped(t) or lord._tracks_storage(t.untyped_storage()):
                continue
        except Exception:  # noqa: BLE001 - a tensor without a readable storage
            continue
        found.append(t)
        if isinstance(t, torch.nn.Parameter):
            params.append(t)
            if t.grad is not None:
                grads.append(t.grad)
    if not found:
        return
    try:
        lord.allocate(found)
    except (TypeError, ValueError):
        # one tensor memlord cannot read (an invalid storage another library left
        # behind) fails the whole call, which changes nothing: count the others
        for t in found:
            try:
                lord.allocate(t)
            except (TypeError, ValueError):
                pass
    if params:
        _categorize(params, "parameter", None)
    if grads:
        _categorize(grads, "gradient", None)
    state = [
        v
        for opt in _gc_objects_of(gc.get_objects, torch.optim.Optimizer, ())
        for per_param in getattr(opt, "state", {}).values()
        if isinstance(per_param, dict)
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    ]
    if state:
        _categorize(state, "optimizer_state", None)
    del found, params, grads, state


def _measure(
    step: Callable[[int], Any], sizes: Iterable[int], warmup: int
) -> list[dict[str, _Sample]]:
    """Run ``warmup`` steps of the first size, then one step of each size, under a fresh
    lord with lifetime tracking and operator outputs; return one ``{device: _Sample}``
    per size.  Everything installed is taken off again, whatever the step does."""
    from .lord import MemLord

    sizes = list(sizes)
    lord = MemLord(auto_gc_bytes=None)
    hooks = lord.hook_into_python(ops=True)
    out = []
    base: dict[str, dict[str, int]] | None = None
    try:
        _adopt_untracked(lord)
        for _ in range(warmup):
            _run(step, sizes[0], "warm-up")
        for n in sizes:
            _collect_garbage(lord)
            cuda = _cuda_ready()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                for i in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(i)
            _adopt_untracked(lord)
            lord._reset_peak(None)
            at_start = {d: st["categories"] for d, st in lord.stats().items()}
            if base is None:
                # what was live before the first measured step stands for every step:
                # what dies between steps (the previous step's leftovers, other code's
                # garbage) moves no size's figure; what the step itself frees does
                base = at_start
            _run(step, n, "measured")
            if cuda:
                torch.cuda.synchronize()
            stats = lord.stats()
            samples: dict[str, _Sample] = {}
            for dev in sorted(set(stats) | set(base)):
                s = samples[dev] = _Sample()
                peak = stats[dev]["peak_categories"] if dev in stats else {}
                for c in CATEGORIES:
                    before = at_start.get(dev, {}).get(c, 0)
                    s.categories[c] = base.get(dev, {}).get(c, 0) + peak.get(c, 0) - before
                s.live = sum(s.categories.values())
                if cuda and dev.startswith("cuda"):
                    i = torch.device(dev).index or 0
                    s.reserved = int(torch.cuda.max_memory_reserved(i))
                    s.torch_allocated = int(torch.cuda.max_memory_allocated(i))
            out.append(samples)
    finally:
        hooks.disable()
        del lord
    return out


def _collect_garbage(lord: Any) -> None:
    """Run the cyclic GC until a pass frees no storage ``lord`` tracks (every live
    tensor is tracked by now: made under its hooks or adopted), at most
    ``MAX_COLLECTIONS`` passes.  One pass can leave garbage that only the next frees:
    objects that garbage refers to where the collector cannot see (from C++: torch's
    MemTracker leaves a model's tensors so, one module's per pass).  Left for a later
    pass, they counted in the first measured step's live bytes, and so in every size's
    figure and ``fixed_bytes``, but not in a later ``validate()``."""
    for _ in range(MAX_COLLECTIONS):
        before = lord.freed()[0]
        gc.collect()
        if lord.freed()[0] == before:
            return


def _run(step: Callable[[int], Any], n: int, what: str) -> None:
    try:
        step(n)
    except BaseException as e:
        _note(e, f"memlord: the {what} step raised at batch_size={n}")
        raise


# ---- the fit ---------------------------------------------------------------------------------


def _design(terms: tuple[str, ...], n: Any) -> np.ndarray:
    x = np.asarray(n, dtype=np.float64)
    cols = {"fixed": np.ones_like(x), "linear": x, "quadratic": x * x}
    return np.stack([cols[t] for t in terms], axis=-1)


def _lstsq(terms: tuple[str, ...], sizes: tuple[int, ...], y: np.ndarray) -> np.ndarray:
    """Coefficients (one column per series of ``y``) of the terms, by least squares over
    columns scaled to unit size (sizes**2 and 1 differ by orders of magnitude)."""
    a = _design(terms, sizes)
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef, *_ = np.linalg.lstsq(a / scale, y, rcond=None)
    return cast(np.ndarray, coef / scale.reshape((-1,) + (1,) * (coef.ndim - 1)))


class MemoryFit:
    """What ``fit_memory`` measured and fitted: per device, ``fixed + per_sample * n (+
    quadratic * n**2)`` bytes of live memory at the step's peak, split by category."""

    def __init__(
        self,
        step: Callable[[int], Any],
        sizes: tuple[int, ...],
        terms: tuple[str, ...],
        samples: list[dict[str, _Sample]],
        device: str | None,
    ) -> None:
        self._step = step
        self.batch_sizes = sizes
        self.terms = terms
        devices = sorted(set().union(*samples))
        if device is not None and device not in devices:
            devices.append(device)  # nothing was measured there: all zeros
        if not devices:
            devices.append("cpu")  # the step allocated nothing anywhere
        self.devices = tuple(devices)
        self.measured: dict[str, tuple[int, ...]] = {
            d: tuple(s[d].live if d in s else 0 for s in samples) for d in devices
        }
        self.reserved_measured: dict[str, tuple[int, ...]] = {
            d: tuple(int(s[d].reserved or 0) if d in s else 0 for s in samples)
            for d in devices
            if any(d in s and s[d].reserved is not None for s in samples)
        }
        if device is None:
            cuda = [d for d in devices if d.startswith("cuda")]
            pool = cuda or devices
            device = max(pool, key=lambda d: (self.measured[d][-1], d)) if pool else "cpu"
        self.device = device
        self._coef: dict[str, np.ndarray] = {}
        self._cat_coef: dict[str, np.ndarray] = {}
        self._reserved_coef: dict[str, np.ndarray] = {}
        for d in devices:
            y = np.array(self.measured[d], dtype=np.float64)
            self._coef[d] = _lstsq(terms, sizes, y)
            cats = np.array(
                [[s[d].categories[c] if d in s else 0 for c in CATEGORIES] for s in samples],
                dtype=np.float64,
            )
            self._cat_coef[d] = _lstsq(terms, sizes, cats)
            if d in self.reserved_measured:
                r = np.array(self.reserved_measured[d], dtype=np.float64)
                self._reserved_coef[d] = _lstsq(terms, sizes, r)

    # ---- per term ----------------------------------------------------------------------

    def _term(self, term: str, device: str | None = None) -> float:
        d = self.device if device is None else device
        return float(self._coef[d][self.terms.index(term)]) if term in self.terms else 0.0

    @property
    def fixed_bytes(self) -> float:
        """Bytes that do not depend on the batch size (the main device)."""
        return self._term("fixed")

    @property
    def per_sample_bytes(self) -> float:
        """Bytes per sample of the batch (the linear term; the main device)."""
        return self._term("linear")

    @property
    def quadratic_bytes(self) -> float:
        """Bytes per sample squared (the quadratic term, 0 without it; the main device)."""
        return self._term("quadratic")

    @property
    def residuals(self) -> tuple[float, ...]:
        """Measured minus fitted live bytes at each batch size (the main device)."""
        d = self.device
        fitted = _design(self.terms, self.batch_sizes) @ self._coef[d]
        return tuple(float(m - f) for m, f in zip(self.measured[d], fitted, strict=True))

    def categories(self, device: Any = None) -> dict[str, dict[str, float]]:
        """Each term split by category: ``{"fixed": {category: bytes}, "per_sample":
        {...}, "quadratic": {...}}``, only categories with a non-negligible share."""
        d = self._device("categories", device)
        out: dict[str, dict[str, float]] = {}
        for k, term in enumerate(self.terms):
            row = self._cat_coef[d][k]
            key = _FIELD[term].removesuffix("_bytes")
            out[key] = {c: float(v) for c, v in zip(CATEGORIES, row, strict=True) if abs(v) >= 0.5}
        return out

    def _device(self, fname: str, device: Any) -> str:
        d = _check_device(fname, device)
        if d is None:
            return self.device
        if d not in self._coef:
            raise ValueError(
                f"{fname}(): argument 'device' was not measured: {d!r} (measured: "
                f"{', '.join(self.devices)})"
            )
        return d

    # ---- predictions ---------------------------------------------------------------------

    def _predict(self, n: float, d: str, reserved: bool = True) -> float:
        x = _design(self.terms, n)
        live = float(x @ self._coef[d])
        if reserved and d in self._reserved_coef:
            return max(live, float(x @ self._reserved_coef[d]))
        return live

    def predict(self, batch_size: int, device: Any = None) -> int:
        """The peak bytes a step of ``batch_size`` needs on ``device`` (default: the main
        device): live bytes; on CUDA the allocator's reserved bytes as fitted (its
        rounding and fragmentation included) when they are more."""
        n = _check_size("predict", "batch_size", batch_size)
        d = self._device("predict", device)
        return max(0, math.ceil(round(self._predict(n, d), 3)))

    def max_batch_size(
        self, budget: int | None = None, *, headroom: float = 0.05, device: Any = None
    ) -> int:
        """The largest batch size whose predicted peak stays within ``budget * (1 -
        headroom)`` bytes on ``device`` (default: the main device); ``budget`` defaults to
        what the device can give (CUDA: the driver's free memory plus what this process's
        allocator reserves, capped by ``set_per_process_memory_fraction``; cpu:
        ``MemTotal``).  0 when not even one sample fits."""
        d = self._device("max_batch_size", device)
        if budget is None:
            budget = device_budget(d)
        else:
            budget = _check_size("max_batch_size", "budget", budget, 0)
        limit = budget * (1.0 - _check_headroom("max_batch_size", headroom))

        def fits(n: int) -> bool:
            return round(self._predict(n, d), 3) <= limit

        if not fits(1):
            return 0
        lo, hi = 1, 2
        while fits(hi):
            lo, hi = hi, hi * 2
            if hi > 2**48:
                raise ValueError(
                    f"max_batch_size(): the fitted peak on {d} does not grow with the batch "
                    "size: no largest batch"
                )
        while hi - lo > 1:  # fits(lo), not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def validate(self, batch_size: int) -> float:
        """Run one real step of ``batch_size`` and return the relative error of the
        prediction for the main device, ``(predicted - measured) / measured`` (the
        reserved bytes on CUDA, the live bytes elsewhere)."""
        n = _check_size("validate", "batch_size", batch_size)
        sample = _measure(self._step, [n], 0)[0].get(self.device)
        if sample is None:
            raise RuntimeError(f"validate(): the step allocated nothing on {self.device}")
        d = self.device
        if d in self._reserved_coef and sample.reserved is not None:
            measured = float(max(sample.reserved, sample.live))
        else:
            measured = float(sample.live)
        return (self._predict(n, d) - measured) / measured if measured else 0.0

    # ---- text ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        q = f", quadratic_bytes={self.quadratic_bytes:.1f}" if "quadratic" in self.terms else ""
        return (
            f"MemoryFit(device={self.device!r}, fixed_bytes={self.fixed_bytes:.0f}, "
            f"per_sample_bytes={self.per_sample_bytes:.1f}{q}, "
            f"batch_sizes={self.batch_sizes})"
        )

    def summary(self) -> str:
        """A few lines: the terms with their categories, the residuals and a few
        predictions."""
        d = self.device
        sizes = ", ".join(map(str, self.batch_sizes))
        lines = [f"memlord memory fit on {d} (batch sizes {sizes}; terms {', '.join(self.terms)})"]
        cats = self.categories()
        labels = {"fixed": "fixed", "per_sample": "per sample", "quadratic": "per sample^2"}
        for term in self.terms:
            key = _FIELD[term].removesuffix("_bytes")
            value = self._term(term)
            split = sorted(cats.get(key, {}).items(), key=lambda kv: -abs(kv[1]))
            parts = ", ".join(f"{c} {human_bytes(v)}" for c, v in split[:4] if abs(v) >= 1)
            lines.append(f"  {labels[key]:<13} {human_bytes(value):>12}   {parts}")
        res = self.residuals
        worst = max(
            (abs(r) / m for r, m in zip(res, self.measured[d], strict=True) if m), default=0.0
        )
        lines.append(
            "  residuals     " + ", ".join(human_bytes(r) for r in res) + f" (max {worst:.2%})"
        )
        top = max(self.batch_sizes)
        preds = ", ".join(f"{n}: {human_bytes(self.predict(n))}" for n in (top * 2, top * 4))
        lines.append(f"  predicted     {preds}")
        return "\n".join(lines)


# ---- budgets -------------------------------------------------------------------------------


def _mem_total() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_budget(device: str) -> int:
    """What ``device`` can give this process: on CUDA the driver's free memory plus what
    torch's allocator already reserves here, capped by the per-process memory fraction;
    on the CPU ``MemTotal``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        i = dev.index or 0
        free, total = torch.cuda.mem_get_info(i)
        budget = int(free) + int(torch.cuda.memory_reserved(i))
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            frac = float(fraction(i))
            if frac < 1.0:
                budget = min(budget, int(frac * total))
        return budget
    return _mem_total()


# ---- the public functions ------------------------------------------------------------------


def fit_memory(
    step: Callable[[int], Any],
    batch_sizes: Iterable[int] = (2, 4, 8),
    *,
    device: Any = None,
    warmup: int = 1,
    terms: Iterable[str] = ("fixed", "linear"),
) -> MemoryFit:
    """Run ``step(n)`` for each of ``batch_sizes`` (after ``warmup`` runs of the first),
    measure each device's peak of live bytes, and fit ``fixed + per_sample * n`` (plus
    ``quadratic * n**2`` with ``terms=("fixed", "linear", "quadratic")``).  See
    docs/sizing.md."""
    step = _check_step("fit_memory", step)
    terms = _check_terms("fit_memory", terms)
    sizes = _check_sizes("fit_memory", batch_sizes, max(2, len(terms)))
    dev = _check_device("fit_memory", device)
    warmup = _check_size("fit_memory", "warmup", warmup, 0)
    samples = _measure(step, sizes, warmup)
    return MemoryFit(step, sizes, terms, samples, dev)


def _shrunk(n: int) -> int:
    """The next batch size after ``n`` ran out of memory: 10% smaller, at least 1 less."""
    return min(n - 1, int(n * SHRINK))


def _confirm(step: Callable[[int], Any], n: int) -> int:
    """Run ``step(n)``, and on out-of-memory errors ``step`` of ever smaller sizes
    (:func:`_shrunk`) down to 1, through ``memlord.retry_on_oom``: each retry runs after
    the failed step's ``except`` block has ended, its traceback dropped, deferred frees
    credited, the garbage collected and CUDA's cache emptied.  Returns the size that
    ran.  Any other error passes through with the batch size in its notes."""
    from ._oom import is_oom, retry_on_oom

    ladder = [n]
    while ladder[-1] > 1:
        ladder.append(_shrunk(ladder[-1]))
    tried: list[int] = []

    def attempt(k: int) -> None:
        tried.append(k)
        try:
            step(k)
        except BaseException as e:
            if not is_oom(e):
                _note(e, f"memlord: the step raised at batch_size={k}")
            raise

    try:
        retry_on_oom(
            attempt,
            n,
            attempts=len(ladder),
            backoff=0.0,
            max_backoff=0.0,
            shrink=lambda args, kwargs: ((_shrunk(args[0]),), kwargs),
        )
    except BaseException as e:
        if is_oom(e):
            _note(e, f"memlord: find_batch_size ran out of memory down to batch_size={tried[-1]}")
        raise
    return tried[-1]


def _check_headroom(fn: str, headroom: Any) -> float:
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"{fn}(): argument 'headroom' must be a float, not {type_name(headroom)}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"{fn}(): argument 'headroom' must be in [0, 1), not {headroom}")
    return float(headroom)


def find_batch_size(
    step: Callable[[int], Any],
    start: int,
    *,
    device: Any = None,
    batch_sizes: Iterable[int] | None = None,
    budget: int | None = None,
    headroom: float = 0.05,
    warmup: int = 1,
) -> tuple[int, MemoryFit]:
    """The largest batch size up to ``start`` that fits: fitted on small sizes
    (``batch_sizes``, default the powers of two 1, 2, 4 up to ``start``), predicted with
    ``max_batch_size(budget, headroom=headroom)``, then confirmed with a real step;
    a step that runs out of memory shrinks the batch by 10% and tries again (through
    ``retry_on_oom``, outside the failed step's ``except`` frame).  Returns
    ``(batch_size, fit)``."""
    step = _check_step("find_batch_size", step)
    start = _check_size("find_batch_size", "start", start, 2 if batch_sizes is None else 1)
    if batch_sizes is None:
        batch_sizes = tuple(s for s in (1, 2, 4) if s <= start)
    sizes = _check_sizes("find_batch_size", batch_sizes, 2)
    # checked before any step runs (max_batch_size's ValueError below means "no bound")
    if budget is not None:
        budget = _check_size("find_batch_size", "budget", budget, 0)
    _check_headroom("find_batch_size", headroom)
    fit = fit_memory(step, sizes, device=device, warmup=warmup)
    try:
        n = max(1, min(start, fit.max_batch_size(budget, headroom=headroom, device=device)))
    except ValueError:  # the peak does not grow with the batch: nothing bounds it
        n = start
    return _confirm(step, n), fit
