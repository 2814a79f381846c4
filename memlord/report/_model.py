"""The in-memory profile document every report is written from.

One :class:`Profile` holds what a profiling session saw: metadata, snapshots (with a
per-device breakdown and the largest live tensors), operations and regions (timed spans),
memory samples, events (columnar NumPy arrays, so a million of them stay cheap), hotspots,
per-device counters and the PyTorch operator table.  The writers in
:mod:`memlord.report` turn it into JSON, a Chrome/Perfetto trace, a torch memory-snapshot
pickle or an HTML report; :func:`memlord.report.load` reads the JSON back.

docs/reports.md documents every field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

SCHEMA = "memlord.profile"
SCHEMA_VERSION = 1

#: Event kinds the timeline understands (others are kept and exported, not plotted):
#: alloc (+allocated), free (-allocated), free_requested (+pending: a deferred free was
#: requested), free_completed (-pending, -allocated), reserved (the backend's reserved
#: bytes were sampled: ``bytes`` is the new value), gc (an auto-GC ran), oom (an
#: out-of-memory error was seen).
KNOWN_KINDS = ("alloc", "free", "free_requested", "free_completed", "reserved", "gc", "oom")

# column name -> dtype; the order is the documented order
EVENT_COLUMNS: dict[str, np.dtype[Any]] = {
    "t_ns": np.dtype(np.int64),
    "kind": np.dtype(np.int16),
    "source": np.dtype(np.int16),
    "device": np.dtype(np.int16),
    "bytes": np.dtype(np.int64),
    "address": np.dtype(np.uint64),
    "site": np.dtype(np.int32),
    "thread": np.dtype(np.int64),
    "region": np.dtype(np.int32),
    "lifetime_ns": np.dtype(np.int64),
    "category": np.dtype(np.int16),
}
# columns that index a string table, and that table's name
EVENT_TABLES = {
    "kind": "kinds",
    "source": "sources",
    "device": "devices",
    "site": "sites",
    "region": "regions",
    "category": "categories",
}
# columns where -1 means "unknown" / "none"
_OPTIONAL = ("site", "region", "lifetime_ns", "source", "category")

SAMPLE_COLUMNS: dict[str, np.dtype[Any]] = {
    "t_ns": np.dtype(np.int64),
    "device": np.dtype(np.int16),
    "allocated": np.dtype(np.int64),
    "pending": np.dtype(np.int64),
    "reserved": np.dtype(np.int64),  # -1: not known for this device
}


def _column(values: Any, dtype: np.dtype[Any], name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"column {name!r}: cannot convert to {dtype}: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"column {name!r} must be one-dimensional, got shape {arr.shape}")
    return arr


class Events:
    """Events as columns: one 1-D NumPy array per field, all the same length, plus small
    string tables that the integer columns ``kind``, ``source``, ``device``, ``site``,
    ``region`` and ``category`` index (-1 in ``source``, ``site``, ``region`` and
    ``category`` means none; -1 in ``lifetime_ns`` means unknown)."""

    __slots__ = ("columns", "kinds", "sources", "devices", "sites", "regions", "categories")

    def __init__(
        self,
        columns: dict[str, Any] | None = None,
        *,
        kinds: Sequence[str] = KNOWN_KINDS,
        sources: Sequence[str] = (),
        devices: Sequence[str] = (),
        sites: Sequence[str] = (),
        regions: Sequence[str] = (),
        categories: Sequence[str] = (),
    ) -> None:
        columns = dict(columns or {})
        unknown = set(columns) - set(EVENT_COLUMNS)
        if unknown:
            raise ValueError(f"columns: unknown event column(s) {sorted(unknown)}")
        n = None
        for name, values in columns.items():
            if len(np.shape(values)) != 1:
                raise ValueError(f"column {name!r} must be one-dimensional")
            m = np.shape(values)[0]
            if n is not None and m != n:
                raise ValueError(f"columns: {name!r} has {m} rows, another column has {n}")
            n = m
        n = n or 0
        self.columns: dict[str, np.ndarray] = {}
        for name, dtype in EVENT_COLUMNS.items():
            if name in columns:
                self.columns[name] = _column(columns[name], dtype, name)
            else:
                fill = -1 if name in _OPTIONAL else 0
                self.columns[name] = np.full(n, fill, dtype=dtype)
        self.kinds = [str(s) for s in kinds]
        self.sources = [str(s) for s in sources]
        self.devices = [str(s) for s in devices]
        self.sites = [str(s) for s in sites]
        self.regions = [str(s) for s in regions]
        self.categories = [str(s) for s in categories]
        for col, table in EVENT_TABLES.items():
            arr = self.columns[col]
            size = len(getattr(self, table))
            low = -1 if col in _OPTIONAL else 0  # kind and device are never "none"
            if arr.size and (int(arr.max()) >= size or int(arr.min()) < low):
                raise ValueError(
                    f"column {col!r} indexes past its table {table!r} ({size} entries)"
                )

    def __len__(self) -> int:
        return int(self.columns["t_ns"].shape[0])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def tables(self) -> dict[str, list[str]]:
        return {t: list(getattr(self, t)) for t in EVENT_TABLES.values()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Events):
            return NotImplemented
        return self.tables() == other.tables() and all(
            np.array_equal(self.columns[c], other.columns[c]) for c in EVENT_COLUMNS
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Events({len(self)} rows, devices={self.devices})"

    def decode(self, column: str) -> list[str | None]:
        """A table-indexed column as strings (None where -1)."""
        table = getattr(self, EVENT_TABLES[column])
        return [None if i < 0 else table[i] for i in self.columns[column].tolist()]

    def mask_kind(self, *kinds: str) -> np.ndarray:
        idx = [self.kinds.index(k) for k in kinds if k in self.kinds]
        return np.isin(self.columns["kind"], np.asarray(idx, dtype=np.int16))


class Samples:
    """Memory samples, columnar: at each ``t_ns``, one device's allocated, pending and
    reserved bytes (-1 where reserved is not known). Profilers add one at every snapshot
    and at each operation's start and end; the timeline draws them where a device has no
    events."""

    __slots__ = ("columns", "devices")

    def __init__(
        self, columns: dict[str, Any] | None = None, *, devices: Sequence[str] = ()
    ) -> None:
        columns = dict(columns or {})
        unknown = set(columns) - set(SAMPLE_COLUMNS)
        if unknown:
            raise ValueError(f"columns: unknown sample column(s) {sorted(unknown)}")
        lengths = {np.shape(v)[0] if np.ndim(v) else -1 for v in columns.values()}
        if len(lengths) > 1 or -1 in lengths:
            raise ValueError("columns: sample columns must be 1-D and the same length")
        n = lengths.pop() if lengths else 0
        self.columns = {
            name: _column(columns[name], dtype, name)
            if name in columns
            else np.full(n, -1 if name == "reserved" else 0, dtype=dtype)
            for name, dtype in SAMPLE_COLUMNS.items()
        }
        self.devices = [str(d) for d in devices]

    def __len__(self) -> int:
        return int(self.columns["t_ns"].shape[0])

    def __getitem__(self, name: str) -> np.ndarray:
        return self.columns[name]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Samples):
            return NotImplemented
        return self.devices == other.devices and all(
            np.array_equal(self.columns[c], other.columns[c]) for c in SAMPLE_COLUMNS
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Samples({len(self)} rows, devices={self.devices})"


def _check_int64(name: str, value: Any, what: str = "an int") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"SampleBuilder.add(): argument '{name}' must be {what}, not {type(value).__name__}"
        )
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"SampleBuilder.add(): argument '{name}' must fit in 64 bits, not {value}")


def _device_name(device: Any) -> str:
    """The name torch gives ``device`` (a str or torch.device): ``"cpu"`` for ``"cpu:0"``,
    as memlord's ledger names it.  TypeError/ValueError naming the argument otherwise."""
    import torch

    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            "SampleBuilder.add(): argument 'device' must be a str or torch.device, not "
            + type(device).__name__
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            "SampleBuilder.add(): argument 'device' must be a device torch can name, such "
            f"as 'cpu' or 'cuda:0', not {device!r}"
        ) from None
    if dev.index is not None and dev.index > 255:  # a file's device index is 8 bits
        raise ValueError(
            f"SampleBuilder.add(): argument 'device' has an index above 255: {device!r}"
        )
    return "cpu" if dev.type == "cpu" else str(dev)


