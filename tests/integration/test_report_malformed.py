"""Malformed profiles: ``python -m memlord report`` answers each with one
``memlord: ...`` line per problem and exit status 2, never a traceback; ``load()`` raises
``ProfileError`` (a ValueError) listing them; and whatever ``load()`` accepts converts to
every format (repro r38).

The corpus: the six cases of the repro, hand-made ones for each check, and hypothesis mutations of
real profiles (a lord's export with events, regions and module spans; a profiler's file
with snapshots and operations; a file in the memory profiler's original schema).
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memlord import MemLord
from memlord.cli import main as cli_main
from memlord.report import ProfileError, from_dict, load
from memlord.report._json import dumps
from memlord.report._pickle import to_snapshot
from memlord.report._trace import _chunks as trace_chunks

# (name, document, words the problem line must contain)
CASES = [
    # the six of repro r38
    ("counters_not_dicts", {"memlord": {"counters": {"cpu": 5}}}, ["memlord.counters.cpu"]),
    (
        "unknown_event_column",
        {"memlord": {"events": {"columns": {"nope": [1]}}}},
        ["unknown event column 'nope'"],
    ),
    (
        "operation_missing_times",
        {"memlord": {"operations": [{"name": "a"}]}},
        ["memlord.operations[0]", "missing 'start_ns'"],
    ),
    ("metadata_is_a_list", {"metadata": [1]}, ["metadata: expected an object, got a list"]),
    ("snapshot_not_a_dict", {"snapshots": [1]}, ["snapshots[0]: expected an object"]),
    ("schema_version_string", {"schema_version": "1"}, ["schema_version", "expected an integer"]),
    # more, one per kind of check
    ("not_an_object", [1, 2], ["not a JSON object"]),
    ("schema_newer", {"schema_version": 99}, ["newer than this memlord reads"]),
    ("schema_bool", {"schema_version": True}, ["schema_version", "got true"]),
    ("other_schema", {"schema": "chrome.trace"}, ["schema: expected 'memlord.profile'"]),
    ("start_ns_text", {"metadata": {"start_ns": "5"}}, ["metadata.start_ns"]),
    ("start_unix_huge", {"metadata": {"start_unix": 1e300}}, ["metadata.start_unix"]),
    ("baseline_float", {"metadata": {"event_baseline": {"cpu": 1.5}}}, ["event_baseline.cpu"]),
    (
        "device_index_huge",
        {"memlord": {"counters": {"cuda:99999999": {}}}},
        ["'cuda:99999999' is not a device name"],
    ),
    (
        "tensor_size_text",
        {"snapshots": [{"device_breakdown": {"cpu": {"tensors": [{"size_mb": "big"}]}}}]},
        ["tensors[0].size_mb"],
    ),
    ("op_time_text", {"pytorch_operations": [{"cpu_time_us": "x"}]}, ["cpu_time_us"]),
    (
        "span_name_list",
        {"memlord": {"regions": [{"name": [1], "start_ns": 0, "end_ns": 1}]}},
        ["memlord.regions[0].name"],
    ),
    (
        "span_delta_text",
        {
            "memlord": {
                "regions": [{"name": "r", "start_ns": 0, "end_ns": 1, "delta": {"cpu": "x"}}]
            }
        },
        ["memlord.regions[0].delta.cpu"],
    ),
    ("hotspot_bytes_nan", {"memlord": {"hotspots": [{"bytes": math.nan}]}}, ["hotspots[0].bytes"]),
    (
        "event_index_past_table",
        {"memlord": {"events": {"columns": {"device": [3]}, "tables": {"devices": ["cpu"]}}}},
        ["indexes past its table"],
    ),
    (
        "event_kind_none",
        {"memlord": {"events": {"columns": {"kind": [-1]}, "tables": {"kinds": ["alloc"]}}}},
        ["indexes past its table"],
    ),
    (
        "event_column_text",
        {"memlord": {"events": {"columns": {"bytes": ["1"]}}}},
        ["memlord.events.columns.bytes[0]"],
    ),
    (
        "event_column_range",
        {"memlord": {"events": {"columns": {"kind": [70000]}}}},
        ["memlord.events.columns.kind", "out of range"],
    ),
    (
        "event_rows_differ",
        {"memlord": {"events": {"columns": {"t_ns": [1, 2], "bytes": [1]}}}},
        ["rows"],
    ),
    (
        "sample_column_unknown",
        {"memlord": {"samples": {"columns": {"x": [1]}, "devices": ["cpu"]}}},
        ["unknown sample column 'x'"],
    ),
    (
        "seed_timestamp",
        {"operation_allocations": {"f": [{"timestamp": "yesterday"}]}},
        ["operation_allocations.f[0].timestamp"],
    ),
    (
        "seed_duration_text",
        {
            "operation_allocations": {
                "f": [{"timestamp": "2025-01-13T10:29:45", "duration_ms": "1"}]
            }
        },
        ["duration_ms"],
    ),
]


def _write(tmp_path, name, doc):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def _check_answer(code, err, words, out_paths):
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = _lines(err)
    assert lines and all(line.startswith("memlord: ") for line in lines), lines
    for word in words:
        assert any(word in line for line in lines), (word, lines)
    for out in out_paths:
        assert not os.path.exists(out), f"{out} written for a malformed profile"


@pytest.mark.parametrize(("name", "doc", "words"), CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_report_cli_subprocess_says_one_line_per_problem(tmp_path, name, doc, words):
    """The real command in a real process, for three cases whose unchecked reading would
    raise an AttributeError, a KeyError and a TypeError; every case runs through the same main()
    in process below (a process per case costs seconds each)."""
    src = _write(tmp_path, name, doc)
    out = tmp_path / "out.html"
    proc = subprocess.run(
        [sys.executable, "-m", "memlord", "report", str(src), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    _check_answer(proc.returncode, proc.stderr, words, [out])
    assert proc.stdout == ""
    assert all(line.startswith(f"memlord: {src}: ") for line in _lines(proc.stderr))


def test_report_cli_subprocess_lists_every_problem(tmp_path):
    doc = {"metadata": [1], "snapshots": [1, {"device_breakdown": 3}], "schema_version": "1"}
    src = _write(tmp_path, "many", doc)
    proc = subprocess.run(
        [sys.executable, "-m", "memlord", "report", str(src), "--trace", "t.trace.json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    _check_answer(
        proc.returncode,
        proc.stderr,
        ["schema_version: expected an integer, got a string ('1')", "metadata", "snapshots[0]"],
        [],
    )
    assert "newer" not in proc.stderr
    assert len(_lines(proc.stderr)) == 4, proc.stderr
    assert not (tmp_path / "t.trace.json").exists()


@pytest.mark.parametrize(("name", "doc", "words"), CASES, ids=[c[0] for c in CASES])
def test_report_cli_main_says_one_line_per_problem(tmp_path, capsys, name, doc, words):
    src = _write(tmp_path, name, doc)
    outs = [tmp_path / "o.html", tmp_path / "o.trace.json", tmp_path / "o.pickle"]
    code = cli_main(
        ["report", str(src), "-o", str(outs[0]), "--trace", str(outs[1]), "--pickle", str(outs[2])]
    )
    _check_answer(code, capsys.readouterr().err, words, outs)
    with pytest.raises(ProfileError) as info:
        load(src)
    assert info.value.problems and isinstance(info.value, ValueError)


def test_report_cli_unreadable_input_and_unwritable_output(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"metadata": "\xff\xfe"}')
    assert cli_main(["report", str(bad), "--trace", str(tmp_path / "t.trace.json")]) == 2
    _check_answer(2, capsys.readouterr().err, ["not a JSON profile"], [])
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert cli_main(["report", str(deep), "--trace", str(tmp_path / "t.trace.json")]) == 2
    _check_answer(2, capsys.readouterr().err, ["not a JSON profile"], [])
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"metadata": {}}))
    missing = tmp_path / "no" / "such" / "dir" / "t.trace.json"
    assert cli_main(["report", str(good), "--trace", str(missing)]) == 2
    _check_answer(2, capsys.readouterr().err, ["cannot write", "t.trace.json"], [missing])


# ---- mutations of real profiles ----------------------------------------------------------


def _real_profiles(tmp_dir) -> list[dict]:
    lord = MemLord()
    lord.record_events(1000)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with lord.hook_into_python(), lord.track_modules(model, backward=False):
        with lord.region('step "1"'):
            keep = model(torch.randn(2, 4))
        path = os.path.join(tmp_dir, "lord.json")
        lord.export(path)
    del keep
    lord.record_events(0)
    docs = [json.load(open(path, encoding="utf-8"))]

    from memlord.profiler import MemoryTracker

    json_path = os.path.join(tmp_dir, "tracker.json")
    tracker = MemoryTracker(tmp_dir, True, None, json_path=json_path, install_handlers=False)
    tracker.start()
    try:
        with tracker.track_operation("fwd"):
            keep = model(torch.randn(3, 4))
        tracker.take_snapshot("mid")
    finally:
        tracker.stop()
    del keep
    docs.append(json.load(open(json_path, encoding="utf-8")))
    docs.append(
        {
            "metadata": {"generated_at": "2025-01-13T10:30:00"},
            "snapshots": [{"timestamp": "2025-01-13T10:29:45", "total_mb": 1.5}],
            "operation_allocations": {
                "f": [
                    {
                        "memory_delta_mb": 0.5,
                        "tensor_delta": 3,
                        "pre_total_mb": 1.0,
                        "post_total_mb": 1.5,
                        "timestamp": "2025-01-13T10:29:45",
                        "duration_ms": 2.0,
                    }
                ]
            },
        }
    )
    return docs


@pytest.fixture(scope="module")
def real_profiles(tmp_path_factory):
    docs = _real_profiles(str(tmp_path_factory.mktemp("profiles")))
    for doc in docs:
        from_dict(doc)  # each is readable as it is
    return docs


def _nodes(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj[:3]):
            yield from _nodes(value, (*path, i))


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**400, -1]),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(["cpu", "cuda:0", "cuda:999999", "", "2025-01-13T10:29:45", "alloc"]),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["cpu", "cuda:1", "x", "tensors", "bytes"]), inner, max_size=3
        ),
    ),
    max_leaves=6,
)


@st.composite
def mutated(draw, docs):
    doc = copy.deepcopy(draw(st.sampled_from(docs)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _nodes(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["nope", "cpu", "cuda:0", "name", "x:1"]))] = draw(_JSON)
        else:
            parent[path[-1]] = draw(_JSON)
    return doc


def _convert_all(doc):
    """Every writer, in memory (the HTML one where plotly is installed)."""
    json.loads(dumps(doc))
    json.loads("".join(trace_chunks(doc, lambda f, label: None)))
    pickle.loads(pickle.dumps(to_snapshot(doc)))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_profiles_are_refused_or_convert(real_profiles, data):
    doc = data.draw(mutated(real_profiles))
    try:
        prof = from_dict(doc)
    except ProfileError as exc:
        assert exc.problems and all(isinstance(p, str) and "\n" not in p for p in exc.problems)
        return
    _convert_all(prof)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_mutated_profiles_are_refused_or_render_html(real_profiles, data):
    pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")
    from memlord.report._html import render_html

    doc = data.draw(mutated(real_profiles))
    try:
        prof = from_dict(doc)
    except ProfileError:
        return
    assert render_html(prof).startswith("<!DOCTYPE html>")
