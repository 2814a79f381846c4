"""Chrome Trace Event format (JSON object form), for Perfetto and chrome://tracing.

One process (pid 1) holds: a counter track per device ("ph": "C", named
``memory <device>``, with ``allocated``, ``pending`` and, where known, ``reserved`` in
bytes), one thread per recorded Python thread with its operation and region slices
("ph": "X"), instant events for auto-GC runs and OOMs ("ph": "i"), and process and thread
names ("ph": "M").  Times are microseconds since the start of the profile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._model import Profile, check_arguments
from ._series import memory_series
from ._util import Progress, atomic_write, no_progress

PID = 1
COUNTER_TID = 0


def _us(ns: int) -> str:
    """Non-negative ns as exact microseconds with 3 decimals."""
    q, r = divmod(int(ns), 1000)
    return f"{q}.{r:03d}"


def _thread_ids(doc: Profile) -> dict[int, int]:
    tids: dict[int, int] = {}
    for s in sorted(doc.spans(), key=lambda s: s.start_ns):
        if s.thread not in tids:
            tids[s.thread] = len(tids) + 1
    return tids


def _base_ns(doc: Profile) -> int:
    times = [doc.t0_ns()]
    times += [s.start_ns for s in doc.spans()]
    if len(doc.events):
        times.append(int(doc.events["t_ns"].min()))
    if len(doc.samples):
        times.append(int(doc.samples["t_ns"].min()))
    return min(times)


def _chunks(doc: Profile, progress: Progress) -> Iterator[str]:
    base = _base_ns(doc)
    dumps = json.dumps
    title = doc.metadata.get("title") or "memlord"
    tids = _thread_ids(doc)
    thread_names = doc.metadata.get("threads", {})
    meta: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "args": {"name": str(title)}},
        {
            "ph": "M",
            "name": "thread_name",
            "pid": PID,
            "tid": COUNTER_TID,
            "args": {"name": "memory"},
        },
    ]
    for ident, tid in tids.items():
        name = thread_names.get(str(ident)) or f"thread {ident}"
        meta.append(
            {"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": str(name)}}
        )
    yield '{"displayTimeUnit":"ms","otherData":'
    yield dumps({"memlord_schema_version": doc.schema_version, "title": str(title)})
    yield ',"traceEvents":[\n'
    yield ",\n".join(dumps(m) for m in meta)

    # slices
    spans = sorted(doc.spans(), key=lambda s: (s.start_ns, -s.end_ns))
    for s in spans:
        args = {
            "memory_delta": s.memory_delta,
            "pre_total": s.pre_total,
            "post_total": s.post_total,
            "tensor_delta": s.tensor_delta,
        }
        for dev, d in s.delta.items():
            args[f"delta {dev}"] = d
        for dev, p in s.peak.items():
            args[f"peak {dev}"] = p
        for dev, cats in s.categories.items():
            for cat, c in cats.items():
                args[f"delta {dev} {cat}"] = c.get("delta", 0)
        if not s.finished:
            args["unfinished"] = True
        head = dumps({"ph": "X", "cat": s.kind, "name": s.name, "pid": PID, "tid": tids[s.thread]})
        ts, dur = _us(s.start_ns - base), _us(max(s.end_ns - s.start_ns, 0))
        yield f',\n{head[:-1]},"ts":{ts},"dur":{dur},"args":{dumps(args)}}}'

    progress(0.1, "trace slices")

    # counters, one track per device
    series = memory_series(doc)
    done = 0
    tracks = []
    for dev, ser in series.items():
        cols = [("allocated", ser.allocated), ("pending", ser.pending)]
        if ser.reserved is not None:
            cols.append(("reserved", ser.reserved))
        tracks.append((ser, f"memory {dev}", cols))
        if ser.categories:  # allocated by category: one counter of stacked values
            tracks.append((ser, f"memory {dev} by category", list(ser.categories.items())))
    total = sum(len(t[0]) for t in tracks) or 1
    for ser, track, cols in tracks:
        name = dumps(track)
        times = ser.t_ns - base
        n = len(ser)
        step = 65536
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            t_list = times[lo:hi].tolist()
            values = [c[lo:hi].tolist() for _, c in cols]
            parts = []
            for j, t in enumerate(t_list):
                counters = ",".join(
                    f"{dumps(cname)}:{vals[j]}"
                    for (cname, _), vals in zip(cols, values, strict=True)
                    if vals[j] >= 0
                )
                parts.append(
                    f',\n{{"ph":"C","name":{name},"pid":{PID},"tid":{COUNTER_TID},'
                    f'"ts":{_us(t)},"args":{{{counters}}}}}'
                )
            yield "".join(parts)
            done += hi - lo
            progress(0.1 + 0.85 * done / total, "trace counters")

    # instants: auto-GC and OOM
    ev = doc.events
    for kind, label in (("gc", "auto-GC"), ("oom", "OOM")):
        if kind not in ev.kinds:
            continue
        idx = np.flatnonzero(ev["kind"] == ev.kinds.index(kind))
        for i in idx.tolist():
            dev = ev.devices[int(ev["device"][i])] if ev.devices else "?"
            head = dumps({"ph": "i", "s": "p", "cat": kind, "name": f"{label} {dev}", "pid": PID})
            instant = dumps({"device": dev, "bytes": int(ev["bytes"][i])})
            ts = _us(int(ev["t_ns"][i]) - base)
            yield f',\n{head[:-1]},"tid":{COUNTER_TID},"ts":{ts},"args":{instant}}}'

    yield "\n]}\n"
    progress(1.0, "trace")


def write_trace(
    doc: Profile, path: str | os.PathLike[str], progress: Progress = no_progress
) -> None:
    check_arguments("write_trace", doc, path, progress)
    with atomic_write(path) as f:
        for chunk in _chunks(doc, progress):
            f.write(chunk)
