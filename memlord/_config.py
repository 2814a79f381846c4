"""Validation of MemLord's configuration: the auto-GC byte threshold and the banded
strategy.  Everything here raises TypeError/ValueError naming the argument and the field,
and hands the C core plain values; nothing changes on the lord when it raises."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ._types import AutoGCMetric, AutoGCStrategy, AutoGCThreshold

METRICS: tuple[AutoGCMetric, ...] = ("allocated", "freed", "max")
MAX_BANDS = 1024
AUTO = -1  # what the core takes for auto_gc_bytes="auto"

DEFAULT_STRATEGY: AutoGCStrategy = {
    (0, 50): {"metric": "max", "threshold": {"percent": 60.0}},
    (50, 75): {"metric": "max", "threshold": {"percent": 50.0}},
    (75, 101): {"metric": "max", "threshold": {"percent": 40.0}},
}

# (lo, hi, lo_is_int, hi_is_int, metric index, bytes or -1, percent or -1.0)
Band = tuple[float, float, bool, bool, int, int, float]


def parse_bytes(value: object, arg: str = "auto_gc_bytes") -> int:
    """ "auto" -> AUTO, None -> 0 (off), an int >= 0 -> itself."""
    if value is None:
        return 0
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(
                f'argument {arg!r}: expected "auto", an int >= 0 or None, got {value!r}'
            )
        return AUTO
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f'argument {arg!r}: expected "auto", an int >= 0 or None, got {type(value).__name__}'
        )
    if value < 0:
        raise ValueError(f"argument {arg!r}: expected an int >= 0, got {value!r}")
    if value >= 2**63:
        raise ValueError(f"argument {arg!r}: {value!r} does not fit in 64 bits (max 2**63 - 1)")
    return int(value)


def _band_error(exc: type[Exception], key: object, msg: str) -> Exception:
    return exc(f"argument 'strategy': band {key!r}: {msg}")


def _is_number(o: object) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool)


def _number(key: object, field: str, o: object) -> float:
    if not _is_number(o):
        raise _band_error(
            TypeError, key, f"field {field!r}: expected a number, got {type(o).__name__}"
        )
    try:
        v = float(o)  # type: ignore[arg-type]
    except OverflowError:
        raise _band_error(ValueError, key, f"field {field!r}: {o!r} is out of range") from None
    if not math.isfinite(v):
        raise _band_error(ValueError, key, f"field {field!r}: expected a finite number, got {o!r}")
    return v


def _fmt_bound(v: float, is_int: bool) -> str:
    if is_int:
        return str(int(v))
    return repr(float(v))


def band_name(lo: float, lo_is_int: bool, hi: float, hi_is_int: bool) -> str:
    return f"[{_fmt_bound(lo, lo_is_int)}, {_fmt_bound(hi, hi_is_int)})"


def _parse_band(key: object, spec: object) -> Band:
    if not isinstance(key, tuple) or len(key) != 2:
        raise _band_error(
            TypeError, key, "field 'key': expected a (lo_pct, hi_pct) pair of numbers"
        )
    lo = _number(key, "key.lo_pct", key[0])
    hi = _number(key, "key.hi_pct", key[1])
    if not (0.0 <= lo < hi <= 101.0):
        raise _band_error(ValueError, key, "field 'key': expected 0 <= lo_pct < hi_pct <= 101")
    if not isinstance(spec, dict):
        raise _band_error(
            TypeError,
            key,
            "expected a dict {'metric': ..., 'threshold': {...}}, got " + type(spec).__name__,
        )
    metric = -1
    nbytes, percent = -1, -1.0
    has_threshold = False
    for k, x in list(spec.items()):
        if k == "metric" and isinstance(k, str):
            if not isinstance(x, str):
                raise _band_error(
                    TypeError,
                    key,
                    "field 'metric': expected 'allocated', 'freed' or 'max', got "
                    + type(x).__name__,
                )
            if x not in METRICS:
                raise _band_error(
                    ValueError,
                    key,
                    f"field 'metric': expected 'allocated', 'freed' or 'max', got {x!r}",
                )
            metric = METRICS.index(x)
        elif k == "threshold" and isinstance(k, str):
            has_threshold = True
            nbytes, percent = _parse_threshold(key, x)
        else:
            raise _band_error(
                ValueError, key, f"field {k!r}: unknown field (expected 'metric' and 'threshold')"
            )
    if metric < 0:
        raise _band_error(ValueError, key, "field 'metric': missing")
    if not has_threshold:
        raise _band_error(ValueError, key, "field 'threshold': missing")
    return (
        lo,
        hi,
        isinstance(key[0], int),
        isinstance(key[1], int),
        metric,
        nbytes,
        percent,
    )


def _parse_threshold(key: object, v: object) -> tuple[int, float]:
    if not isinstance(v, dict):
        raise _band_error(
            TypeError,
            key,
            "field 'threshold': expected a dict with 'bytes' and/or 'percent', got "
            + type(v).__name__,
        )
    items = list(v.items())
    if not items:
        raise _band_error(
            ValueError, key, "field 'threshold': is empty; give 'bytes' and/or 'percent'"
        )
    nbytes, percent = -1, -1.0
    for k, x in items:
        if k == "bytes" and isinstance(k, str):
            if not isinstance(x, int) or isinstance(x, bool):
                raise _band_error(
                    TypeError,
                    key,
                    f"field 'threshold.bytes': expected an int >= 0, got {type(x).__name__}",
                )
            if x < 0 or x >= 2**63:
                raise _band_error(
                    ValueError,
                    key,
                    f"field 'threshold.bytes': expected an int in [0, 2**63), got {x!r}",
                )
            nbytes = int(x)
        elif k == "percent" and isinstance(k, str):
            p = _number(key, "threshold.percent", x)
            if not (0.0 <= p <= 100.0):
                raise _band_error(
                    ValueError,
                    key,
                    f"field 'threshold.percent': expected 0 <= percent <= 100, got {x!r}",
                )
            percent = p
        else:
            raise _band_error(
                ValueError,
                key,
                f"field 'threshold.{k}': unknown field (expected 'bytes' or 'percent')",
            )
    return nbytes, percent


def parse_strategy(value: object) -> tuple[tuple[Band, ...], AutoGCStrategy]:
    """The bands (sorted, checked) and the normalized dict that the getter returns."""
    if value is None:
        value = DEFAULT_STRATEGY
    if not isinstance(value, dict):
        raise TypeError(
            "argument 'strategy': expected a dict {(lo_pct, hi_pct): {'metric': ..., "
            f"'threshold': {{...}}}} or None, got {type(value).__name__}"
        )
    items = list(value.items())
    if len(items) > MAX_BANDS:
        raise ValueError(f"argument 'strategy': more than {MAX_BANDS} bands")
    bands = sorted((_parse_band(k, v) for k, v in items), key=lambda b: b[0])
    for a, b in zip(bands, bands[1:], strict=False):
        if a[1] > b[0]:
            raise ValueError(
                f"argument 'strategy': band ({_fmt_bound(a[0], a[2])}, {_fmt_bound(a[1], a[3])}) "
                f"overlaps band ({_fmt_bound(b[0], b[2])}, {_fmt_bound(b[1], b[3])}): bands are "
                "half-open [lo, hi) ranges and must not share a percentage"
            )
    return tuple(bands), strategy_dict(bands)


def strategy_dict(bands: Iterable[Band]) -> AutoGCStrategy:
    """A fresh dict in the form parse_strategy accepts."""
    out: AutoGCStrategy = {}
    for lo, hi, lo_int, hi_int, metric, nbytes, percent in bands:
        thr: AutoGCThreshold = {}
        if nbytes >= 0:
            thr["bytes"] = nbytes
        if percent >= 0:
            thr["percent"] = percent
        key = (int(lo) if lo_int else lo, int(hi) if hi_int else hi)
        out[key] = {"metric": METRICS[metric], "threshold": thr}
    return out
