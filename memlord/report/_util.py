"""Small helpers shared by the writers: units, times, a progress bar, atomic writes."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import itertools
import math
import os
import re
import secrets
import stat
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TextIO

MiB = 1024 * 1024

Progress = Callable[[float, str], None]


def mb(nbytes: float) -> float:
    """Bytes as MiB, rounded to 4 decimals (the seed schema's ``*_mb`` fields)."""
    return round(nbytes / MiB, 4)


def plain_int(v: Any) -> int | None:
    """v when it is an int and no bool (a JSON document's integer), else None."""
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def unix_s(metadata: dict[str, Any], t_ns: int) -> float | None:
    """A monotonic time (ns) as wall-clock seconds since the epoch, using the metadata's
    clock pair (``start_ns`` monotonic, ``start_unix`` wall clock at the same moment);
    None when the metadata has no such pair."""
    start_ns = plain_int(metadata.get("start_ns"))
    start_unix = metadata.get("start_unix")
    if start_ns is None or isinstance(start_unix, bool) or not isinstance(start_unix, (int, float)):
        return None
    unix = start_unix + (t_ns - start_ns) / 1e9
    return unix if math.isfinite(unix) else None


def iso_from_ns(metadata: dict[str, Any], t_ns: int) -> str:
    """A monotonic time as a local ISO timestamp (:func:`unix_s`), "" when unknown."""
    unix = unix_s(metadata, t_ns)
    if unix is None:
        return ""
    try:
        return _dt.datetime.fromtimestamp(unix).isoformat(timespec="microseconds")
    except (OverflowError, ValueError, OSError):  # before year 1 or after 9999
        return ""


_BASIC = re.compile(r"^(\d{4})(\d{2})(\d{2})([T ])(\d{2})(\d{2})(\d{2})(?!\d)")
_FRACTION = re.compile(r"(\d{2}:\d{2}:\d{2})[.,](\d+)")


def iso_time(text: str) -> float:
    """Seconds since the epoch of an ISO 8601 time as a file states it (a time without an
    offset is local time), read alike on every supported CPython: 3.10's
    ``datetime.fromisoformat`` reads only what ``isoformat()`` writes, so a ``Z`` for UTC,
    a fraction of a second with other than 3 or 6 digits (``10:29:50.5``, ``,5``) and
    the basic format's date and time (``20250113T102950``) are made its form first.
    Raises ``ValueError`` (``OverflowError``, ``OSError`` out of range) for a string that
    is no such time, ``TypeError`` for anything else."""
    try:
        return _dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        if sys.version_info >= (3, 11):
            raise
    norm = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    norm = _BASIC.sub(lambda m: f"{m[1]}-{m[2]}-{m[3]}{m[4]}{m[5]}:{m[6]}:{m[7]}", norm, count=1)
    norm = _FRACTION.sub(lambda m: f"{m[1]}.{(m[2] + '00000')[:6]}", norm, count=1)
    return _dt.datetime.fromisoformat(norm).timestamp()


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


# ---- atomic writes ------------------------------------------------------------------------

_temp_counter = itertools.count(1)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path`` (same folder, so the rename is atomic),
    created exclusively under a name no other writer uses: ``.NAME.<pid>.<n>.<random>.tmp``
    (process, a per-process counter, random bits).  Returns its descriptor and path."""
    # keep the name under the file system's limit (255 bytes, not characters: a name of
    # 80 CJK characters is 240 bytes)
    stem = path.name[:120]
    while len(os.fsencode(stem)) > 120:
        stem = stem[:-1]
    for _ in range(100):
        tmp = path.with_name(
            f".{stem}.{os.getpid()}.{next(_temp_counter)}.{secrets.token_hex(4)}.tmp"
        )
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as e:  # the folder: name the file asked for, not the temporary one
            raise OSError(e.errno, e.strerror, str(path)) from None
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))  # pragma: no cover


def _target(path: str | os.PathLike[str]) -> Path:
    """The file a write to ``path`` lands in: symbolic links followed (a chain, relative
    ones, a dangling one to the file it names), as open() follows them."""
    return Path(os.path.realpath(path))


def _keep_mode(fd: int, path: Path) -> None:
    """Give the temporary file ``fd`` the permission bits of the file it will replace
    (when there is one), before any data goes in."""
    try:
        st = os.stat(path)
    except OSError:
        return  # a new file: the umask's default, as _create_temp made it
    if stat.S_ISREG(st.st_mode) and hasattr(os, "fchmod"):
        os.fchmod(fd, stat.S_IMODE(st.st_mode))


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], binary: bool = False) -> Iterator[IO[Any]]:
    """Write ``path`` all at once: the block writes a temporary file of its own beside it
    (text in UTF-8, lone surrogates as their escapes, or bytes with ``binary``), renamed
    over ``path`` when the block ends; when the block raises (a signal handler's
    ``SystemExit`` included), the temporary file is removed and ``path`` keeps what it
    held.  Every writer of the same path (threads, processes, a signal handler that
    writes while an interrupted write waits) has its own temporary file, and the last
    rename wins: the file is always one complete write.
    This is the one write path of every report format.

    As ``open(path, "w")`` would: a symbolic link at ``path`` (or on the way to it) is
    followed, and its target replaced, the link kept; a file that exists keeps its
    permission bits; a new one gets the umask's default."""
    path = _target(path)
    fd, tmp = _create_temp(path)
    try:
        _keep_mode(fd, path)
        # text: a string Python could not decode (a non-UTF-8 argument or path, as lone
        # surrogates) is written as its escape, \udcff, never refused half way
        f = (
            os.fdopen(fd, "wb")
            if binary
            else os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace")
        )
        with f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_writable(path: str | os.PathLike[str]) -> None:
    """Raise ``OSError`` unless a report could be written to ``path`` now: it must not be
    a folder, and its folder must exist (missing folders are created, as the writers
    would) and take a new file (tried for real: a temporary file is made and removed).
    A symbolic link is followed, as the writers follow it."""
    path = _target(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    os.close(fd)
    os.unlink(tmp)
