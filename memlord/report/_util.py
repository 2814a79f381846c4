"""Small helpers shared by the writers: units, times, a progress bar."""

from __future__ import annotations

import datetime as _dt
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

MiB = 1024 * 1024

Progress = Callable[[float, str], None]


def mb(nbytes: float) -> float:
    """Bytes as MiB, rounded to 4 decimals (the seed schema's ``*_mb`` fields)."""
    return round(nbytes / MiB, 4)


def iso_from_ns(metadata: dict[str, Any], t_ns: int) -> str:
    """A monotonic time as a local ISO timestamp, using the metadata's clock pair
    (``start_ns`` monotonic, ``start_unix`` wall clock)."""
    start_ns = metadata.get("start_ns")
    start_unix = metadata.get("start_unix")
    if not isinstance(start_ns, int) or not isinstance(start_unix, (int, float)):
        return ""
    unix = start_unix + (t_ns - start_ns) / 1e9
    try:
        return _dt.datetime.fromtimestamp(unix).isoformat(timespec="microseconds")
    except (OverflowError, ValueError, OSError):  # before year 1 or after 9999
        return ""


def no_progress(fraction: float, label: str) -> None:
    """A progress callback that does nothing."""


class ProgressBar:
    """A one-line progress bar on a terminal (stderr by default); silent elsewhere."""

    def __init__(self, title: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.title = title
        self.width = width
        try:
            self.enabled = self.stream.isatty() and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError):
            self.enabled = False
        self._last = -1

    def __call__(self, fraction: float, label: str) -> None:
        if not self.enabled:
            return
        fraction = min(max(fraction, 0.0), 1.0)
        filled = int(fraction * self.width)
        if filled == self._last and fraction < 1.0:
            return
        self._last = filled
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.title} [{bar}] {fraction * 100:3.0f}% {label:<24.24}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._last >= 0:
            self.stream.write("\n")
            self.stream.flush()


def stage(progress: Progress, lo: float, hi: float) -> Progress:
    """A callback reporting into [lo, hi] of an outer one."""

    def inner(fraction: float, label: str) -> None:
        progress(lo + (hi - lo) * fraction, label)

    return inner
