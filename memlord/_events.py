"""The event ring: ``lord.record_events(capacity)``, ``lord.events()`` and decoders.

Recording is a C sink (``src/sinks/ring.c``): each event is copied, in the event's apply
phase, into a preallocated ring of fixed-size records; when the ring is full the oldest
record is overwritten and counted in ``lord.events_dropped``.  ``events()`` copies the
ring in C and views the copy as a NumPy structured array of ``EVENT_DTYPE``.
"""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _core
from ._errors import type_name
from ._sites import site_text

if TYPE_CHECKING:
    from ._core import Lord as _LordBase
else:
    _LordBase = object  # the mixin's methods run on memlord.MemLord, a _core.Lord

#: The layout of one record (``ml_rec`` in src/sinks/ring.h).
EVENT_DTYPE = np.dtype(
    {
        "names": [
            "t_ns",
            "bytes",
            "count",
            "address",
            "thread",
            "lifetime_ns",
            "site",
            "device",
            "region",
            "kind",
            "source",
            "category",
        ],
        "formats": [
            "<i8",
            "<i8",
            "<i8",
            "<u8",
            "<u8",
            "<i8",
            "<u4",
            "<u4",
            "<u4",
            "u1",
            "u1",
            "u1",
        ],
        "offsets": [0, 8, 16, 24, 32, 40, 48, 52, 56, 60, 61, 62],
        "itemsize": 64,
    }
)

# The names of event kinds and sources are the C core's (one X-macro list each in
# src/core/event.h, exported by ``_core``): the ring decoders, the DEBUG log and the reports
# read them from here, and no Python spells them again.

#: ``kind`` codes, by value.
EVENT_KINDS: tuple[str, ...] = _core.EVENT_KINDS
#: ``source`` codes, by value.
EVENT_SOURCES: tuple[str, ...] = _core.EVENT_SOURCES
#: What a DEBUG ``[allocate]``/``[free]`` line says after its tag, per source name
#: (``_core.SOURCE_LABELS``, by code, with the space that separates it from the tag).
SOURCE_LABELS: dict[str, str] = {
    name: f" {label}" if label else ""
    for name, label in zip(EVENT_SOURCES, _core.SOURCE_LABELS, strict=True)
}


_U32 = 2**32


def _code(fname: str, code: Any, end: int) -> int:
    """``code`` as an int in ``range(end)``, else a TypeError or ValueError that names it."""
    try:
        if isinstance(code, bool):  # an int to operator.index, but no code
            raise TypeError
        value = operator.index(code)
    except TypeError:
        raise TypeError(
            f"{fname}(): argument 'code' must be an int, not {type_name(code)}"
        ) from None
    if not 0 <= value < end:
        raise ValueError(f"{fname}(): argument 'code' must be between 0 and {end - 1}, not {value}")
    return value


