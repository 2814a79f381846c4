"""memlord's output: records of the standard ``logging`` logger ``"memlord"``.

Nothing is printed by default.  The C core builds a record only when the logger would
emit it (its check costs two dictionary reads per event):

- DEBUG records, one line per ledger event (``[allocate]``, ``[free]``, ``[reset]``), and
  one summary line for an explicit ``allocate()``/``free()`` call that touched several
  devices;
- an INFO record per auto-GC release (``[auto_gc]``).

``DEBUG=1`` in the environment (read while the program runs: setting
``os.environ["DEBUG"]`` takes effect at the next event) sets the logger to DEBUG and, unless
the application configured a handler (on ``memlord`` or the root logger), adds a handler on
stderr.  That handler colors lines on a terminal or with ``FORCE_COLOR``, never with
``NO_COLOR``.  An application that wants the auto-GC lines without DEBUG enables INFO for
``memlord``: ``logging.getLogger("memlord").setLevel(logging.INFO)`` with a handler.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

from ._bytes import human_bytes
from ._events import EVENT_KINDS, SOURCE_LABELS

if TYPE_CHECKING:
    from ._core import Lord

    _StreamHandler = logging.StreamHandler[TextIO]
    # one ledger event as the C core hands it to _event (src/sinks/log.c): (kind, source,
    # device or None for a reset, bytes, count, site id, the device's total after it)
    _Record = tuple[str, str, str | None, int, int, int, int]
else:
    _StreamHandler = logging.StreamHandler  # subscriptable at run time from 3.11 only

logger = logging.getLogger("memlord")

_RED, _GREEN, _YELLOW, _MAGENTA, _CYAN = "31", "32", "33", "35", "36"
_OFF = ("", "0", "false", "no", "off")


def _env_on(value: object) -> bool:
    if value is None:
        return False
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return str(value).strip().lower() not in _OFF


def _want_color(stream: object) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except Exception:  # a closed or odd stream: plain text
        return False


class ColorFormatter(logging.Formatter):
    """``memlord: <message>``, colored by the record's ``color`` attribute on a terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__("memlord: %(message)s")
        self._stream = stream

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        color = getattr(record, "color", None)
        stream = self._stream if self._stream is not None else sys.stderr
        if color and _want_color(stream):
            return "\n".join(f"\x1b[{color}m{line}\x1b[0m" for line in text.split("\n"))
        return text


