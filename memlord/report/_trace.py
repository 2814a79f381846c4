"""Chrome Trace Event format (JSON object form), for Perfetto and chrome://tracing.

One process, the profiled process's pid (``metadata["pid"]``; 1 when unknown), named
after the profile's title with its rank and host where known, holds: a counter track per
device ("ph": "C", named ``memory <device>``, with ``allocated``, ``pending`` and, where
known, ``reserved`` in bytes), one thread per recorded Python thread with its operation
and region slices ("ph": "X"), instant events for auto-GC runs and OOMs ("ph": "i"), and
process and thread names and the rank as the process's sort index ("ph": "M").  Times are
microseconds since the start of the profile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._model import Profile, check_arguments
from ._series import memory_series
from ._util import Progress, atomic_write, no_progress, plain_int, unix_s

PID = 1  # a trace's pid when the profile does not say its process's
#: the largest pid a trace keeps (Perfetto's JSON importer reads pids as 32-bit integers)
MAX_PID = 2**31 - 1
COUNTER_TID = 0


def trace_pid(metadata: dict[str, Any]) -> int:
    """The pid a profile's trace uses: the profiled process's (``metadata["pid"]``), or
    :data:`PID` when the metadata has no pid a trace can hold."""
    pid = plain_int(metadata.get("pid"))
    return pid if pid is not None and 0 < pid <= MAX_PID else PID


def process_name(metadata: dict[str, Any]) -> str:
    """The trace's process name: the title, then the rank (``of <world_size>``) and host
    where the metadata says them: ``train (rank 1 of 8, node-b)``."""
    title = str(metadata.get("title") or "memlord")
    where = []
    rank, world = plain_int(metadata.get("rank")), plain_int(metadata.get("world_size"))
    if rank is not None:
        if world is not None:
            where.append(f"rank {rank} of {world}")
        else:
            where.append(f"rank {rank}")
    host = metadata.get("host")
    if isinstance(host, str) and host:
        where.append(host)
    return f"{title} ({', '.join(where)})" if where else title


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
    title = doc.metadata.get("title") or "memlord"
    yield '{"displayTimeUnit":"ms","otherData":'
    yield json.dumps({"memlord_schema_version": doc.schema_version, "title": str(title)})
    yield ',"traceEvents":[\n'
    yield from _process(doc, trace_pid(doc.metadata), 0, progress)
    yield "\n]}\n"
    progress(1.0, "trace")


def _process(doc: Profile, pid: int, shift_ns: int, progress: Progress) -> Iterator[str]:
    """The events of one profile's process, comma-separated: pid ``pid``, its times
    ``shift_ns`` (>= 0) after the start of the trace."""
    base = _base_ns(doc) - shift_ns
    dumps = json.dumps
    tids = _thread_ids(doc)
    thread_names = doc.metadata.get("threads", {})
    meta: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": pid,
            "tid": 0,
            "args": {"name": process_name(doc.metadata)},
        },
        {
            "ph": "M",
            "name": "thread_name",
            "pid": pid,
            "tid": COUNTER_TID,
            "args": {"name": "memory"},
        },
    ]
    rank = plain_int(doc.metadata.get("rank"))
    if rank is not None and 0 <= rank <= MAX_PID:
        # the ranks' processes in rank order when several traces are loaded together
        meta.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
    for ident, tid in tids.items():
        name = thread_names.get(str(ident)) or f"thread {ident}"
        meta.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": str(name)}}
        )
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
        head = dumps({"ph": "X", "cat": s.kind, "name": s.name, "pid": pid, "tid": tids[s.thread]})
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
                    f',\n{{"ph":"C","name":{name},"pid":{pid},"tid":{COUNTER_TID},'
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
            head = dumps({"ph": "i", "s": "p", "cat": kind, "name": f"{label} {dev}", "pid": pid})
            instant = dumps({"device": dev, "bytes": int(ev["bytes"][i])})
            ts = _us(int(ev["t_ns"][i]) - base)
            yield f',\n{head[:-1]},"tid":{COUNTER_TID},"ts":{ts},"args":{instant}}}'


def _wall_ns(doc: Profile) -> int | None:
    """The wall-clock time (ns since the epoch) of the trace's origin for ``doc`` (its
    earliest time); None when the metadata does not say (:func:`unix_s`)."""
    unix = unix_s(doc.metadata, _base_ns(doc))
    return None if unix is None else round(unix * 1e9)


def merged_trace_layout(docs: list[Profile]) -> list[tuple[int, int]]:
    """(pid, shift in ns) of each profile in one trace of them all: its own pid where no
    earlier profile has it (processes on different hosts, or a reused pid, may share
    one: the later gets the lowest pid free above every profile's), and its times
    placed by the wall clock, the earliest profile's start at 0 (a profile whose
    metadata has no wall clock starts at 0)."""
    walls = [_wall_ns(d) for d in docs]
    known = [w for w in walls if w is not None]
    origin = min(known) if known else 0
    wanted = [trace_pid(d.metadata) for d in docs]
    used: set[int] = set()
    spare = max(wanted, default=PID)
    out = []
    for want, wall in zip(wanted, walls, strict=True):
        pid = want
        if pid in used:
            spare += 1
            while spare in used or spare in wanted:
                spare += 1
            pid = spare
        used.add(pid)
        out.append((pid, 0 if wall is None else wall - origin))
    return out


def merged_chunks(docs: list[Profile], progress: Progress = no_progress) -> Iterator[str]:
    """One trace of several profiles (the ranks' of one job): a process per profile, as
    its own trace has it (its name with rank and host, the rank as its sort index), on
    one time line (:func:`merged_trace_layout`)."""
    yield '{"displayTimeUnit":"ms","otherData":'
    yield json.dumps(
        {
            "memlord_schema_version": max(d.schema_version for d in docs),
            "title": f"memlord merge of {len(docs)} profile(s)",
        }
    )
    yield ',"traceEvents":[\n'
    n = len(docs)
    for i, (doc, (pid, shift)) in enumerate(zip(docs, merged_trace_layout(docs), strict=True)):
        if i:
            yield ",\n"

        def part(frac: float, what: str, i: int = i) -> None:
            progress((i + frac) / n, what)

        yield from _process(doc, pid, shift, part)
    yield "\n]}\n"
    progress(1.0, "trace")


def write_trace(
    doc: Profile, path: str | os.PathLike[str], progress: Progress = no_progress
) -> None:
    check_arguments("write_trace", doc, path, progress)
    with atomic_write(path) as f:
        for chunk in _chunks(doc, progress):
            f.write(chunk)
