"""The one byte formatter of memlord's Python side: the C core's (``src/base/format.c``,
``memlord.format_bytes``), which also writes the C-built strings (``allocated()``,
``repr(lord)``) and the DEBUG log's sizes.  Binary units, at most two decimals, trailing
zeros trimmed, hundredths rounded half up in integer arithmetic."""

from __future__ import annotations

from ._core import format_bytes

__all__ = ["format_bytes", "human_bytes"]

_MAX = 2**63 - 1


def human_bytes(n: float) -> str:
    """``format_bytes`` for any number a report holds: a negative one (a delta) gets a
    ``-`` sign, a float is rounded to whole bytes, a magnitude beyond int64 is clamped."""
    if isinstance(n, float) and n != n:  # NaN: nothing to round
        return "nan B"
    value = int(n) if isinstance(n, int) else int(round(n)) if abs(n) < 2.0**63 else _MAX
    if value < 0:
        return "-" + format_bytes(min(-value, _MAX))
    return format_bytes(min(value, _MAX))
