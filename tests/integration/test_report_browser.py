"""The HTML report in a real browser: Debian's chromium, headless.

The page must load with no console message at all (errors, warnings, failed network
requests: the browser runs with every host unresolvable), draw the expected number of
timeline series and Gantt bars, create no element from user strings, and a screenshot
is written (to $MEMLORD_SCREENSHOT_DIR when set, to look at).

CI installs the browser with tools/ensure_chromium.sh and sets MEMLORD_REQUIRE_BROWSER=1,
which turns a missing browser into a failure instead of a skip.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support.browser import load_page, probe_charts
from support.synthetic import synthetic_profile

from memlord.report import KNOWN_KINDS, Events, Profile, Span, export

pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")

EVIL = "</script><img src=x onerror=alert(1)>"


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def test_report_loads_and_draws_in_chromium(browser, tmp_path):
    steps = 4
    doc = synthetic_profile(50_000, steps=steps, names=(EVIL, "backward", "optimizer"))
    doc.metadata["title"] = EVIL
    page = tmp_path / "report.html"
    export(doc, page)
    shot_dir = Path(os.environ.get("MEMLORD_SCREENSHOT_DIR") or tmp_path)
    shot = shot_dir / "memlord_report.png"
    loaded = load_page(page, browser=browser, screenshot=shot)

    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the report's script did not finish"
    dom = loaded.dom
    timeline, _, rest = dom.partition('id="gantt"')
    # timeline: allocated + peak per device, reserved on cuda:0, auto-GC and OOM markers
    assert _count(r'class="trace scatter', timeline) == 2 + 3 + 2
    # Gantt: one bar per span, one bar trace per name (step, 3 names, data_loader)
    assert _count(r'<g class="point"', rest) == len(doc.operations) == steps * 5
    assert _count(r'class="trace bars"', rest) == 5
    # user strings are text, never markup
    assert "<img" not in dom
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;" in dom
    # nothing outside the file is referenced
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)="(https?:)?//', dom)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_lord_export_draws_in_chromium(browser, tmp_path):
    """lord.export() of a real lord: the timeline of its event ring and a Gantt bar per
    closed region."""
    from support.lord_work import Work

    from memlord.report._lord import profile_from_lord

    work = Work()
    try:
        page = tmp_path / "lord.html"
        assert work.lord.export(page) == "html"
        doc = profile_from_lord(work.lord)
    finally:
        work.close()
    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the report's script did not finish"
    timeline, _, rest = loaded.dom.partition('id="gantt"')
    # cpu only: allocated and its running peak (nothing pending, no reserved, no auto-GC),
    # under them allocated stacked by category (one area per category the cpu held)
    from memlord.report import memory_series

    cats = memory_series(doc)["cpu"].categories
    assert cats, "the lord's events carry categories"
    assert _count(r'class="trace scatter', timeline) == 2 + len(cats)
    for cat in cats:
        assert f">{cat} cpu<" in timeline  # its legend entry
    names = {s.name for s in doc.regions}
    assert len(names) <= 12  # each name its own color and bar trace
    assert _count(r'<g class="point"', rest) == len(doc.regions) >= 8
    assert _count(r'class="trace bars"', rest) == len(names)
    assert "scratch" in rest and "Sequential (backward)" in rest


def _one_allocation() -> Profile:
    k = KNOWN_KINDS.index
    return Profile(
        metadata={"start_ns": 0},
        events=Events(
            {"t_ns": [5], "kind": [k("alloc")], "device": [0], "bytes": [100], "address": [1]},
            devices=["cpu"],
        ),
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_one_allocation, id="a timeline and no spans"),
        pytest.param(lambda: Profile(operations=[Span("op", 10, 20)]), id="spans only"),
        pytest.param(Profile, id="nothing at all"),
    ],
)
def test_report_without_a_chart_finishes_in_chromium(browser, tmp_path, make):
    """A profile with one chart of the two, or none (a program that opened no operation or
    region: `python -m memlord run` of most scripts), draws what it has and finishes, with
    no console error."""
    page = tmp_path / "report.html"
    export(make(), page)
    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the report's script did not finish"


def _scaled(seconds: float, mib: float, names: int) -> Profile:
    """A synthetic profile stretched to last ``seconds`` and peak near ``mib``, with
    ``names`` span names of growing length (legend entries)."""
    import numpy as np

    doc = synthetic_profile(
        400, steps=3, names=tuple("n" * (4 + 3 * k) + str(k) for k in range(names))
    )
    ev = doc.events
    t = ev["t_ns"].astype(np.float64)
    t0, span = t.min(), max(1.0, float(np.ptp(t)))
    f = seconds * 1e9 / span
    ev["t_ns"][:] = (t0 + (t - t0) * f).astype(ev["t_ns"].dtype)
    held = max(1.0, float(np.abs(ev["bytes"]).sum()))
    ev["bytes"][:] = np.maximum(1, ev["bytes"] * (mib * 2**20 / held)).astype(ev["bytes"].dtype)
    for s in doc.spans():
        s.start_ns = int(t0 + (s.start_ns - t0) * f)
        s.end_ns = max(s.start_ns + 1, int(t0 + (s.end_ns - t0) * f))
    return doc


@pytest.mark.parametrize(
    ("seconds", "mib", "names"),
    [
        pytest.param(2e-6, 1e-5, 1, id="microseconds, bytes"),
        pytest.param(0.0025, 0.02, 3, id="a lord's milliseconds, KiB"),
        pytest.param(3.7, 750.0, 6, id="seconds, MiB"),
        pytest.param(86_400.0 * 9, 3.0e6, 9, id="days, TiB"),
    ],
)
def test_margins_are_moved_by_the_legend_alone_and_every_label_shows(
    browser, tmp_path, seconds, mib, names
):
    """An axis that moves a margin feeds back, through the legend's wrapping width, into
    the other margins: plotly redraws until it gives up ("Too many auto-margin redraws",
    seen on a loaded CI machine).  plotly's own record of what pushed each chart's margins
    names the legend alone, and no tick label or axis title falls outside its chart at any
    scale of time and bytes, nor over another label."""
    page = tmp_path / "report.html"
    export(_scaled(seconds, mib, names), page)
    probe = probe_charts(page, browser, ("timeline", "gantt"))
    assert set(probe) == {"timeline", "gantt"}
    for chart, got in probe.items():
        assert got["pushers"] == ["base", "legend"] or got["pushers"] == ["legend"], (
            chart,
            got["pushers"],
        )
        assert got["outside"] == [], (chart, got["outside"])
        assert got["overlaps"] == [], (chart, got["overlaps"])


@pytest.mark.parametrize("ranks", [1, 8, 16, 64])
def test_a_merged_reports_chart_settles_for_any_number_of_ranks(browser, tmp_path, ranks):
    """``memlord merge`` of 1 to 64 ranks: plotly lays the bar chart's labels flat, at
    30 degrees or upright as they fit, and settles without a console message; the y axis
    never moves a margin, and no label falls outside the chart."""
    import json

    from test_merge_post_mortems import MiB, _documented_post_mortem

    from memlord.__main__ import main

    files = []
    for rank in range(ranks):
        pm = _documented_post_mortem(rank, (rank + 1) * 10 * MiB, (rank + 2) * 10 * MiB)
        pm["world_size"] = ranks
        path = tmp_path / f"memlord-oom-{rank}.json"
        path.write_text(json.dumps(pm))
        files.append(str(path))
    page = tmp_path / "merged.html"
    assert main(["merge", *files, "-o", str(page)]) == 0
    got = probe_charts(page, browser, ("peaks",))["peaks"]  # asserts an empty console
    assert "y.automargin" not in got["pushers"], got["pushers"]
    assert got["outside"] == [], got["outside"]