class _DebugHandler(_StreamHandler):
    """The handler DEBUG=1 adds: stderr as it is at each record (so capture works)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(ColorFormatter())

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it
        pass


_debug_handler: _DebugHandler | None = None
_level_before: int | None = None


def _app_configured() -> bool:
    own = [h for h in logger.handlers if h is not _debug_handler]
    return bool(own) or bool(logging.getLogger().handlers)


def _debug_env_changed(value: object) -> None:
    """Apply DEBUG (value: its value in os.environ, or None).  Called by the core when the
    value changed or any logging level changed; idempotent."""
    global _debug_handler, _level_before
    if _env_on(value):
        if _level_before is None:
            _level_before = logger.level
        if logger.level != logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        if _debug_handler is None and not _app_configured():
            _debug_handler = _DebugHandler()
            logger.addHandler(_debug_handler)
    else:
        if _debug_handler is not None:
            logger.removeHandler(_debug_handler)
            _debug_handler = None
        if _level_before is not None:
            level, _level_before = _level_before, None
            if logger.level == logging.DEBUG:
                logger.setLevel(level)


# ---- what the records say ------------------------------------------------------------

# the kinds the log tells apart, looked up in the C core's list (an error at import if
# one is renamed there); kinds it does not name are not unpacked, so a new kind adds here
_ALLOC, _FREE, _RESET, _RESET_PEAK, _RESET_ACCUMULATED = (
    EVENT_KINDS[EVENT_KINDS.index(k)]
    for k in ("alloc", "free", "reset", "reset_peak", "reset_accumulated")
)


def _site_text(site: int) -> str:
    from ._sites import site_text

    return site_text(site)


def describe_tensor(t: object) -> str:
    """``float16[16, 32]``: the dtype and shape of a tensor, or '' for anything else."""
    try:
        import torch

        if isinstance(t, torch.Tensor):
            dtype = str(t.dtype).replace("torch.", "")
            return f"{dtype}[{', '.join(str(s) for s in t.shape)}]"
    except Exception:  # a broken subclass: no description
        pass
    return ""


def _event(lord: Lord, records: list[_Record], subject: object, what: str | None) -> None:
    """DEBUG records of one ledger call: (kind, source, device, bytes, count, site, total)."""
    desc = describe_tensor(subject)
    for kind, source, dev, nbytes, count, site, total in records:
        if kind == _RESET:
            logger.debug("[reset] counters and hotspots cleared", extra={"color": _MAGENTA})
            continue
        if kind == _RESET_PEAK or kind == _RESET_ACCUMULATED:
            logger.debug(
                "[%s] %s peak set to %s allocated%s",
                kind,
                dev,
                human_bytes(nbytes),
                ", cumulative counters cleared" if kind == _RESET_ACCUMULATED else "",
                extra={"color": _MAGENTA},
            )
            continue
        free = kind == _FREE
        tag = "[free]" if free else "[allocate]"
        sign = "-" if free else "+"
        plural = "" if count == 1 else "s"
        tensor = f" {desc}" if desc else ""
        logger.debug(
            "%s%s %s %s%s (%d storage%s)%s at %s; %s allocated %s",
            tag,
            SOURCE_LABELS.get(source, ""),
            dev,
            sign,
            human_bytes(nbytes),
            count,
            plural,
            tensor,
            _site_text(site),
            dev,
            human_bytes(total),
            extra={"color": _GREEN if free else _RED},
        )
    devices = {r[2] for r in records if r[0] in (_ALLOC, _FREE)}
    if what is not None and len(devices) > 1:
        _summary(records, what)


def _summary(records: list[_Record], what: str) -> None:
    """One line for an explicit call that touched several devices: its total, then each
    device's new total."""
    nbytes = sum(r[3] for r in records)
    count = sum(r[4] for r in records)
    site = records[0][5] if records else 0
    totals = ", ".join(f"{r[2]} allocated {human_bytes(r[6])}" for r in records)
    logger.debug(
        "[%s-summary] %s in %d storage%s on %d devices at %s; %s",
        what,
        human_bytes(nbytes),
        count,
        "" if count == 1 else "s",
        len(records),
        _site_text(site),
        totals,
        extra={"color": _CYAN},
    )


def _auto_gc(
    dev: str,
    band: str,
    used_pct: float,
    metric: str,
    value: int,
    threshold: int,
    runs: int,
    released: int,
    nlords: int,
) -> None:
    """The INFO record of one auto-GC release."""
    used = f"{used_pct:.1f}%" if used_pct >= 0 else "unknown"
    outcome = (
        "cache released"
        if released > 0
        else "no cache to release (backend not initialised, or no such device here)"
        if released == 0
        else "cache release failed"
    )
    scope = ""
    if released > 0 and dev.startswith("cuda"):
        # torch.cuda.empty_cache() releases the caching allocator of every device
        scope = f" of every CUDA device (torch.cuda.empty_cache; triggered by {dev})"
    lords = f" lords={nlords}" if nlords > 1 else ""
    logger.info(
        "[auto_gc] %s band=%s used=%s metric=%s value=%d (%s) threshold=%d (%s) runs=%d%s; %s%s",
        dev,
        band,
        used,
        metric,
        value,
        human_bytes(value),
        threshold,
        human_bytes(threshold),
        runs,
        lords,
        outcome,
        scope,
        extra={"color": _YELLOW},
    )
