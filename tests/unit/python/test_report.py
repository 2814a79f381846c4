"""The profile document and its writers: JSON round trip, the Chrome trace format, torch's
memory snapshot pickle (read by torch.cuda._memory_viz), decimation and lanes, and the
HTML report's escaping and optional extra."""

from __future__ import annotations

import json
import os
import pickle
import socket
from collections import defaultdict

import numpy as np
import pytest
import torch.cuda._memory_viz as memory_viz
from support.lord_work import Work
from support.memory_viz import page_live_bytes
from support.synthetic import synthetic_profile
from support.trace import validate_trace as _validate_trace

from memlord.report import (
    KNOWN_KINDS,
    SCHEMA_VERSION,
    Events,
    Profile,
    Span,
    decimate_indices,
    export,
    format_of,
    lanes,
    load,
    memory_series,
    no_progress,
    to_snapshot,
    write_trace,
)

try:
    import plotly  # noqa: F401

    HAVE_PLOTLY = True
except ImportError:  # pragma: no cover - tox installs the report extra
    HAVE_PLOTLY = False

EVIL = "</script><img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def doc() -> Profile:
    return synthetic_profile(4000, steps=6)


def _hand_profile() -> Profile:
    """Three allocations and one free on cpu, with exact expected numbers."""
    k = KNOWN_KINDS.index
    events = Events(
        {
            "t_ns": [100, 200, 300, 400, 500],
            "kind": [k("alloc"), k("alloc"), k("free"), k("alloc"), k("gc")],
            "device": [0, 0, 0, 0, 0],
            "bytes": [1000, 2000, 1000, 500, 0],
            "address": [0x1000, 0x2000, 0x1000, 0x3000, 0],
            "site": [0, 1, 0, 1, -1],
        },
        devices=["cpu"],
        sites=["a.py:1", "b.py:2"],
    )
    return Profile(
        metadata={"start_ns": 0, "start_unix": 1_700_000_000.0, "generated_at": "x"},
        events=events,
        operations=[Span("op", 50, 450, thread=7, pre_total=0, post_total=2500)],
    )


# ---- the document -----------------------------------------------------------------------


def test_json_round_trip_is_exact(doc, tmp_path):
    path = tmp_path / "p.json"
    assert export(doc, path) == "json"
    back = load(path)
    assert back == doc
    assert len(back.events) == len(doc.events) > 4000
    # a second round trip writes the same bytes
    export(back, tmp_path / "q.json")
    assert (tmp_path / "q.json").read_bytes() == path.read_bytes()


def test_json_has_the_seed_schema_and_memlord_sections(doc, tmp_path):
    path = tmp_path / "p.json"
    export(doc, path)
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == data["metadata"]["schema_version"]
    assert data["metadata"]["num_snapshots"] == 1
    assert data["metadata"]["operation_tracking_enabled"] is True
    snap = data["snapshots"][0]
    tensors = snap["device_breakdown"]["cuda:0"]["tensors"]
    assert tensors[0]["shape"] == [768, 256] and tensors[0]["size_mb"] == 0.75
    summary = data["operation_summary"]
    assert summary["step"]["invocation_count"] == 6
    assert summary["forward"]["avg_memory_delta_mb"] == -0.0625
    assert summary["optimizer"]["max_memory_delta_mb"] == 0.0625
    assert len(data["operation_allocations"]["backward"]) == 6
    assert data["operation_allocations"]["backward"][0]["memory_delta_mb"] == 0.0
    assert data["pytorch_operations"][0]["op_name"] == "aten::mm"
    ml = data["memlord"]
    assert set(ml) == {"operations", "regions", "hotspots", "counters", "samples", "events"}
    assert ml["events"]["count"] == len(doc.events)
    assert set(ml["events"]["columns"]) == {
        "t_ns",
        "kind",
        "source",
        "device",
        "bytes",
        "address",
        "site",
        "thread",
        "region",
        "lifetime_ns",
        "category",
    }
    assert ml["events"]["tables"]["devices"] == ["cpu", "cuda:0"]


