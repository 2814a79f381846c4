"""The JSON writer and reader (schema in docs/reports.md)."""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from ._model import (
    EVENT_COLUMNS,
    EVENT_TABLES,
    SAMPLE_COLUMNS,
    SCHEMA,
    SCHEMA_VERSION,
    Events,
    Profile,
    SampleBuilder,
    Samples,
    Span,
    check_arguments,
)
from ._util import Progress, atomic_write, iso_time, no_progress
from ._validate import ProfileError, problems


def _default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def _array(arr: np.ndarray) -> str:
    """A 1-D integer array as a JSON list, fast (no per-element json.dumps)."""
    if arr.size == 0:
        return "[]"
    return "[" + ",".join(map(str, arr.tolist())) + "]"


def to_dict(doc: Profile) -> dict[str, Any]:
    """The document as JSON-ready Python objects (events and samples as lists)."""
    check_arguments("to_dict", doc)
    return cast("dict[str, Any]", json.loads(dumps(doc)))


def _head(doc: Profile) -> dict[str, Any]:
    metadata = dict(doc.metadata)
    metadata.setdefault("generated_at", _dt.datetime.now().isoformat(timespec="seconds"))
    metadata["num_snapshots"] = len(doc.snapshots)
    metadata.setdefault("operation_tracking_enabled", bool(doc.operations))
    metadata["schema_version"] = doc.schema_version
    return {
        "schema": SCHEMA,
        "schema_version": doc.schema_version,
        "metadata": metadata,
        "snapshots": doc.snapshots,
        "operation_allocations": doc.operation_allocations(),
        "operation_summary": doc.operation_summary(),
        "pytorch_operations": doc.pytorch_operations,
        "memlord": {
            "operations": [s.to_json() for s in doc.operations],
            "regions": [s.to_json() for s in doc.regions],
            "hotspots": doc.hotspots,
            "counters": doc.counters,
            "samples": {
                "devices": doc.samples.devices,
                "columns": {c: doc.samples.columns[c].tolist() for c in SAMPLE_COLUMNS},
            },
        },
    }


def _chunks(doc: Profile, progress: Progress) -> Iterator[str]:
    head = json.dumps(_head(doc), default=_default, separators=(",", ":"))
    # "memlord" is the last key of the head and of its own object: the events go in
    # just before the two closing braces.
    assert head.endswith("}}")
    yield head[:-2]
    ev = doc.events
    yield f',"events":{{"count":{len(ev)},"tables":'
    yield json.dumps(ev.tables(), separators=(",", ":"))
    yield ',"columns":{'
    for i, col in enumerate(EVENT_COLUMNS):
        progress(i / len(EVENT_COLUMNS), f"events.{col}")
        yield ("," if i else "") + json.dumps(col) + ":" + _array(ev.columns[col])
    yield "}}}}\n"
    progress(1.0, "json")


def dumps(doc: Profile, progress: Progress = no_progress) -> str:
    """The document as a JSON string."""
    check_arguments("dumps", doc, progress=progress)
    return "".join(_chunks(doc, progress))


def write_json(
    doc: Profile, path: str | os.PathLike[str], progress: Progress = no_progress
) -> None:
    check_arguments("write_json", doc, path, progress)
    with atomic_write(path) as f:
        for chunk in _chunks(doc, progress):
            f.write(chunk)


# ---- reading ------------------------------------------------------------------------


def from_dict(data: dict[str, Any], *, source: str | None = None) -> Profile:
    """A document from parsed JSON: memlord's own files, or the memory profiler's
    schema (``metadata``, ``snapshots``, ``operation_allocations`` ...) without the
    ``memlord`` section.  A document any writer could not use raises
    :class:`memlord.report.ProfileError` (a ValueError) listing every problem."""
    found = problems(data)
    if found:
        raise ProfileError(found, source)
    try:
        return _build(data)
    except ValueError as exc:  # what only the built columns show (an index past its table)
        raise ProfileError([str(exc)], source) from None