def _physical_memory() -> int | None:
    """The machine's memory in bytes, None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


class EventsMixin(_LordBase):
    """The event ring methods of MemLord."""

    def record_events(self, capacity: int) -> None:
        """Start recording every event into a fresh ring of ``capacity`` records (64 bytes
        each); ``0`` stops recording and frees the ring.  Records and the dropped count of
        a previous ring are discarded."""
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(
                "record_events(): argument 'capacity' must be an int, not " + type_name(capacity)
            )
        if capacity < 0:
            raise ValueError(f"record_events(): argument 'capacity' must be >= 0, not {capacity}")
        ram = _physical_memory()
        if ram is not None and capacity * EVENT_DTYPE.itemsize > ram:
            # the ring is touched page by page when made: more than the machine has
            # would end in the kernel's OOM killer rather than in an error here
            raise MemoryError(
                f"record_events(): argument 'capacity' asks for {capacity} records of "
                f"{EVENT_DTYPE.itemsize} bytes, more than this machine's memory "
                f"({ram} bytes); the current ring is kept"
            )
        self._record_events(capacity)

    def events(self, clear: bool = False) -> np.ndarray:
        """The recorded events, oldest first, as a NumPy structured array of
        ``memlord.EVENT_DTYPE`` (a copy; ``clear=True`` empties the ring)."""
        if not isinstance(clear, bool):
            raise TypeError("events(): argument 'clear' must be a bool, not " + type_name(clear))
        return np.frombuffer(self._events_bytes(clear), dtype=EVENT_DTYPE)

    @property
    def events_dropped(self) -> int:
        """Records overwritten because the ring was full, since record_events()."""
        return self._events_info()[2]

    @property
    def events_capacity(self) -> int:
        """The ring's capacity in records (0 when not recording)."""
        return self._events_info()[0]

    # ---- decoders ---------------------------------------------------------------------

    @staticmethod
    def event_kind(code: int) -> str:
        """The kind's name (``EVENT_KINDS``): ``"alloc"``, ``"free"``, ``"gc"``,
        ``"reset"``, ``"reset_peak"``, ``"reset_accumulated"`` or ``"oom"``."""
        return EVENT_KINDS[_code("event_kind", code, len(EVENT_KINDS))]

    @staticmethod
    def event_source(code: int) -> str:
        """The source's name (``EVENT_SOURCES``): ``"explicit"``, ``"convert"``,
        ``"factory"``, ``"death"``, ``"deferred"``, ``"policy"``, ``"param"``, ``"op"``,
        ``"grad"``, ``"load"``, ``"tensor"``, ``"allocator"`` or ``"found"``."""
        return EVENT_SOURCES[_code("event_source", code, len(EVENT_SOURCES))]

    def event_device(self, code: int) -> str:
        """The device string (``"cpu"``, ``"cuda:0"``) of a record's ``device``."""
        code = _code("event_device", code, _U32)
        try:
            return self._device_name(code)
        except ValueError:
            raise ValueError(
                f"event_device(): argument 'code' is not a device code: {code}"
            ) from None

    @staticmethod
    def event_site(code: int) -> str:
        """``"file:line"`` of a record's ``site`` (``"<unknown>:0"`` for 0)."""
        return site_text(_code("event_site", code, _U32))

    def event_region(self, code: int) -> str:
        """The name of the innermost region open on the event's thread, ``""`` for none
        (or a region entered before recording started)."""
        names = self._region_names()
        return names[_code("event_region", code, len(names))]

    def decode_events(self, events: np.ndarray) -> list[dict[str, Any]]:
        """One dict per record with ``kind``, ``source``, ``device``, ``site``,
        ``region`` and ``category`` decoded to strings and the other fields as ints."""
        if not isinstance(events, np.ndarray) or events.dtype != EVENT_DTYPE:
            raise TypeError(
                "decode_events(): argument 'events' must be a NumPy array of "
                "memlord.EVENT_DTYPE (what lord.events() returns), not "
                + (f"an array of {events.dtype}" if isinstance(events, np.ndarray) else "")
                + ("" if isinstance(events, np.ndarray) else type_name(events))
            )
        names = self._region_names()
        devices: dict[int, str] = {}
        out = []
        for i, rec in enumerate(events.reshape(-1).tolist()):
            t_ns, nbytes, count, address, thread, lifetime_ns, site, dev, region, kind, src = rec[
                :11
            ]
            cat = rec[11]
            if kind >= len(EVENT_KINDS) or src >= len(EVENT_SOURCES):
                raise ValueError(
                    f"decode_events(): argument 'events': record {i} has kind {kind} and "
                    f"source {src}, which are not event codes"
                )
            if dev not in devices:
                try:
                    devices[dev] = self._device_name(dev)
                except ValueError:
                    raise ValueError(
                        f"decode_events(): argument 'events': record {i} has device {dev}, "
                        "which is not a device code"
                    ) from None
            out.append(
                {
                    "t_ns": t_ns,
                    "kind": EVENT_KINDS[kind],
                    "source": EVENT_SOURCES[src],
                    "device": devices[dev],
                    "bytes": nbytes,
                    "count": count,
                    "address": address,
                    "site": site_text(site),
                    "thread": thread,
                    "region": names[region] if region < len(names) else "",
                    "lifetime_ns": lifetime_ns,
                    "category": _core.CATEGORIES[cat] if cat < len(_core.CATEGORIES) else "other",
                }
            )
        return out