def test_memory_profiler_files_load(tmp_path):
    """A file in the memory profiler's own schema (no memlord section) loads: its
    operation calls become operations, its snapshots are kept."""
    seed = {
        "metadata": {"generated_at": "2025-01-13T10:30:00", "num_snapshots": 1},
        "snapshots": [{"timestamp": "2025-01-13T10:29:45", "total_mb": 1.5}],
        "operation_allocations": {
            "model_forward": [
                {
                    "memory_delta_mb": 0.5,
                    "tensor_delta": 3,
                    "pre_total_mb": 1.0,
                    "post_total_mb": 1.5,
                    "timestamp": "2025-01-13T10:29:45",
                }
            ]
        },
        "operation_summary": {},
    }
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(seed))
    back = load(path)
    assert [s.name for s in back.operations] == ["model_forward"]
    assert back.operations[0].memory_delta == 512 * 1024
    assert back.operations[0].tensor_delta == 3
    assert back.snapshots == seed["snapshots"]


def test_memory_profiler_files_report_their_snapshots_memory(tmp_path):
    """A memory profiler file's memory is in its snapshots: the report of one shows each
    device's bytes as the file measured them (`total_bytes`, else `total_mb`), at each
    snapshot's time, not 0 B and an empty timeline."""
    mib = 1024 * 1024
    seed = {
        "metadata": {"generated_at": "2025-01-13T10:30:00", "num_snapshots": 2},
        "snapshots": [
            {
                "timestamp": "2025-01-13T10:29:45",
                "total_mb": 2048.5,
                "device_breakdown": {"mps": {"total_mb": 2000.0, "count": 3, "tensors": []}},
            },
            {
                "timestamp": "2025-01-13T10:29:50.5",
                "total_mb": 1.0,
                "device_breakdown": {
                    "mps": {"total_mb": 1.0, "total_bytes": 1000, "count": 1, "tensors": []}
                },
            },
        ],
        "operation_allocations": {},
    }
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(seed))
    doc = load(path)
    series = memory_series(doc)["mps"]
    assert series.allocated.tolist() == [2000 * mib, 1000]
    assert series.t_ns[1] - series.t_ns[0] == 5_500_000_000
    snap = to_snapshot(doc)
    assert snap["segments"][0]["total_size"] == 2000 * mib  # the peak
    assert snap["segments"][0]["allocated_size"] == 1000  # at the end
    if HAVE_PLOTLY:
        export(doc, tmp_path / "seed.html")
        devices = (tmp_path / "seed.html").read_text().split("<h2>Devices</h2>")[1]
        row = devices.split("<tbody>")[1].split("</tr>")[0]
        assert '<td class="num">1.95 GiB</td><td class="num">1000 B</td>' in row, row


def test_load_rejects_garbage_and_newer_schema(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON profile"):
        load(bad)
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1}))
    with pytest.raises(ValueError, match="schema_version"):
        load(newer)


def test_events_validate_their_columns():
    with pytest.raises(ValueError, match="rows"):
        Events({"t_ns": [1, 2], "bytes": [1]})
    with pytest.raises(ValueError, match="unknown event column"):
        Events({"when": [1]})
    with pytest.raises(ValueError, match="indexes past its table"):
        Events({"device": [3]}, devices=["cpu"])
    ev = Events({"t_ns": [5]}, devices=["cpu"])
    assert ev["site"].tolist() == [-1] and ev["lifetime_ns"].tolist() == [-1]
    assert ev["t_ns"].dtype == np.int64 and ev["address"].dtype == np.uint64


def test_memory_series_from_events_by_hand():
    doc = _hand_profile()
    s = memory_series(doc)["cpu"]
    assert s.source == "events"
    assert s.allocated.tolist() == [1000, 3000, 2000, 2500, 2500]
    assert s.peak.tolist() == [1000, 3000, 3000, 3000, 3000]
    assert s.reserved is None