class SampleBuilder:
    """Appends samples one at a time (lists, turned into arrays by :meth:`build`)."""

    def __init__(self) -> None:
        self._rows: list[tuple[int, str, int, int, int]] = []

    def add(
        self,
        t_ns: int,
        device: str | Any,
        allocated: int,
        pending: int = 0,
        reserved: int | None = None,
    ) -> None:
        """One sample: at ``t_ns``, ``device`` (a str or torch.device torch can name;
        kept as torch writes it, ``"cpu"`` for ``"cpu:0"``) held ``allocated`` bytes,
        ``pending`` of them waiting for a CUDA event, and its allocator ``reserved``
        (None: unknown).  A wrong value is a TypeError/ValueError naming the argument,
        and nothing is added."""
        for name, value in (("t_ns", t_ns), ("allocated", allocated), ("pending", pending)):
            _check_int64(name, value)
        if reserved is not None:
            _check_int64("reserved", reserved, "an int or None")
        self._add(t_ns, _device_name(device), allocated, pending, reserved)

    def _add(
        self, t_ns: int, device: str, allocated: int, pending: int = 0, reserved: int | None = None
    ) -> None:
        """add() without the checks: for values memlord read itself (the ledger's
        devices, a file the validator checked)."""
        self._rows.append((t_ns, device, allocated, pending, -1 if reserved is None else reserved))

    def __len__(self) -> int:
        return len(self._rows)

    def build(self) -> Samples:
        devices: list[str] = []
        index: dict[str, int] = {}
        dev_col = []
        for row in self._rows:
            if row[1] not in index:
                index[row[1]] = len(devices)
                devices.append(row[1])
            dev_col.append(index[row[1]])
        rows = self._rows
        return Samples(
            {
                "t_ns": [r[0] for r in rows],
                "device": dev_col,
                "allocated": [r[2] for r in rows],
                "pending": [r[3] for r in rows],
                "reserved": [r[4] for r in rows],
            },
            devices=devices,
        )


