"""The HTML report's legends in a real browser: a name with a double quote shows as itself
(not '&quot;'), and no legend covers its plot (lane 0 of the Gantt holds the root module's
spans and the `step` region; the top of the timeline holds the peak) (repro r40).

Geometry comes from the SVG plotly draws in headless Chromium: the legend group's
translation and background height against the plot area's drag rectangle.
"""

from __future__ import annotations

import html
import re

import pytest
import torch
from support.browser import load_page
from support.synthetic import synthetic_profile

from memlord import MemLord
from memlord.report import export

pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")

QUOTED = 'say "hi"'


def _plot_svg(dom: str, div_id: str) -> str:
    start = dom.index(f'id="{div_id}"')
    end = dom.find("</section>", start)
    return dom[start:end]


def _legend_and_plot(svg: str) -> tuple[float, float, float, float]:
    """(legend top, legend bottom, plot top, plot bottom) in the figure's pixels."""
    legend = re.search(r'<g class="legend"[^>]*transform="translate\([-\d.]+,([-\d.]+)\)"', svg)
    assert legend, "no legend drawn"
    bg = re.search(r'<rect class="bg"[^>]*height="([\d.]+)"', svg[legend.end() :])
    plot = re.search(
        r'<rect class="nsewdrag drag"[^>]*y="([\d.]+)" width="[\d.]+" height="([\d.]+)"', svg
    )
    assert bg and plot
    top = float(legend.group(1))
    y0, h = float(plot.group(1)), float(plot.group(2))
    return top, top + float(bg.group(1)), y0, y0 + h


def _legend_texts(svg: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r'class="legendtext"[^>]*>([^<]*)', svg)]


def _lord_page(tmp_path) -> str:
    lord = MemLord()
    lord.record_events(1000)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with lord.hook_into_python(), lord.track_modules(model, backward=False):
        for _ in range(2):
            with lord.region("step"):
                with lord.region(QUOTED):
                    keep = model(torch.randn(4, 8))
                with lord.region("other"):
                    del keep
    lord.record_events(0)
    page = tmp_path / "lord.html"
    assert lord.export(page) == "html"
    return str(page)


def test_quoted_name_shows_as_itself_and_legends_cover_nothing(browser, tmp_path):
    page = _lord_page(tmp_path)
    loaded = load_page(page, browser=browser)
    assert loaded.console == [], loaded.console
    assert loaded.ready_ms is not None
    gantt = _plot_svg(loaded.dom, "gantt")
    texts = _legend_texts(gantt)
    assert QUOTED in texts, texts
    assert not any("&quot;" in t or "&#" in t for t in texts), texts
    # the hover data carries the name the same way
    assert "&amp;quot;" not in loaded.dom.split('id="memlord-data"')[0]
    for div in ("timeline", "gantt"):
        top, bottom, plot_top, plot_bottom = _legend_and_plot(_plot_svg(loaded.dom, div))
        assert bottom <= plot_top, f"{div}: legend {top}..{bottom} covers plot {plot_top}.."
        assert plot_bottom - plot_top >= 60, (
            f"{div}: plot area squeezed to {plot_bottom - plot_top}"
        )


def test_many_legend_rows_push_the_gantt_down(browser, tmp_path):
    names = ("backward", QUOTED) + tuple(f"a rather long region name {i}" for i in range(10))
    doc = synthetic_profile(2000, steps=3, names=names)
    page = tmp_path / "many.html"
    export(doc, page)
    loaded = load_page(page, browser=browser, window=(900, 1400))
    assert loaded.console == [], loaded.console
    top, bottom, plot_top, plot_bottom = _legend_and_plot(_plot_svg(loaded.dom, "gantt"))
    assert bottom - top > 40  # several rows
    assert bottom <= plot_top
    assert QUOTED in _legend_texts(_plot_svg(loaded.dom, "gantt"))