def test_pending_and_reserved_series():
    k = KNOWN_KINDS.index
    doc = Profile(
        events=Events(
            {
                "t_ns": [1, 2, 3, 4, 5],
                "kind": [
                    k("alloc"),
                    k("reserved"),
                    k("free_requested"),
                    k("free_completed"),
                    k("reserved"),
                ],
                "device": [0] * 5,
                "bytes": [100, 4096, 100, 100, 2048],
            },
            devices=["cuda:0"],
        )
    )
    s = memory_series(doc)["cuda:0"]
    assert s.allocated.tolist() == [100, 100, 100, 0, 0]
    assert s.pending.tolist() == [0, 0, 100, 0, 0]
    assert s.reserved.tolist() == [-1, 4096, 4096, 4096, 2048]


# ---- decimation and lanes ----------------------------------------------------------------


def test_decimation_keeps_every_bucket_extreme():
    rng = np.random.default_rng(1)
    n, buckets = 200_000, 500
    t = np.sort(rng.integers(0, 10**9, size=n))
    y = np.cumsum(rng.integers(-1000, 1001, size=n))
    y[123_457] += 10**7  # a one-event spike
    idx = decimate_indices(t, [y], buckets)
    assert len(idx) <= 2 * buckets + 2
    assert np.all(np.diff(idx) > 0)
    assert y[idx].max() == y.max() and y[idx].min() == y.min()
    assert 123_457 in idx
    bucket = ((t - t[0]) * (buckets / (t[-1] - t[0]))).astype(np.int64).clip(0, buckets - 1)
    for b in rng.choice(buckets, 20, replace=False):
        sel = bucket == b
        if sel.any():
            kept = y[idx][bucket[idx] == b]
            assert kept.max() == y[sel].max() and kept.min() == y[sel].min()


def test_short_series_are_not_decimated():
    t = np.arange(10)
    assert decimate_indices(t, [t], 100).tolist() == list(range(10))


def test_lanes_are_compact_and_never_overlap():
    rng = np.random.default_rng(2)
    spans = []
    for _ in range(300):
        a = int(rng.integers(0, 10_000))
        spans.append(Span("x", a, a + int(rng.integers(1, 500))))
    lane_of = lanes(spans)
    by_lane = defaultdict(list)
    for s, lane in zip(spans, lane_of, strict=True):
        by_lane[lane].append(s)
    for members in by_lane.values():
        members.sort(key=lambda s: s.start_ns)
        for a, b in zip(members, members[1:], strict=False):
            assert a.end_ns <= b.start_ns
    # the number of lanes is the highest concurrency
    points = sorted([(s.start_ns, 1) for s in spans] + [(s.end_ns, -1) for s in spans])
    depth = best = 0
    for _, d in points:
        depth += d
        best = max(best, depth)
    assert max(lane_of) + 1 == best


# ---- the trace ------------------------------------------------------------------------------