@dataclasses.dataclass
class Span:
    """A timed, named interval on one thread: an operation (``track_operation``, a module
    call) or a region.  ``delta`` is allocated-at-end minus allocated-at-start per device;
    ``pre_total``/``post_total`` are the totals over every device (bytes)."""

    name: str
    start_ns: int
    end_ns: int
    thread: int = 0
    depth: int = 0
    kind: str = "operation"  # "operation" | "region" | "module"
    pre_total: int = 0
    post_total: int = 0
    tensor_delta: int = 0
    delta: dict[str, int] = dataclasses.field(default_factory=dict)
    peak: dict[str, int] = dataclasses.field(default_factory=dict)
    finished: bool = True
    # per device, {category: {"delta", "peak_delta", "at_peak"}} (regions; empty when
    # the span's source does not split by category)
    categories: dict[str, dict[str, dict[str, int]]] = dataclasses.field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def memory_delta(self) -> int:
        return self.post_total - self.pre_total

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Span:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})


@dataclasses.dataclass
class Profile:
    """The profile document.  Build one directly, from :class:`memlord.profiler`'s tracker
    (``tracker.profile()``) or with :func:`memlord.report.load`."""

    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    snapshots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    operations: list[Span] = dataclasses.field(default_factory=list)
    regions: list[Span] = dataclasses.field(default_factory=list)
    samples: Samples = dataclasses.field(default_factory=Samples)
    events: Events = dataclasses.field(default_factory=Events)
    hotspots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    counters: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    pytorch_operations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    # ---- derived views ---------------------------------------------------------------

    def devices(self) -> list[str]:
        """Every device the document mentions, cpu first, then in name order."""
        seen: set[str] = set(self.counters)
        seen.update(self.events.devices)
        seen.update(self.samples.devices)
        for snap in self.snapshots:
            seen.update(snap.get("device_breakdown") or {})
        return sorted(seen, key=lambda d: (d != "cpu", d))

    def t0_ns(self) -> int:
        """The origin of relative times: metadata ``start_ns``, else the earliest time."""
        start = self.metadata.get("start_ns")
        if isinstance(start, int):
            return start
        candidates = [s.start_ns for s in self.operations + self.regions]
        if len(self.events):
            candidates.append(int(self.events["t_ns"].min()))
        if len(self.samples):
            candidates.append(int(self.samples["t_ns"].min()))
        return min(candidates) if candidates else 0

    def spans(self) -> list[Span]:
        return self.operations + self.regions

    def operation_allocations(self) -> dict[str, list[dict[str, Any]]]:
        """The seed schema's ``operation_allocations``: per operation name, each call."""
        from ._util import iso_from_ns, mb

        out: dict[str, list[dict[str, Any]]] = {}
        for s in self.operations:
            out.setdefault(s.name, []).append(
                {
                    "memory_delta_mb": mb(s.memory_delta),
                    "tensor_delta": s.tensor_delta,
                    "pre_total_mb": mb(s.pre_total),
                    "post_total_mb": mb(s.post_total),
                    "timestamp": iso_from_ns(self.metadata, s.start_ns),
                    "duration_ms": s.duration_ns / 1e6,
                }
            )
        return out

    def operation_summary(self) -> dict[str, dict[str, Any]]:
        """The seed schema's ``operation_summary``: per operation name, count and deltas."""
        from ._util import mb

        out: dict[str, dict[str, Any]] = {}
        groups: dict[str, list[Span]] = {}
        for s in self.operations:
            groups.setdefault(s.name, []).append(s)
        for name, spans in groups.items():
            deltas = [s.memory_delta for s in spans]
            out[name] = {
                "invocation_count": len(spans),
                "total_memory_delta_mb": mb(sum(deltas)),
                "avg_memory_delta_mb": mb(sum(deltas) / len(deltas)),
                "max_memory_delta_mb": mb(max(deltas)),
                "total_duration_ms": sum(s.duration_ns for s in spans) / 1e6,
            }
        return out


