"""The HTML reports' hover labels in a real browser: a name holding plotly's template
syntax (``%{y}``, ``%{x}``: a module's, a region's or a loaded profile's category name)
shows as itself in its tooltip, never substituted by plotly's hovertemplate.

Headless Chromium draws each trace's hover label (``Plotly.Fx.hover`` on its first
point, one trace at a time: plotly drops a hover that comes too soon after the last) and
the labels' text is read from the page's DOM: what a user pointing at the chart sees.
"""

from __future__ import annotations

import html
import json
import re

import pytest
from support.browser import load_page

from memlord.cli import main
from memlord.report import KNOWN_KINDS, Events, Profile, Span, export

pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")

NAMES = ("%{y} cat", "%{x}", "%{fullData.name} and %{customdata[0]}", "100%{y:.3f}")

#: appended to a page: once the report is drawn, the hover label of every trace of every
#: chart, joined into <pre id="hovers"> (one "chart trace: text" line each)
HOVER_ALL = """
<script>
(function wait() {
  if (!document.body.hasAttribute('data-memlord-ready')) { setTimeout(wait, 50); return; }
  var out = [], jobs = [];
  document.querySelectorAll('.js-plotly-plot').forEach(function(gd) {
    (gd.data || []).forEach(function(tr, i) { jobs.push([gd, i]); });
  });
  function next() {
    if (!jobs.length) {
      var pre = document.createElement('pre');
      pre.id = 'hovers';
      pre.textContent = out.join(' ||| ');
      document.body.appendChild(pre);
      return;
    }
    var job = jobs.shift(), gd = job[0], i = job[1];
    Plotly.Fx.unhover(gd);
    Plotly.Fx.hover(gd, [{curveNumber: i, pointNumber: 0}]);
    setTimeout(function() {
      var layer = gd.querySelector('.hoverlayer');
      out.push(gd.id + ' ' + i + ': ' + (layer ? layer.textContent : ''));
      next();
    }, 100);
  }
  next();
})();
</script>
"""


def _hover_texts(browser, page) -> dict[str, str]:
    hovered = page.with_name("hovered-" + page.name)
    hovered.write_text(page.read_text().replace("</body>", HOVER_ALL + "</body>"))
    loaded = load_page(hovered, browser=browser, budget_ms=30_000)
    assert loaded.console == [], f"console messages: {loaded.console}"
    m = re.search(r'<pre id="hovers">(.*?)</pre>', loaded.dom, re.S)
    assert m, "the hover script did not finish"
    rows = html.unescape(m.group(1)).split(" ||| ")
    return dict(row.split(": ", 1) for row in rows)


def test_a_profiles_names_show_as_themselves_in_the_reports_tooltips(browser, tmp_path):
    k = KNOWN_KINDS.index
    doc = Profile(
        metadata={"start_ns": 0},
        events=Events(
            {
                "t_ns": [5, 6, 7, 8],
                "kind": [k("alloc")] * 4,
                "device": [0, 0, 0, 0],
                "bytes": [100, 50, 25, 10],
                "address": [1, 2, 3, 4],
                "category": [0, 1, 2, 3],
            },
            devices=["cpu"],
            categories=list(NAMES),
        ),
        regions=[
            Span(name, start_ns=5 + i, end_ns=9, kind="region", delta={"cpu": 1})
            for i, name in enumerate(NAMES)
        ],
    )
    page = tmp_path / "report.html"
    export(doc, page)
    hovers = _hover_texts(browser, page)
    timeline = [t for key, t in hovers.items() if key.startswith("timeline ")]
    gantt = [t for key, t in hovers.items() if key.startswith("gantt ")]
    for name in NAMES:
        # a category's stacked area: its name and the device
        assert any(t.startswith(f"{name} cpu") for t in timeline), (name, timeline)
        # a region's bar: its name in bold, then its kind
        assert any(t.startswith(f"{name} (region)") for t in gantt), (name, gantt)
    assert any(t.startswith("allocated cpu") for t in timeline), timeline


def test_a_merged_reports_category_names_show_as_themselves_in_its_tooltips(browser, tmp_path):
    from test_merge_post_mortems import MiB, _documented_post_mortem

    doc = _documented_post_mortem(0, MiB, MiB)
    cats = {name: (i + 1) * MiB for i, name in enumerate(NAMES)}
    doc["devices"]["cpu"]["ledger"]["peak_categories"] = cats
    pm = tmp_path / "pm.json"
    pm.write_text(json.dumps(doc))
    page = tmp_path / "merged.html"
    assert main(["merge", str(pm), "-o", str(page)]) == 0
    hovers = list(_hover_texts(browser, page).values())
    for name in NAMES:
        assert any(t.startswith(f"{name}rank 0 cpu") for t in hovers), (name, hovers)