def test_trace_is_well_formed(doc, tmp_path):
    path = tmp_path / "p.trace.json"
    assert export(doc, path) == "trace"
    events = _validate_trace(json.loads(path.read_text()))
    counters = defaultdict(list)
    for e in events:
        if e["ph"] == "C":
            counters[e["name"]].append(e)
    assert set(counters) == {"memory cpu", "memory cuda:0"}
    series = memory_series(doc)
    for dev, s in series.items():
        track = counters[f"memory {dev}"]
        assert len(track) == len(s)
        assert [e["args"]["allocated"] for e in track] == s.allocated.tolist()
    assert "reserved" in counters["memory cuda:0"][-1]["args"]
    assert "reserved" not in counters["memory cpu"][-1]["args"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(doc.operations)
    assert {e["name"] for e in events if e["ph"] == "i"} == {"auto-GC cuda:0", "OOM cuda:0"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"MainThread", "data_loader", "memory", "synthetic profile"} <= names


def test_trace_by_hand_and_user_strings_survive(tmp_path):
    doc = _hand_profile()
    doc.operations[0].name = EVIL
    path = tmp_path / "h.trace.json"
    export(doc, path)
    events = _validate_trace(json.loads(path.read_text()))
    (x,) = [e for e in events if e["ph"] == "X"]
    assert x["name"] == EVIL and x["ts"] == 0.05 and x["dur"] == 0.4
    assert x["args"]["memory_delta"] == 2500
    c = [e for e in events if e["ph"] == "C"]
    assert [e["ts"] for e in c] == [0.1, 0.2, 0.3, 0.4, 0.5]


def _ranked(pid: int | None, host: str | None, rank: int | None) -> Profile:
    doc = _hand_profile()
    md = {"pid": pid, "host": host, "rank": rank, "world_size": None if rank is None else 2}
    doc.metadata.update({k: v for k, v in md.items() if v is not None})
    return doc


def _processes(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}


def test_traces_of_two_processes_loaded_together_keep_their_own_tracks(tmp_path):
    """Every trace was pid 1: two ranks' traces (or any two processes') loaded together in
    Perfetto or chrome://tracing drew their counters and threads on the same tracks.  Each
    trace now is the profiled process's pid, named with its rank and host, and the events
    of two traces put together stay two processes."""
    merged: list[dict] = []
    for rank, (pid, host) in enumerate([(4242, "node-a"), (4343, "node-b")]):
        path = tmp_path / f"r{rank}.trace.json"
        write_trace(_ranked(pid, host, rank), path)
        events = _validate_trace(json.loads(path.read_text()))
        assert {e["pid"] for e in events} == {pid}
        assert _processes(events) == {pid: f"memlord (rank {rank} of 2, {host})"}
        merged += events
    both = _validate_trace({"traceEvents": merged})
    assert _processes(both) == {
        4242: "memlord (rank 0 of 2, node-a)",
        4343: "memlord (rank 1 of 2, node-b)",
    }
    tracks = {(e["pid"], e["name"]) for e in both if e["ph"] == "C"}
    assert tracks == {(4242, "memory cpu"), (4343, "memory cpu")}
    threads = {(e["pid"], e["tid"]) for e in both if e["ph"] == "X"}
    assert len(threads) == 2
    # the ranks in order in the UI
    order = {e["pid"]: e["args"]["sort_index"] for e in both if e["name"] == "process_sort_index"}
    assert order == {4242: 0, 4343: 1}


def test_a_trace_is_the_pid_of_the_process_it_profiled(tmp_path):
    work = Work()
    try:
        path = tmp_path / "w.trace.json"
        work.lord.export(path)
    finally:
        work.close()
    events = _validate_trace(json.loads(path.read_text()))
    assert {e["pid"] for e in events} == {os.getpid()}
    (name,) = _processes(events).values()
    assert name.startswith("memlord lord export (") and socket.gethostname() in name


@pytest.mark.parametrize("pid", [None, 0, -5, True, "123", 2**40])
def test_a_trace_without_a_usable_pid_is_pid_1(tmp_path, pid):
    doc = _hand_profile()
    if pid is not None:
        doc.metadata["pid"] = pid
    path = tmp_path / "h.trace.json"
    write_trace(doc, path)
    events = _validate_trace(json.loads(path.read_text()))
    assert {e["pid"] for e in events} == {1}
    assert _processes(events) == {1: "memlord"}


# ---- the pickle ---------------------------------------------------------------------------


def test_pickle_is_read_by_torch_memory_viz(doc, tmp_path):
    path = tmp_path / "p.pickle"
    assert export(doc, path) == "pickle"
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    assert len(snap["segments"]) == 2  # one synthetic segment per device
    assert snap["memlord_devices"] == ["cuda:0", "cpu"]  # cuda:N keeps index N
    series = memory_series(doc)
    final = {d: int(s.allocated[-1]) for d, s in series.items()}
    # segsum checks that blocks add up to each segment and reports totals
    text = memory_viz.segsum(snap)
    assert "segments: 2" in text
    assert f"total_allocated: {memory_viz.Bytes(sum(final.values()))}" in text
    out = memory_viz.trace(snap)
    assert "Device 0" in out and "Device 1" in out and "raise OutOfMemoryError" in out
    # the flamegraph inputs: one line per block, bytes at the end
    lines = memory_viz.memory(snap, format_flamegraph=lambda s: s)
    total = sum(
        int(line.rsplit(" ", 1)[1]) for line in lines.splitlines() if ";active_allocated;" in line
    )
    assert total == sum(final.values())
    assert "train.py" in memory_viz.segments(snap, format_flamegraph=lambda s: s)
    html = memory_viz.trace_plot(snap)
    assert "snapshot.pickle" in html
    # free_requested/free_completed pairs are recognised
    filtered = memory_viz.filter_alloc_free_pairs(pickle.loads(path.read_bytes()))
    alive = sum(e["size"] for t in filtered["device_traces"] for e in t if e["action"] == "alloc")
    assert alive == sum(final.values())


def test_pickle_by_hand():
    snap = to_snapshot(_hand_profile())
    (seg,) = snap["segments"]
    assert seg["total_size"] == 3000 and seg["allocated_size"] == 2500
    states = [(b["state"], b["size"]) for b in seg["blocks"]]
    assert states == [("active_allocated", 2000), ("active_allocated", 500), ("inactive", 500)]
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == ["alloc", "alloc", "free_requested", "free_completed", "alloc"]
    assert snap["device_traces"][0][0]["frames"] == [{"filename": "a.py", "line": 1, "name": "?"}]


# ---- export's arguments and the HTML extra ---------------------------------------------------


def test_export_rejects_bad_arguments(doc, tmp_path):
    with pytest.raises(TypeError, match="'doc' must be"):
        export({"metadata": {}}, tmp_path / "x.json")
    with pytest.raises(TypeError, match="'path' must be"):
        export(doc, 3)
    with pytest.raises(ValueError, match=r"unknown report format.*\.trace\.json"):
        export(doc, tmp_path / "x.csv")
    assert list(tmp_path.iterdir()) == []
    assert [format_of(p) for p in ("a.JSON", "a.trace.json", "a.pkl", "a.htm")] == [
        "json",
        "trace",
        "pickle",
        "html",
    ]


def _public_calls(doc, path, progress=no_progress):
    """Every public function of memlord.report that takes a document, as (name, call)."""
    from memlord.report import dumps, to_dict, write_html, write_json, write_pickle, write_trace

    return [
        ("export", lambda: export(doc, path, progress=progress)),
        ("write_json", lambda: write_json(doc, path, progress)),
        ("write_trace", lambda: write_trace(doc, path, progress)),
        ("write_pickle", lambda: write_pickle(doc, path, progress)),
        ("write_html", lambda: write_html(doc, path, progress)),
        ("to_snapshot", lambda: to_snapshot(doc, progress)),
        ("dumps", lambda: dumps(doc, progress)),
        ("to_dict", lambda: to_dict(doc)),
        ("memory_series", lambda: memory_series(doc)),
    ]


@pytest.mark.parametrize("bad", [None, {"metadata": {}}, "profile.json"])
def test_public_functions_name_a_wrong_document(tmp_path, bad):
    """A document that is not a Profile is a TypeError naming the function and 'doc' (not
    an AttributeError from inside a writer), and nothing is written."""
    for name, call in _public_calls(bad, tmp_path / "x.json"):
        with pytest.raises(TypeError, match=rf"{name}\(\): argument 'doc' must be a "):
            call()
    assert list(tmp_path.iterdir()) == []


def test_public_functions_name_a_wrong_path_or_progress(tmp_path):
    doc = _hand_profile()
    for name, call in _public_calls(doc, 3)[:5]:
        with pytest.raises(TypeError, match=rf"{name}\(\): argument 'path' must be a str"):
            call()
    for name, call in _public_calls(doc, tmp_path / "x.json", progress=1)[:7]:
        with pytest.raises(TypeError, match=rf"{name}\(\): argument 'progress' must be callable"):
            call()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match=r"format_of\(\): argument 'path'"):
        format_of(None)
    t = np.arange(10_000)
    with pytest.raises(ValueError, match=r"argument 'buckets' must be >= 1, got 0"):
        decimate_indices(t, [t], 0)
    with pytest.raises(TypeError, match=r"argument 'buckets' must be an int, not float"):
        decimate_indices(t, [t], 1.5)


