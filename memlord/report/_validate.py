"""The shape check of a JSON profile, before anything reads it.

:func:`problems` walks the parsed JSON and lists every value that the reader or a writer
could not use (a wrong type, an integer out of its column's range, a device name that is
no device, an unknown column), one line each, with where it is
(``memlord.operations[3].start_ns: expected an integer, got a string``).  A profile with
no problem converts to every format; :func:`memlord.report.load` raises
:class:`ProfileError` listing them otherwise, and ``python -m memlord report`` prints one
line per problem.
"""

from __future__ import annotations

import math
import re
from typing import Any, cast

import numpy as np

from ._model import EVENT_COLUMNS, EVENT_TABLES, SAMPLE_COLUMNS, SCHEMA, SCHEMA_VERSION
from ._util import iso_time

#: At most this many problems are listed (a broken file can have millions).
MAX_PROBLEMS = 20

_INT64 = (-(2**63), 2**63 - 1)
# a torch device: a type name, optionally ':' and an index (torch's index is 8 bits)
_DEVICE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(:(0|[1-9][0-9]{0,2}))?")
_MAX_DEVICE_INDEX = 255
# start_unix * 1e6 must stay an int64 microsecond count (the pickle's time_us)
_MAX_UNIX = 1e12
_SPAN_INTS = ("thread", "depth", "pre_total", "post_total", "tensor_delta")
_COUNTER_INTS = (
    "allocated",
    "freed",
    "allocated_total",
    "freed_total",
    "peak_allocated",
    "allocs",
    "frees",
    "gc_runs",
    "pending",
    "reserved",
)
_OP_NUMBERS = ("cpu_time_us", "cuda_time_us", "cpu_memory_mb", "cuda_memory_mb")
_SEED_NUMBERS = ("duration_ms", "pre_total_mb", "post_total_mb")


