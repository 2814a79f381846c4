"""Reports of a 1,000,000-event profile: JSON and HTML writing, HTML size, and opening
the HTML report in headless Chromium (issue 13).

Targets, each a ratio to a floor measured in the same run:

* HTML report written in at most 10 s: the floor is 1 s, so the target is 10x;
* HTML file at most 10 MB: the floor is 1 MB, so the target is 10x (unit "B");
* opened in headless Chromium within 3 s, from navigation start to every chart drawn
  (the page records it), against a fixed 3 s.

The JSON writer is timed against writing the same integer columns with
``numpy.savetxt``-free ``",".join(map(str, ...))`` alone (the cheapest text encoding);
it has no target, only the ratio (target 10x, informational).

``lord.export(path)`` of a lord whose ring holds the same number of events (1-byte cpu
allocations and frees through the event seam, plus 10,000 closed regions) is timed
against writing its document alone (``export(doc, path)``): the ratio is what building
the document from the ring, the regions and a snapshot costs on top (target 2x).

Medians of a few repetitions (the cases take seconds, so the harness's 10 ms samples do
not apply); ``--quick`` runs 100,000 events once.

    python bench/bench_report.py [--quick] [--json PATH]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import Config, Row, main

from memlord import MemLord
from memlord.report import export
from memlord.report._lord import profile_from_lord

# the synthetic profile is test support (tests/support/), not part of the package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.synthetic import synthetic_profile  # noqa: E402

EVENTS = 1_000_000


def _median_s(fn, repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def rows(cfg: Config) -> list[Row]:
    quick = cfg.samples <= 5
    n = 100_000 if quick else EVENTS
    repeat = 1 if quick else 3
    doc = synthetic_profile(n, steps=200)
    out: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="memlord-bench-") as tmp:
        tmpdir = Path(tmp)
        js = tmpdir / "p.json"
        html = tmpdir / "p.html"

        def floor_json() -> None:
            with open(tmpdir / "floor.txt", "w") as f:
                for col in doc.events.columns.values():
                    f.write(",".join(map(str, col.tolist())))

        t_json, s_json = _median_s(lambda: export(doc, js), repeat)
        t_floor, s_floor = _median_s(floor_json, repeat)
        out.append(
            Row(
                f"JSON export, {len(doc.events):,} events",
                t_json * 1e9,
                "join the event columns as text",
                t_floor * 1e9,
                target=10.0,
                note=f"{js.stat().st_size / 1e6:.1f} MB",
                samples_ns=[x * 1e9 for x in s_json],
                floor_samples_ns=[x * 1e9 for x in s_floor],
            )
        )
        lord = MemLord(auto_gc_bytes=None)
        lord.record_events(n)
        for i in range(10_000):
            with lord.region(f"r{i % 16}"):
                pass
        lord._bench_emit(n)  # fills the ring: n one-byte cpu allocations and frees
        lord_js = tmpdir / "lord.json"
        lord_doc = profile_from_lord(lord)
        t_lord, s_lord = _median_s(lambda: lord.export(lord_js), repeat)
        t_write, s_write = _median_s(lambda: export(lord_doc, lord_js), repeat)
        out.append(
            Row(
                f"lord.export to JSON, {len(lord_doc.events):,} ring events",
                t_lord * 1e9,
                "write its document alone",
                t_write * 1e9,
                target=2.0,
                note=f"{len(lord_doc.regions):,} region slices",
                samples_ns=[x * 1e9 for x in s_lord],
                floor_samples_ns=[x * 1e9 for x in s_write],
            )
        )

        try:
            import plotly  # noqa: F401
        except ImportError:
            print("plotly missing (pip install memlord[report]): HTML rows skipped")
            return out
        t_html, s_html = _median_s(lambda: export(doc, html), repeat)
        out.append(
            Row(
                f"HTML export, {len(doc.events):,} events",
                t_html * 1e9,
                "1 s",
                1e9,
                target=10.0,
                samples_ns=[x * 1e9 for x in s_html],
            )
        )
        size = html.stat().st_size
        out.append(Row("HTML report size", size, "1 MB", 1e6, target=10.0, unit="B"))

        from support.browser import find_chromium, load_page

        browser = find_chromium()
        if browser is None:
            print("no chromium (tools/ensure_chromium.sh): the browser row is skipped")
            return out
        loads, ready, draw = [], [], []
        for _ in range(repeat):
            page = load_page(html, browser=browser)
            if page.console or page.ready_ms is None or page.draw_ms is None:
                raise RuntimeError(f"the report did not load cleanly: {page.console}")
            loads.append(page.elapsed_s)
            ready.append(page.ready_ms)
            draw.append(page.draw_ms)
        out.append(
            Row(
                "open the HTML report in headless Chromium",
                statistics.median(ready) * 1e6,
                "3 s",
                3e9,
                target=1.0,
                note="navigation start to every chart drawn, measured by the page; of which "
                f"parsing the data and drawing: {statistics.median(draw):.0f} ms; the whole "
                f"browser process (start, load, DOM dump, exit): "
                f"{statistics.median(loads):.1f} s",
                samples_ns=[x * 1e6 for x in ready],
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main(rows))
