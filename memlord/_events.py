"""The event ring: ``lord.record_events(capacity)``, ``lord.events()`` and decoders.

Recording is a C sink (``src/sinks/ring.c``): each event is copied, in the event's apply
phase, into a preallocated ring of fixed-size records; when the ring is full the oldest
record is overwritten and counted in ``lord.events_dropped``.  ``events()`` copies the
ring in C and views the copy as a NumPy structured array of ``EVENT_DTYPE``.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ._sites import site_text

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
        ],
        "formats": ["<i8", "<i8", "<i8", "<u8", "<u8", "<i8", "<u4", "<u4", "<u4", "u1", "u1"],
        "offsets": [0, 8, 16, 24, 32, 40, 48, 52, 56, 60, 61],
        "itemsize": 64,
    }
)

#: ``kind`` codes, by value.
EVENT_KINDS = ("alloc", "free", "gc", "reset")
#: ``source`` codes, by value.
EVENT_SOURCES = ("explicit", "convert", "factory", "death", "deferred", "policy", "param")


class EventsMixin:
    """The event ring methods of MemLord."""

    def record_events(self, capacity: int) -> None:
        """Start recording every event into a fresh ring of ``capacity`` records (64 bytes
        each); ``0`` stops recording and frees the ring.  Records and the dropped count of
        a previous ring are discarded."""
        if isinstance(capacity, bool) or not isinstance(capacity, int):
            raise TypeError(
                "record_events(): argument 'capacity' must be an int, not "
                + type(capacity).__name__
            )
        if capacity < 0:
            raise ValueError(f"record_events(): argument 'capacity' must be >= 0, not {capacity}")
        self._record_events(capacity)  # type: ignore[attr-defined]

    def events(self, clear: bool = False) -> np.ndarray:
        """The recorded events, oldest first, as a NumPy structured array of
        ``memlord.EVENT_DTYPE`` (a copy; ``clear=True`` empties the ring)."""
        if not isinstance(clear, bool):
            raise TypeError(
                "events(): argument 'clear' must be a bool, not " + type(clear).__name__
            )
        return np.frombuffer(self._events_bytes(clear), dtype=EVENT_DTYPE)  # type: ignore[attr-defined]

    @property
    def events_dropped(self) -> int:
        """Records overwritten because the ring was full, since record_events()."""
        return self._events_info()[2]  # type: ignore[attr-defined]

    @property
    def events_capacity(self) -> int:
        """The ring's capacity in records (0 when not recording)."""
        return self._events_info()[0]  # type: ignore[attr-defined]

    # ---- decoders ---------------------------------------------------------------------

    @staticmethod
    def event_kind(code: int) -> str:
        """``"alloc"``, ``"free"``, ``"gc"`` or ``"reset"``."""
        return EVENT_KINDS[operator.index(code)]

    @staticmethod
    def event_source(code: int) -> str:
        """``"explicit"``, ``"convert"``, ``"factory"``, ``"death"``, ``"deferred"``,
        ``"policy"`` or ``"param"``."""
        return EVENT_SOURCES[operator.index(code)]

    def event_device(self, code: int) -> str:
        """The device string (``"cpu"``, ``"cuda:0"``) of a record's ``device``."""
        return self._device_name(operator.index(code))  # type: ignore[attr-defined]

    @staticmethod
    def event_site(code: int) -> str:
        """``"file:line"`` of a record's ``site`` (``"<unknown>:0"`` for 0)."""
        return site_text(operator.index(code))

    def event_region(self, code: int) -> str:
        """The name of the innermost region open on the event's thread, ``""`` for none
        (or a region entered before recording started)."""
        return self._region_names()[operator.index(code)]  # type: ignore[attr-defined]

    def decode_events(self, events: np.ndarray) -> list[dict[str, Any]]:
        """One dict per record with ``kind``, ``source``, ``device``, ``site`` and
        ``region`` decoded to strings and the other fields as ints."""
        names = self._region_names()  # type: ignore[attr-defined]
        devices: dict[int, str] = {}
        out = []
        for rec in events.tolist():
            t_ns, nbytes, count, address, thread, lifetime_ns, site, dev, region, kind, src = rec
            if dev not in devices:
                devices[dev] = self._device_name(dev)  # type: ignore[attr-defined]
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
                }
            )
        return out