class ProfileError(ValueError):
    """A JSON document that is not a readable profile: ``problems`` lists what is wrong,
    one line each (the message joins them)."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        head = (
            f"{source!r} is not a readable memlord profile"
            if source
            else ("not a readable memlord profile")
        )
        super().__init__(head + ": " + "; ".join(self.problems))


def _kind(value: Any) -> str:
    """A JSON value's type, as the file's author would name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class _Checker:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.more = 0

    def bad(self, where: str, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{where}: {what}")
        else:
            self.more += 1

    def expected(self, where: str, what: str, value: Any) -> None:
        self.bad(where, f"expected {what}, got {_kind(value)}")

    # ---- scalars ------------------------------------------------------------------------

    def integer(self, where: str, value: Any, low: int = _INT64[0], high: int = _INT64[1]) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            self.expected(where, "an integer", value)
            return False
        if not low <= value <= high:
            self.bad(where, f"{value} is out of range ({low} to {high})")
            return False
        return True

    def number(self, where: str, value: Any, limit: float = 1e300) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.expected(where, "a number", value)
            return False
        if isinstance(value, float) and not math.isfinite(value):
            self.bad(where, f"expected a finite number, got {value}")
            return False
        if abs(value) > limit:
            self.bad(where, f"{value} is out of range (-{limit:g} to {limit:g})")
            return False
        return True

    def string(self, where: str, value: Any) -> bool:
        if not isinstance(value, str):
            self.expected(where, "a string", value)
            return False
        return True

    def device(self, where: str, value: Any) -> bool:
        if not self.string(where, value):
            return False
        m = _DEVICE.fullmatch(value)
        if m is None or (m.group(2) is not None and int(m.group(2)) > _MAX_DEVICE_INDEX):
            self.bad(where, f"{value!r} is not a device name (like 'cpu' or 'cuda:0')")
            return False
        return True

    # ---- containers ---------------------------------------------------------------------

    def obj(self, where: str, value: Any) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.expected(where, "an object", value)
            return None
        return value

    def lst(self, where: str, value: Any) -> list[Any] | None:
        if not isinstance(value, list):
            self.expected(where, "a list", value)
            return None
        return value

    def objects(self, where: str, value: Any) -> list[tuple[str, dict[str, Any]]]:
        """The objects of a list of objects, with their places."""
        items = self.lst(where, value)
        out = []
        for i, item in enumerate(items or ()):
            d = self.obj(f"{where}[{i}]", item)
            if d is not None:
                out.append((f"{where}[{i}]", d))
        return out

    def device_keys(self, where: str, d: dict[str, Any]) -> None:
        for key in d:
            self.device(f"{where} key", key)

    # ---- sections -----------------------------------------------------------------------

    def version(self, data: dict[str, Any]) -> None:
        where = "schema_version"
        if "schema_version" in data:
            version = data["schema_version"]
        elif isinstance(data.get("metadata"), dict) and "schema_version" in data["metadata"]:
            where, version = "metadata.schema_version", data["metadata"]["schema_version"]
        else:
            return
        if isinstance(version, bool) or not isinstance(version, int):
            self.expected(where, "an integer", version)
        elif version > SCHEMA_VERSION:
            self.bad(where, f"{version} is newer than this memlord reads ({SCHEMA_VERSION})")
        elif version < 0:
            self.bad(where, f"{version} is not a schema version")

    def metadata(self, value: Any) -> None:
        md = self.obj("metadata", value)
        if md is None:
            return
        if "start_ns" in md:
            self.integer("metadata.start_ns", md["start_ns"])
        if "start_unix" in md:
            self.number("metadata.start_unix", md["start_unix"], _MAX_UNIX)
        if "threads" in md:
            self.obj("metadata.threads", md["threads"])
        if "event_baseline" in md:
            base = self.obj("metadata.event_baseline", md["event_baseline"])
            for dev, v in (base or {}).items():
                self.device("metadata.event_baseline key", dev)
                self.integer(f"metadata.event_baseline.{dev}", v)
        if "category_baseline" in md:
            base = self.obj("metadata.category_baseline", md["category_baseline"])
            for dev, cats in (base or {}).items():
                self.device("metadata.category_baseline key", dev)
                self.int_map(f"metadata.category_baseline.{dev}", cats)

    def int_map(self, where: str, value: Any) -> None:
        """An object of names to integers (bytes by category)."""
        for name, v in (self.obj(where, value) or {}).items():
            self.integer(f"{where}.{name}", v)

    def snapshots(self, value: Any) -> None:
        for where, snap in self.objects("snapshots", value):
            breakdown = snap.get("device_breakdown")
            if breakdown is None:
                continue
            per_dev = self.obj(f"{where}.device_breakdown", breakdown)
            for dev, info in (per_dev or {}).items():
                self.device(f"{where}.device_breakdown key", dev)
                info = self.obj(f"{where}.device_breakdown.{dev}", info)
                if info is not None and "categories" in info:
                    self.int_map(f"{where}.device_breakdown.{dev}.categories", info["categories"])
                if info is None or "tensors" not in info:
                    continue
                for twhere, t in self.objects(
                    f"{where}.device_breakdown.{dev}.tensors", info["tensors"]
                ):
                    if "size_mb" in t:
                        self.number(f"{twhere}.size_mb", t["size_mb"])

    def pytorch_operations(self, value: Any) -> None:
        for where, op in self.objects("pytorch_operations", value):
            for key in _OP_NUMBERS:
                if key in op:
                    self.number(f"{where}.{key}", op[key])

    def seed_operations(self, value: Any) -> None:
        allocs = self.obj("operation_allocations", value)
        for name, calls in (allocs or {}).items():
            for where, call in self.objects(f"operation_allocations.{name}", calls):
                stamp = call.get("timestamp")
                if self.string(f"{where}.timestamp", stamp):
                    text = cast(str, stamp)  # string() checked it
                    try:
                        iso_time(text)
                    except (ValueError, OverflowError, OSError):
                        self.bad(f"{where}.timestamp", f"{text[:40]!r} is not an ISO time")
                for key in _SEED_NUMBERS:
                    if key in call:
                        self.number(f"{where}.{key}", call[key], 1e12)
                if "tensor_delta" in call:
                    self.integer(f"{where}.tensor_delta", call["tensor_delta"])

    def spans(self, where: str, value: Any) -> None:
        for swhere, span in self.objects(where, value):
            for key in ("name", "start_ns", "end_ns"):
                if key not in span:
                    self.bad(swhere, f"missing {key!r}")
            if "name" in span:
                self.string(f"{swhere}.name", span["name"])
            if "kind" in span:
                self.string(f"{swhere}.kind", span["kind"])
            for key in ("start_ns", "end_ns", *_SPAN_INTS):
                if key in span:
                    self.integer(f"{swhere}.{key}", span[key])
            for key in ("delta", "peak"):
                if key in span:
                    per_dev = self.obj(f"{swhere}.{key}", span[key])
                    for dev, v in (per_dev or {}).items():
                        self.device(f"{swhere}.{key} key", dev)
                        self.integer(f"{swhere}.{key}.{dev}", v)
            if "categories" in span:
                per_dev = self.obj(f"{swhere}.categories", span["categories"])
                for dev, cats in (per_dev or {}).items():
                    self.device(f"{swhere}.categories key", dev)
                    for cat, c in (self.obj(f"{swhere}.categories.{dev}", cats) or {}).items():
                        self.int_map(f"{swhere}.categories.{dev}.{cat}", c)
            if "finished" in span and not isinstance(span["finished"], bool):
                self.expected(f"{swhere}.finished", "true or false", span["finished"])

    def hotspots(self, value: Any) -> None:
        for where, h in self.objects("memlord.hotspots", value):
            if "bytes" in h:
                self.integer(f"{where}.bytes", h["bytes"])

    def counters(self, value: Any) -> None:
        counters = self.obj("memlord.counters", value)
        for dev, c in (counters or {}).items():
            self.device("memlord.counters key", dev)
            c = self.obj(f"memlord.counters.{dev}", c)
            for key in _COUNTER_INTS:
                if c is not None and key in c and not (key == "reserved" and c[key] is None):
                    self.integer(f"memlord.counters.{dev}.{key}", c[key])
            for key in ("categories", "peak_categories", "category_peaks"):
                if c is not None and key in c:
                    self.int_map(f"memlord.counters.{dev}.{key}", c[key])

    def columns(
        self, where: str, value: Any, dtypes: dict[str, np.dtype[Any]], what: str
    ) -> dict[str, list[Any]] | None:
        cols = self.obj(where, value)
        if cols is None:
            return None
        ok = True
        length = None
        for name, values in cols.items():
            cwhere = f"{where}.{name}"
            if name not in dtypes:
                self.bad(where, f"unknown {what} column {name!r} (known: {', '.join(dtypes)})")
                ok = False
                continue
            values = self.lst(cwhere, values)
            if values is None:
                ok = False
                continue
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, int):
                    self.expected(f"{cwhere}[{i}]", "an integer", v)
                    ok = False
                    break
            else:
                info = np.iinfo(dtypes[name])
                if values and not (info.min <= min(values) and max(values) <= info.max):
                    self.bad(cwhere, f"values out of range for {dtypes[name]}")
                    ok = False
            if length is not None and len(values) != length:
                self.bad(cwhere, f"has {len(values)} rows, another column has {length}")
                ok = False
            length = len(values)
        return cols if ok else None

    def samples(self, value: Any) -> None:
        if not value:
            return
        samples = self.obj("memlord.samples", value)
        if samples is None:
            return
        devices = self.lst("memlord.samples.devices", samples.get("devices", []))
        for i, dev in enumerate(devices or ()):
            self.device(f"memlord.samples.devices[{i}]", dev)
        self.columns(
            "memlord.samples.columns", samples.get("columns", {}), SAMPLE_COLUMNS, "sample"
        )

    def events(self, value: Any) -> None:
        if not value:
            return
        events = self.obj("memlord.events", value)
        if events is None:
            return
        tables = self.obj("memlord.events.tables", events.get("tables", {}))
        for name, table in (tables or {}).items():
            twhere = f"memlord.events.tables.{name}"
            if name not in EVENT_TABLES.values():
                self.bad(
                    "memlord.events.tables",
                    f"unknown table {name!r} (known: {', '.join(EVENT_TABLES.values())})",
                )
                continue
            table = self.lst(twhere, table)
            for i, s in enumerate(table or ()):
                if name == "devices":
                    self.device(f"{twhere}[{i}]", s)
                elif not self.string(f"{twhere}[{i}]", s):
                    break
        if "columns" not in events:
            self.bad("memlord.events", "missing 'columns'")
            return
        self.columns("memlord.events.columns", events["columns"], EVENT_COLUMNS, "event")

    def memlord(self, value: Any) -> None:
        ml = self.obj("memlord", value)
        if ml is None:
            return
        for key in ("operations", "regions"):
            if key in ml:
                self.spans(f"memlord.{key}", ml[key])
        if "hotspots" in ml:
            self.hotspots(ml["hotspots"])
        if "counters" in ml:
            self.counters(ml["counters"])
        self.samples(ml.get("samples"))
        self.events(ml.get("events"))


def problems(data: Any) -> list[str]:
    """Every problem of a parsed JSON profile, one line each (empty: readable)."""
    check = _Checker()
    if not isinstance(data, dict):
        return [f"the file holds {_kind(data)}, not a JSON object"]
    if "schema" in data and data["schema"] != SCHEMA:
        check.bad("schema", f"expected {SCHEMA!r}, got {_kind(data['schema'])}")
    check.version(data)
    if "metadata" in data:
        check.metadata(data["metadata"])
    if "snapshots" in data:
        check.snapshots(data["snapshots"])
    if "pytorch_operations" in data:
        check.pytorch_operations(data["pytorch_operations"])
    if "memlord" in data:
        check.memlord(data["memlord"])
    elif "operation_allocations" in data:
        check.seed_operations(data["operation_allocations"])
    if check.more:
        check.problems.append(f"... and {check.more} more")
    return check.problems
