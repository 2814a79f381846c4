"""Banded auto-GC strategy: format, validation, band selection, thresholds, metrics,
defaults, modes, the [auto_gc] line, and the call-site switch.

"cuda:N" tensors are conftest.fake_cuda tensors (CPU memory reporting a cuda device), so
these tests run without a GPU: memlord counts them on their device, and the cache release
is skipped because torch.cuda was never initialised.  Used percentages come from a
capacity source set with lord.set_capacity_source, so band selection is deterministic.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
from conftest import fake_cuda

from memlord import MemLord
from memlord._sites import relative_path

pytestmark = pytest.mark.filterwarnings(
    "ignore:Accessing the data pointer of FakeTensor:UserWarning"
)

GC_LINE = re.compile(
    r"\[auto_gc\] (?P<dev>\S+) band=(?P<band>bytes|\[[^)]*\)) used=(?P<used>\S+) "
    r"metric=(?P<metric>\w+) value=(?P<value>\d+) \([^)]*\) "
    r"threshold=(?P<threshold>\d+) \([^)]*\) runs=(?P<runs>\d+); "
    r"(?:cache released|no cache to release \(backend not initialised, or no such device here\))"
)


def fake(nbytes: int, device: str = "cuda:0") -> torch.Tensor:
    """A tensor of nbytes that reports device (cuda:N), in CPU memory (conftest.fake_cuda)."""
    return fake_cuda(nbytes, torch.device(device).index, dtype=torch.uint8)


def alloc(lord: MemLord, nbytes: int, device: str = "cuda:0") -> None:
    lord.allocate(fake(nbytes, device))


def free(lord: MemLord, nbytes: int, device: str = "cuda:0") -> None:
    lord.free(fake(nbytes, device))


def runs(lord: MemLord, device: str = "cuda:0") -> int:
    return lord.stats(device).get(device, {}).get("gc_runs", 0)


class Capacity:
    """A settable capacity source: (total, used) for every device, counted."""

    def __init__(self, total: int = 1_000_000, used: int = 0):
        self.total, self.used, self.calls = total, used, []

    def set_percent(self, pct: float) -> None:
        self.used = int(self.total * pct / 100)

    def __call__(self, device: str):
        self.calls.append(device)
        if self.total is None:
            return None
        return (self.total, self.used)


def gc_lines(out: str) -> list[dict]:
    return [m.groupdict() for m in GC_LINE.finditer(out)]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")


def band(metric="allocated", **threshold):
    return {"metric": metric, "threshold": threshold}


# ---- validation ----------------------------------------------------------------

GOOD = {(0, 50): band("freed", bytes=10), (50, 101): band("max", percent=5.5)}

MALFORMED = [
    # (strategy, exception, fragments the message must hold)
    ({50: band(bytes=1)}, TypeError, ["band 50", "'key'"]),
    ({(0, 50, 75): band(bytes=1)}, TypeError, ["band (0, 50, 75)", "'key'"]),
    ({("0", 50): band(bytes=1)}, TypeError, ["band ('0', 50)", "key.lo_pct"]),
    ({(True, 50): band(bytes=1)}, TypeError, ["band (True, 50)", "key.lo_pct"]),
    ({(0, float("nan")): band(bytes=1)}, ValueError, ["band (0, nan)", "key.hi_pct"]),
    ({(50, 50): band(bytes=1)}, ValueError, ["band (50, 50)", "'key'"]),
    ({(-1, 50): band(bytes=1)}, ValueError, ["band (-1, 50)", "'key'"]),
    ({(0, 150): band(bytes=1)}, ValueError, ["band (0, 150)", "'key'"]),
    ({(0, 50): "max"}, TypeError, ["band (0, 50)", "expected a dict"]),
    ({(0, 50): band("avg", bytes=1)}, ValueError, ["band (0, 50)", "'metric'", "'avg'"]),
    ({(0, 50): band(1, bytes=1)}, TypeError, ["band (0, 50)", "'metric'"]),
    ({(0, 50): {"threshold": {"bytes": 1}}}, ValueError, ["band (0, 50)", "'metric'", "missing"]),
    ({(0, 50): {"metric": "max"}}, ValueError, ["band (0, 50)", "'threshold'", "missing"]),
    ({(0, 50): band()}, ValueError, ["band (0, 50)", "'threshold'", "empty"]),
    ({(0, 50): {"metric": "max", "threshold": 5}}, TypeError, ["band (0, 50)", "'threshold'"]),
    ({(0, 50): band(bytes=-1)}, ValueError, ["band (0, 50)", "threshold.bytes"]),
    ({(0, 50): band(bytes=1.5)}, TypeError, ["band (0, 50)", "threshold.bytes"]),
    ({(0, 50): band(bytes=True)}, TypeError, ["band (0, 50)", "threshold.bytes"]),
    ({(0, 50): band(bytes=2**63)}, ValueError, ["band (0, 50)", "threshold.bytes"]),
    ({(0, 50): band(percent="5")}, TypeError, ["band (0, 50)", "threshold.percent"]),
    ({(0, 50): band(percent=False)}, TypeError, ["band (0, 50)", "threshold.percent"]),
    ({(0, 50): band(percent=-0.5)}, ValueError, ["band (0, 50)", "threshold.percent"]),
    ({(0, 50): band(percent=float("inf"))}, ValueError, ["band (0, 50)", "threshold.percent"]),
    ({(0, 50): band(percent=150)}, ValueError, ["band (0, 50)", "threshold.percent"]),
    ({(0, 50): band(kb=1)}, ValueError, ["band (0, 50)", "threshold.kb"]),
    (
        {(0, 50): {"metric": "max", "threshold": {"bytes": 1}, "color": "red"}},
        ValueError,
        ["band (0, 50)", "'color'"],
    ),
    (
        {(0, 60): band(bytes=1), (50, 101): band(bytes=1)},
        ValueError,
        ["band (0, 60)", "band (50, 101)", "overlap"],
    ),
    ([((0, 50), band(bytes=1))], TypeError, ["'strategy'", "list"]),
    # a good band first: the bad one after it still leaves everything unchanged
    ({(0, 50): band(bytes=1), (50, 101): band("nope", bytes=1)}, ValueError, ["band (50, 101)"]),
]


@pytest.mark.parametrize(
    "strategy,exc,fragments", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))]
)
def test_malformed_strategy_raises_and_changes_nothing(strategy, exc, fragments):
    lord = MemLord(auto_gc_strategy=GOOD)
    before = lord.auto_gc_strategy
    with pytest.raises(exc) as info:
        lord.set_auto_gc_strategy(strategy)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert lord.auto_gc_strategy == before
    # bytes mode is left alone too
    bytes_lord = MemLord(auto_gc_bytes=123)
    with pytest.raises(exc):
        bytes_lord.set_auto_gc_strategy(strategy)
    assert bytes_lord.auto_gc_strategy is None and bytes_lord.auto_gc_bytes == 123
    with pytest.raises(exc):
        MemLord(auto_gc_strategy=strategy)


def test_strategy_round_trips_as_a_fresh_dict():
    lord = MemLord(auto_gc_strategy=GOOD)
    got = lord.auto_gc_strategy
    assert got == {(0, 50): band("freed", bytes=10), (50, 101): band("max", percent=5.5)}
    got.clear()
    assert lord.auto_gc_strategy == GOOD
    floats = {(0.5, 49.25): band("max", bytes=1, percent=3)}
    lord.set_auto_gc_strategy(floats)
    assert lord.auto_gc_strategy == {(0.5, 49.25): band("max", bytes=1, percent=3.0)}
    key = next(iter(lord.auto_gc_strategy))
    assert type(key[0]) is float and type(key[1]) is float


# ---- modes -----------------------------------------------------------------------

DEFAULTS = {
    (0, 50): band("max", percent=60.0),
    (50, 75): band("max", percent=50.0),
    (75, 101): band("max", percent=40.0),
}


def test_default_constructor_keeps_bytes_mode():
    lord = MemLord()
    assert lord.auto_gc_strategy is None
    assert MemLord(auto_gc_bytes=4096).auto_gc_bytes == 4096


def test_none_gives_default_bands():
    assert MemLord(auto_gc_strategy=None).auto_gc_strategy == DEFAULTS
    lord = MemLord(auto_gc_bytes=10)
    lord.set_auto_gc_strategy(None)
    assert lord.auto_gc_strategy == DEFAULTS
    assert lord.auto_gc_bytes is None


def test_both_arguments_raise_value_error():
    for bytes_arg in ("auto", 1000, None):
        for strategy in (None, {}, GOOD):
            with pytest.raises(ValueError, match="auto_gc_bytes.*auto_gc_strategy"):
                MemLord(auto_gc_bytes=bytes_arg, auto_gc_strategy=strategy)


def test_set_auto_gc_switches_back_to_bytes_mode(memlog):
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1)})
    lord.set_auto_gc(1000)
    assert lord.auto_gc_strategy is None and lord.auto_gc_bytes == 1000
    alloc(lord, 5000)  # bytes mode looks at frees only
    assert runs(lord) == 0
    free(lord, 999)
    assert runs(lord) == 0
    free(lord, 1)
    assert runs(lord) == 1
    (line,) = gc_lines(memlog.text())
    assert line["band"] == "bytes" and line["metric"] == "freed"
    assert line["value"] == "1000" and line["threshold"] == "1000" and line["runs"] == "1"


def test_empty_strategy_disables_auto_gc(memlog):
    lord = MemLord(auto_gc_strategy={})
    lord.set_capacity_source(Capacity(used=999_999))
    assert lord.auto_gc_strategy == {}
    assert lord.auto_gc_bytes is None
    alloc(lord, 10**9)
    free(lord, 10**9)
    assert runs(lord) == 0
    assert "[auto_gc]" not in memlog.text()
    assert "strategy (0 bands)" in repr(lord)


def test_default_bands_fire_at_their_percent():
    cap = Capacity(total=10_000)
    lord = MemLord(auto_gc_strategy=None)
    lord.set_capacity_source(cap)
    cap.set_percent(40)  # band (0, 50): max 60% of 10_000 = 6000
    alloc(lord, 5999)
    assert runs(lord) == 0
    alloc(lord, 1)
    assert runs(lord) == 1
    cap.set_percent(80)  # band (75, 101): 40% = 4000
    free(lord, 3999)
    assert runs(lord) == 1
    free(lord, 1)
    assert runs(lord) == 2


# ---- band selection ----------------------------------------------------------------

EDGE_STRATEGY = {
    (0, 50): band("allocated", bytes=100),
    (50, 75): band("allocated", bytes=200),
    (75, 101): band("allocated", bytes=300),
}


@pytest.mark.parametrize(
    "used,expected",
    [
        (0, "[0, 50)"),  # 0
        (499_999_999, "[0, 50)"),  # hi - epsilon
        (500_000_000, "[50, 75)"),  # lo
        (749_999_999, "[50, 75)"),
        (750_000_000, "[75, 101)"),
        (1_000_000_000, "[75, 101)"),  # 100
    ],
)
def test_band_selection_at_the_edges(memlog, used, expected):
    lord = MemLord(auto_gc_strategy=EDGE_STRATEGY)
    lord.set_capacity_source(Capacity(total=1_000_000_000, used=used))
    alloc(lord, 1000)
    (line,) = gc_lines(memlog.text())
    assert line["band"] == expected
    assert line["used"] == f"{used * 100 / 1_000_000_000:.1f}%"
    assert line["threshold"] == {"[0, 50)": "100", "[50, 75)": "200", "[75, 101)": "300"}[expected]


def test_band_threshold_is_the_bands_own():
    lord = MemLord(auto_gc_strategy=EDGE_STRATEGY)
    cap = Capacity(total=1000, used=600)  # 60%: band (50, 75), 200 bytes
    lord.set_capacity_source(cap)
    alloc(lord, 199)
    assert runs(lord) == 0
    alloc(lord, 1)
    assert runs(lord) == 1
    assert lord.freed("cuda:0")[0] == 0


def test_no_band_holds_the_percentage_means_no_gc():
    lord = MemLord(auto_gc_strategy={(10, 50): band("allocated", bytes=1)})
    cap = Capacity(total=1000, used=50)  # 5%
    lord.set_capacity_source(cap)
    alloc(lord, 10_000)
    assert runs(lord) == 0
    cap.used = 100  # 10%: the band now applies to the bytes since the last GC
    alloc(lord, 1)
    assert runs(lord) == 1


def test_devices_are_independent():
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1000)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 999, "cuda:0")
    alloc(lord, 1000, "cuda:1")
    assert runs(lord, "cuda:0") == 0 and runs(lord, "cuda:1") == 1


# ---- thresholds and metrics -----------------------------------------------------------


def test_bytes_and_percent_the_smaller_wins():
    cap = Capacity(total=100_000, used=0)  # 10% of total = 10_000
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=5000, percent=10)})
    lord.set_capacity_source(cap)
    alloc(lord, 4999)
    assert runs(lord) == 0
    alloc(lord, 1)
    assert runs(lord) == 1  # bytes (5000) < percent (10_000)
    lord.set_auto_gc_strategy({(0, 101): band("allocated", bytes=50_000, percent=10)})
    alloc(lord, 9999)
    assert runs(lord) == 1
    alloc(lord, 1)
    assert runs(lord) == 2  # percent (10_000) < bytes (50_000)


def test_percent_needs_a_known_capacity():
    cap = Capacity(total=None)  # the source cannot tell
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", percent=0.001)})
    lord.set_capacity_source(cap)
    alloc(lord, 10**9)
    assert runs(lord) == 0 and cap.calls
    # with a bytes threshold as well, the lowest band still fires on bytes
    lord.set_auto_gc_strategy(
        {(50, 101): band("allocated", bytes=10**12), (10, 50): band("allocated", bytes=10)}
    )
    alloc(lord, 10)
    assert runs(lord) == 1


def test_metric_allocated():
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1000)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 600)
    free(lord, 600)  # frees do not count for "allocated"
    free(lord, 5000)
    assert runs(lord) == 0
    alloc(lord, 400)
    assert runs(lord) == 1


def test_metric_freed():
    lord = MemLord(auto_gc_strategy={(0, 101): band("freed", bytes=1000)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 50_000)
    assert runs(lord) == 0
    free(lord, 999)
    assert runs(lord) == 0
    free(lord, 1)
    assert runs(lord) == 1


def test_metric_max(memlog):
    lord = MemLord(auto_gc_strategy={(0, 101): band("max", bytes=1000)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 600)
    free(lord, 900)
    assert runs(lord) == 0
    free(lord, 100)  # freed 1000 > allocated 600
    assert runs(lord) == 1
    alloc(lord, 1000)  # allocated 1000 > freed 0
    assert runs(lord) == 2
    lines = gc_lines(memlog.text())
    assert [(x["metric"], x["value"]) for x in lines] == [("max", "1000"), ("max", "1000")]


def test_gc_resets_both_since_gc_counters():
    lord = MemLord(auto_gc_strategy={(0, 101): band("max", bytes=1000)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 900)
    free(lord, 1000)
    assert runs(lord) == 1
    assert lord.freed("cuda:0")[0] == 0
    alloc(lord, 999)  # had alloc_since_gc survived, 1899 would fire
    assert runs(lord) == 1


def test_cpu_has_no_cache_so_no_gc_and_no_capacity_read():
    cap = Capacity()
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1)})
    lord.set_capacity_source(cap)
    lord.allocate(torch.empty(1000))
    assert runs(lord, "cpu") == 0
    assert cap.calls == []


def test_capacity_source_called_with_the_device_name():
    cap = Capacity()
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=10**12)})
    lord.set_capacity_source(cap)
    alloc(lord, 10, "cuda:1")
    free(lord, 10, "cuda:1")
    assert cap.calls == ["cuda:1", "cuda:1"]


def test_capacity_source_error_during_gc_is_unraisable_and_skips(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    def broken(device):
        raise RuntimeError("no capacity for " + device)

    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1)})
    lord.set_capacity_source(broken)
    alloc(lord, 100)
    assert lord.allocated("cuda:0")[0] == 100  # the allocation still counts
    assert runs(lord) == 0
    assert len(seen) == 1 and isinstance(seen[0].exc_value, RuntimeError)
    lord.set_capacity_source(lambda d: (10, 20))  # malformed: used > total
    alloc(lord, 100)
    assert runs(lord) == 0 and isinstance(seen[1].exc_value, ValueError)


def test_strategy_survives_reset():
    lord = MemLord(auto_gc_strategy=GOOD)
    lord.reset()
    assert lord.auto_gc_strategy == GOOD


# ---- the [auto_gc] line --------------------------------------------------------------


def test_auto_gc_record_is_info(memlog, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    lord = MemLord(auto_gc_strategy={(50, 75): band("freed", bytes=2048, percent=10)})
    lord.set_capacity_source(Capacity(total=1_000_000, used=625_000))
    alloc(lord, 4096, "cuda:1")
    free(lord, 4096, "cuda:1")
    (record,) = [r for r in memlog.records() if "[auto_gc]" in r.getMessage()]
    assert record.levelname == "INFO"
    out = memlog.text()
    assert out.count("[auto_gc]") == 1
    (line,) = gc_lines(out)
    assert line == {
        "dev": "cuda:1",
        "band": "[50, 75)",
        "used": "62.5%",
        "metric": "freed",
        "value": "4096",
        "threshold": "2048",
        "runs": "1",
    }
    free(lord, 4096, "cuda:1")
    assert gc_lines(memlog.text())[0]["runs"] == "2"


def test_auto_gc_line_no_color(memlog):
    lord = MemLord(auto_gc_strategy={(0, 101): band("allocated", bytes=1)})
    lord.set_capacity_source(Capacity())
    alloc(lord, 10)
    out = memlog.text()
    assert "\x1b" not in out and out.startswith("[auto_gc] cuda:0 band=[0, 101)")


def test_auto_gc_line_bytes_mode_reports_unknown_used(memlog):
    lord = MemLord(auto_gc_bytes=10)
    lord.set_capacity_source(lambda d: None)
    free(lord, 10)
    (line,) = gc_lines(memlog.text())
    assert line["band"] == "bytes" and line["used"] == "unknown"


# ---- call sites ---------------------------------------------------------------------


def test_callsite_tracking_switch():
    lord = MemLord(track_callsite=False)
    assert lord.track_callsite is False
    lord.allocate(torch.empty(256))
    lord.free(torch.empty(256))
    assert lord.top_alloc_site() is None
    assert lord.top_free_site("cpu") is None
    lord.set_callsite_tracking(True)
    assert lord.track_callsite is True
    lord.allocate(torch.empty(256))
    dev, where, nbytes = lord.top_alloc_site()
    assert dev == torch.device("cpu") and nbytes == 1024
    assert where.startswith(relative_path(__file__)) and where.rsplit(":", 1)[1].isdigit()
    assert lord.top_free_site() is None  # the free happened while off
    lord.set_callsite_tracking(False)
    lord.allocate(torch.empty(10_000))
    assert lord.top_alloc_site()[2] == 1024  # not recorded while off
    with pytest.raises(TypeError, match="enabled"):
        lord.set_callsite_tracking(1)
    assert lord.track_callsite is False


def test_callsite_default_on():
    lord = MemLord()
    assert lord.track_callsite is True
    lord.allocate(torch.empty(4))
    assert lord.top_alloc_site() is not None


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0])
def test_track_callsite_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="track_callsite"):
        MemLord(track_callsite=bad)