def check_arguments(
    where: str,
    doc: object,
    path: object = None,
    progress: object = None,
) -> None:
    """The public writers' and readers' arguments, each refused with a ``TypeError``
    naming the function and the argument (not an ``AttributeError`` deep inside):
    ``doc`` a :class:`Profile`; ``path`` (when given) a ``str`` or ``os.PathLike``;
    ``progress`` (when given) callable."""
    import os

    if not isinstance(doc, Profile):
        raise TypeError(
            f"{where}(): argument 'doc' must be a memlord.report.Profile, not {type(doc).__name__}"
        )
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"{where}(): argument 'path' must be a str or os.PathLike, not {type(path).__name__}"
        )
    if progress is not None and not callable(progress):
        raise TypeError(
            f"{where}(): argument 'progress' must be callable (fraction, label), "
            f"not {type(progress).__name__}"
        )


def concat_events(parts: Iterable[Events]) -> Events:
    """Several Events blocks as one (tables merged, indices remapped)."""
    parts = list(parts)
    if not parts:
        return Events()
    tables: dict[str, list[str]] = {t: [] for t in EVENT_TABLES.values()}
    index: dict[str, dict[str, int]] = {t: {} for t in EVENT_TABLES.values()}
    cols: dict[str, list[np.ndarray]] = {c: [] for c in EVENT_COLUMNS}
    for part in parts:
        for col, table in EVENT_TABLES.items():
            src = getattr(part, table)
            remap = np.empty(len(src) + 1, dtype=np.int64)
            remap[-1] = -1
            for i, s in enumerate(src):
                if s not in index[table]:
                    index[table][s] = len(tables[table])
                    tables[table].append(s)
                remap[i] = index[table][s]
            cols[col].append(remap[part.columns[col]].astype(EVENT_COLUMNS[col]))
        for col in EVENT_COLUMNS:
            if col not in EVENT_TABLES:
                cols[col].append(part.columns[col])
    return Events({c: np.concatenate(v) for c, v in cols.items()}, **tables)