@pytest.mark.parametrize("path", [None, b"profile.json", 1.5, "fd"])
def test_load_refuses_a_path_that_is_not_one_and_leaves_file_descriptors_alone(doc, tmp_path, path):
    """``load(path)`` takes a str or os.PathLike, like ``export`` and
    ``load_post_mortem``: an int would be opened as a file descriptor, read, and closed
    (another part of the program's file, socket or pipe); it is a TypeError naming
    ``path``, and the descriptor stays open."""
    export(doc, tmp_path / "p.json")
    fd = os.open(tmp_path / "p.json", os.O_RDONLY)
    try:
        with pytest.raises(
            TypeError, match=r"load\(\): argument 'path' must be a str or os\.PathLike"
        ):
            load(fd if path == "fd" else path)
        os.fstat(fd)  # still open (OSError: Bad file descriptor when load closed it)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # and unread
    finally:
        os.close(fd)


def test_html_without_plotly_names_the_extra(doc, tmp_path, no_plotly):
    with pytest.raises(ImportError, match=r"pip install memlord\[report\]"):
        export(doc, tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()


def test_html_escapes_user_strings(tmp_path):
    pytest.importorskip("plotly", reason="the HTML report needs the report extra")
    doc = synthetic_profile(2000, steps=2, names=(EVIL, "ok"), devices=("cpu", "cuda:0"))
    doc.metadata["title"] = EVIL
    doc.hotspots[0]["site"] = EVIL
    doc.snapshots[0]["checkpoint_name"] = EVIL
    path = tmp_path / "r.html"
    assert export(doc, path) == "html"
    text = path.read_text()
    assert "<img src=x" not in text
    assert "onerror=alert(1)>" not in text
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in text  # the header, tables
    # the only </script> tags close memlord's own three scripts
    assert text.count("</script>") == 3


@pytest.mark.parametrize("suffix", [".json", ".trace.json", ".pickle", ".html"])
def test_strings_python_could_not_decode_are_written(tmp_path, suffix):
    """An argument or a path that is not UTF-8 reaches Python as lone surrogates
    (surrogateescape: `python -m memlord run --html r.html train.py $'\\xff'` puts one in
    the title): every format is still written, as UTF-8, the character as its escape."""
    if suffix == ".html":
        pytest.importorskip("plotly", reason="the HTML report needs the report extra")
    doc = _hand_profile()
    doc.metadata["title"] = "run train.py \udcff"
    doc.operations[0].name = "op \udcfe"
    path = tmp_path / f"r{suffix}"
    assert export(doc, path) == format_of(path)
    if suffix != ".pickle":
        text = path.read_bytes().decode("utf-8")  # strict: valid UTF-8
        assert "\\udcff" in text and "\\udcfe" in text


def test_memory_viz_page_shows_each_live_allocation_once(tmp_path):
    """torch's memory_viz page matches the trace's allocations to the segment's blocks by
    address: an allocation live at the end is one block, not a block plus a trace
    allocation, and every freed block lies in the segment."""
    snap = to_snapshot(_hand_profile())
    assert page_live_bytes(snap, 0) == 2500 == snap["segments"][0]["allocated_size"]
    work = Work()
    try:
        path = tmp_path / "w.pickle"
        work.lord.export(path)
        snap = pickle.loads(path.read_bytes())
        for i, dev in enumerate(snap["memlord_devices"]):
            seg = snap["segments"][i]
            assert seg["memlord_device"] == dev
            assert (
                page_live_bytes(snap, i)
                == seg["allocated_size"]
                == work.lord.stats()[dev]["allocated"]
            )
    finally:
        work.close()
