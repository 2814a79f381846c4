"""The HTML report's peak composition in a real browser: after real training steps with
``ops=True`` and ``track_modules``, the page has a "Peak composition" section whose rows
by category are the ledger's own categories at its peak (``stats()["peak_categories"]``),
and whose rows by module name the model's modules."""

from __future__ import annotations

import re

import pytest
import torch
from support.browser import load_page

from memlord import MemLord, format_bytes

pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _parse(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def test_peak_composition_section_shows_the_ledgers_peak(browser, tmp_path):
    lord = MemLord()
    lord.record_events(1 << 16)
    with lord.hook_into_python(ops=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(512, 64)
        with lord.track_modules(model):
            for _ in range(2):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        page = tmp_path / "report.html"
        assert lord.export(page) == "html"
        stats = lord.stats()["cpu"]

    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the report's script did not finish"
    section = loaded.dom.partition('id="peak-composition"')[2].partition("</section>")[0]
    assert "<h2>Peak composition</h2>" in section
    rows = re.findall(r"<tr>(.*?)</tr>", section)
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", r) for r in rows]
    by_cat = {c[2]: c[3] for c in cells if c and c[1] == "category"}
    want = {k: v for k, v in stats["peak_categories"].items() if v}
    # each storage under the category it ended with: the last layer's weight gradient,
    # made in backward just before the peak, is a temporary in the ledger at that moment
    # and a gradient in the report (as in the timeline); every other category is equal
    moved = {"temporary", "gradient"}
    assert {k: v for k, v in by_cat.items() if k not in moved} == {
        k: format_bytes(v) for k, v in want.items() if k not in moved
    }
    shown = sum(_parse(v) for k, v in by_cat.items() if k in moved)
    assert shown == pytest.approx(sum(want.get(k, 0) for k in moved), abs=2 * 10.24)
    assert sum(_parse(v) for v in by_cat.values()) == pytest.approx(
        stats["peak_allocated"], abs=len(by_cat) * 10.24
    )
    # the activations at the peak were made inside the model's modules, by name
    modules = {c[2] for c in cells if c and c[1] == "module or region"}
    assert modules & {"0", "1", "2"}
    assert all(c[4].endswith("%") for c in cells if c)
