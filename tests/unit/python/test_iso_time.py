"""The times the memory profiler's files state (their snapshots' and operations'
``timestamp``), read alike on every supported CPython: 3.11 and later read any ISO 8601
time, 3.10's ``datetime.fromisoformat`` only what ``isoformat()`` writes, and a snapshot
whose time it could not read was dropped from the report (so was an operation)."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest

from memlord.report import load
from memlord.report._series import memory_series
from memlord.report._util import iso_time

UTC = dt.timezone.utc
LOCAL_HALF = dt.datetime(2025, 1, 13, 10, 29, 50, 500000).timestamp()  # no offset: local

# (the text, the time it states: a datetime built from its fields, not parsed)
STAMPS = [
    ("2025-01-13T10:29:50", dt.datetime(2025, 1, 13, 10, 29, 50).timestamp()),
    ("2025-01-13T10:29:50.500000", LOCAL_HALF),
    ("2025-01-13T10:29:50.500", LOCAL_HALF),
    ("2025-01-13T10:29:50.5", LOCAL_HALF),
    ("2025-01-13T10:29:50,5", LOCAL_HALF),
    ("2025-01-13 10:29:50.5", LOCAL_HALF),
    ("2025-01-13T10:29:50.500000123", LOCAL_HALF),
    ("20250113T102950", dt.datetime(2025, 1, 13, 10, 29, 50).timestamp()),
    ("2025-01-13T10:29:50Z", dt.datetime(2025, 1, 13, 10, 29, 50, tzinfo=UTC).timestamp()),
    ("2025-01-13T10:29:50.25Z", dt.datetime(2025, 1, 13, 10, 29, 50, 250000, UTC).timestamp()),
    (
        "2025-01-13T10:29:50.5+02:00",
        dt.datetime(2025, 1, 13, 8, 29, 50, 500000, tzinfo=UTC).timestamp(),
    ),
    ("2025-01-13", dt.datetime(2025, 1, 13).timestamp()),
]


@pytest.mark.parametrize(("text", "expected"), STAMPS, ids=[t for t, _ in STAMPS])
def test_an_iso_time_is_read_as_it_states(text, expected):
    assert iso_time(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("text", ["", "yesterday", "2025-13-01T00:00:00", "10:29:50.5Z"])
def test_what_is_no_iso_time_is_a_value_error(text):
    with pytest.raises(ValueError):
        iso_time(text)


@pytest.mark.parametrize("value", [None, 1736763000, b"2025-01-13"])
def test_what_is_no_string_is_a_type_error(value):
    with pytest.raises(TypeError):
        iso_time(value)


def test_a_profiler_file_keeps_each_snapshot_whatever_its_time_format(tmp_path):
    """Snapshots stamped as other tools write times (a tenth of a second, UTC's Z) are in
    the report's series, at the times they state."""
    stamps = ["2025-01-13T10:29:45Z", "2025-01-13T10:29:50.5Z", "2025-01-13T10:29:51.25Z"]
    seed = {
        "metadata": {"generated_at": "2025-01-13T10:30:00", "num_snapshots": len(stamps)},
        "snapshots": [
            {
                "timestamp": stamp,
                "total_mb": 1.0,
                "device_breakdown": {"cpu": {"total_bytes": 1000 * (i + 1), "count": 1}},
            }
            for i, stamp in enumerate(stamps)
        ],
        "operation_allocations": {
            "forward": [{"timestamp": "2025-01-13T10:29:50.5Z", "duration_ms": 2.0}]
        },
    }
    path = tmp_path / "seed.json"
    path.write_text(json.dumps(seed))
    doc = load(path)
    series = memory_series(doc)["cpu"]
    assert series.allocated.tolist() == [1000, 2000, 3000]
    # to the microsecond (the times are floats of seconds on their way to nanoseconds)
    gaps = np.diff(series.t_ns).tolist()
    assert gaps == pytest.approx([5_500_000_000, 750_000_000], abs=1_000)
    (span,) = doc.spans()
    assert span.name == "forward" and span.end_ns - span.start_ns == 2_000_000