def _build(data: dict[str, Any]) -> Profile:
    ml = data.get("memlord")
    metadata = dict(data.get("metadata", {}))
    for derived in ("num_snapshots", "schema_version"):
        metadata.pop(derived, None)
    doc = Profile(
        metadata=metadata,
        snapshots=list(data.get("snapshots", [])),
        pytorch_operations=list(data.get("pytorch_operations", [])),
        schema_version=SCHEMA_VERSION,
    )
    if ml is None:
        doc.operations = _operations_from_seed(data.get("operation_allocations", {}))
        doc.samples = _samples_from_seed(doc.snapshots)
        return doc
    doc.operations = [Span.from_json(s) for s in ml.get("operations", [])]
    doc.regions = [Span.from_json(s) for s in ml.get("regions", [])]
    doc.hotspots = list(ml.get("hotspots", []))
    doc.counters = dict(ml.get("counters", {}))
    samples = ml.get("samples")
    if samples:
        try:
            doc.samples = Samples(samples.get("columns", {}), devices=samples.get("devices", []))
        except ValueError as exc:
            raise ValueError(f"memlord.samples: {exc}") from None
    events = ml.get("events")
    if events:
        tables = events.get("tables", {})
        try:
            doc.events = Events(
                {c: np.asarray(v, dtype=EVENT_COLUMNS[c]) for c, v in events["columns"].items()},
                **{t: tables.get(t, []) for t in EVENT_TABLES.values()},
            )
        except ValueError as exc:
            raise ValueError(f"memlord.events: {exc}") from None
    return doc


def _samples_from_seed(snapshots: list[Any]) -> Samples:
    """Samples from the memory profiler's snapshots: at each snapshot's time (wall clock,
    as its operations), each device's ``total_bytes`` (else ``total_mb``), so the
    timeline, the devices' peaks and the pickle show what the file measured."""
    builder = SampleBuilder()
    for snap in snapshots:
        if not isinstance(snap, dict) or not isinstance(snap.get("device_breakdown"), dict):
            continue
        try:
            t_ns = int(iso_time(snap["timestamp"]) * 1e9)
        except (KeyError, TypeError, ValueError, OverflowError, OSError):
            continue
        for dev, info in snap["device_breakdown"].items():
            if not isinstance(info, dict):
                continue
            total = info.get("total_bytes")
            if not isinstance(total, int) or isinstance(total, bool):
                mb = info.get("total_mb")
                if not isinstance(mb, (int, float)) or isinstance(mb, bool) or not mb >= 0:
                    continue
                total = int(round(mb * 1024 * 1024))
            builder._add(t_ns, str(dev), total)
    return builder.build()


def _operations_from_seed(allocs: dict[str, Any]) -> list[Span]:
    """Spans from the memory profiler's ``operation_allocations`` (timestamps as wall
    clock; a call without a duration lasts 0)."""
    spans = []
    for name, calls in allocs.items():
        for call in calls:
            try:
                start = iso_time(call["timestamp"])
            except (KeyError, TypeError, ValueError, OverflowError, OSError):
                continue
            start_ns = int(start * 1e9)
            dur_ns = int(float(call.get("duration_ms", 0.0)) * 1e6)
            pre = int(round(float(call.get("pre_total_mb", 0.0)) * 1024 * 1024))
            post = int(round(float(call.get("post_total_mb", 0.0)) * 1024 * 1024))
            spans.append(
                Span(
                    name=str(name),
                    start_ns=start_ns,
                    end_ns=start_ns + dur_ns,
                    pre_total=pre,
                    post_total=post,
                    tensor_delta=int(call.get("tensor_delta", 0)),
                )
            )
    spans.sort(key=lambda s: s.start_ns)
    return spans


def load(path: str | os.PathLike[str]) -> Profile:
    """Read a profile written by :func:`memlord.report.export` (``.json``) or by the
    memory profiler."""
    if not isinstance(path, (str, os.PathLike)):  # an int would be opened as a descriptor
        raise TypeError(
            f"load(): argument 'path' must be a str or os.PathLike, not {type(path).__name__}"
        )
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)!r} is not a JSON profile: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"{os.fspath(path)!r} is not a JSON profile (not UTF-8): {exc}"
            ) from None
        except RecursionError:
            raise ValueError(
                f"{os.fspath(path)!r} is not a JSON profile: nested too deeply"
            ) from None
    return from_dict(data, source=os.fspath(path))
