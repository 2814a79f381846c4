"""The HTML report's categories in a real browser: after a real training step with
``ops=True``, the timeline draws allocated stacked by category (one legend entry per
category the device held), and the page has the ledger's table by category and the
modules' and regions' deltas by category."""

from __future__ import annotations

import re

import pytest
import torch
from support.browser import load_page

from memlord import MemLord, format_bytes
from memlord.report import memory_series
from memlord.report._lord import profile_from_lord

pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")


def test_timeline_and_tables_show_the_categories(browser, tmp_path):
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
        )
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(16, 64)
        with lord.track_modules(model):
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        page = tmp_path / "report.html"
        assert lord.export(page) == "html"
        doc = profile_from_lord(lord)
        stats = lord.stats()["cpu"]
    cats = list(memory_series(doc)["cpu"].categories)
    assert {"parameter", "gradient", "activation", "optimizer_state"} <= set(cats)

    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the report's script did not finish"
    dom = loaded.dom
    timeline, _, rest = dom.partition('id="gantt"')
    timeline = timeline.rpartition('id="timeline"')[2]
    # one filled area per category, plus allocated and its peak
    assert len(re.findall(r'class="trace scatter', timeline)) == len(cats) + 2
    legend = re.findall(r'class="legendtext"[^>]*>([^<]*)<', timeline)
    assert [t for t in legend if t.endswith(" cpu") and t.split()[0] in cats] == [
        f"{c} cpu" for c in cats
    ]
    # the stacked areas are filled (plotly draws a fill path per stacked trace)
    assert len(re.findall(r'class="js-fill"', timeline)) >= len(cats)
    # the ledger by category: its current bytes, as stats() has them
    table = dom.partition('id="categories"')[2].partition("</section>")[0]
    row = table.partition("<td>optimizer_state</td>")[2].partition("</tr>")[0]
    assert format_bytes(stats["categories"]["optimizer_state"]) in row
    assert "<td>loaded</td>" not in table  # 0 throughout: left out
    # the modules by category: the first Linear's forward left activations
    mods = dom.partition('id="span-categories"')[2].partition("</section>")[0]
    assert re.search(r"<td>0</td><td>cpu</td><td>activation</td>", mods)
    assert "<td>0 (backward)</td><td>cpu</td><td>temporary</td>" in mods


def test_a_loaded_profiles_category_names_are_text_in_the_timeline(browser, tmp_path):
    """A profile read from a file may name any category: the timeline's legend shows the
    name as written, never as plotly's markup (<b> made bold, &amp; decoded to &)."""
    from memlord.report import KNOWN_KINDS, Events, Profile, export

    name = "<b>bold</b> &amp; x"
    k = KNOWN_KINDS.index
    doc = Profile(
        metadata={"start_ns": 0},
        events=Events(
            {
                "t_ns": [5, 6],
                "kind": [k("alloc"), k("alloc")],
                "device": [0, 0],
                "bytes": [100, 50],
                "address": [1, 2],
                "category": [0, 0],
            },
            devices=["cpu"],
            categories=[name],
        ),
    )
    page = tmp_path / "report.html"
    export(doc, page)
    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    legend = re.findall(r'class="legendtext"[^>]*>(.*?)</text>', loaded.dom)
    assert "&lt;b&gt;bold&lt;/b&gt; &amp;amp; x cpu" in legend, legend
    assert not any("<tspan" in text for text in legend), legend  # no markup made of it
