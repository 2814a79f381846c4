"""Open a report in headless Chromium (standard library only): the DOM after the page's
scripts ran, the console messages, and optionally a screenshot.  Used by the browser
test and the report benchmark; ``tools/ensure_chromium.sh`` installs the browser."""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from support import cbuild


def _browser_env() -> dict[str, str]:
    """The environment for the browser: without a preloaded sanitizer runtime (a process
    run under ASan would hand it to chromium, which then crawls or hangs)."""
    return cbuild.plain_env()


NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_CONSOLE = re.compile(r":CONSOLE(?::\d+|\(\d+\))\]\s*(.*)")
_READY = re.compile(r'data-memlord-ready="([0-9.]+)"')
_DRAW = re.compile(r'data-memlord-draw-ms="([0-9.]+)"')


def find_chromium() -> str | None:
    """The browser's path: $MEMLORD_CHROMIUM, else the first of NAMES on PATH."""
    env = os.environ.get("MEMLORD_CHROMIUM")
    if env and os.access(env, os.X_OK):
        return env
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclasses.dataclass
class PageLoad:
    dom: str
    console: list[str]  # every console message and uncaught error, as Chromium logs them
    elapsed_s: float  # the whole browser run: start, load, scripts, dump, exit
    ready_ms: float | None  # the report's own figure: navigation start to plots drawn
    draw_ms: float | None  # of which the report's data parsing and plotting


def _base_args(browser: str, profile_dir: str) -> list[str]:
    return [
        browser,
        "--headless",
        "--no-sandbox",  # root in containers
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # any network request fails, loudly
        f"--user-data-dir={profile_dir}",
        "--enable-logging=stderr",
        "--v=0",
    ]


def load_page(
    path: str | os.PathLike[str],
    *,
    browser: str | None = None,
    screenshot: str | os.PathLike[str] | None = None,
    window: tuple[int, int] = (1400, 1400),
    budget_ms: int = 10_000,
    timeout_s: float = 120.0,
) -> PageLoad:
    """Load ``path`` in headless Chromium and return its DOM and console; with
    ``screenshot``, also write a PNG of the window (a second browser run)."""
    browser = browser or find_chromium()
    if browser is None:
        raise FileNotFoundError("no Chromium found (tools/ensure_chromium.sh installs it)")
    url = Path(path).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="memlord-chromium-") as profile:
        args = _base_args(browser, profile) + [
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
            url,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            args, capture_output=True, text=True, timeout=timeout_s, env=_browser_env()
        )
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"chromium exited with {proc.returncode}: {proc.stderr[-2000:]}")
        console = [m.group(1) for m in map(_CONSOLE.search, proc.stderr.splitlines()) if m]
        if screenshot is not None:
            shot = _base_args(browser, profile) + [
                f"--virtual-time-budget={budget_ms}",
                "--hide-scrollbars",
                f"--window-size={window[0]},{window[1]}",
                f"--screenshot={os.fspath(screenshot)}",
                url,
            ]
            done = subprocess.run(
                shot, capture_output=True, text=True, timeout=timeout_s, env=_browser_env()
            )
            if done.returncode != 0:
                raise RuntimeError(f"chromium screenshot failed: {done.stderr[-2000:]}")
    ready = _READY.search(proc.stdout)
    draw = _DRAW.search(proc.stdout)
    return PageLoad(
        proc.stdout,
        console,
        elapsed,
        float(ready.group(1)) if ready else None,
        float(draw.group(1)) if draw else None,
    )


# Runs in the page after the report's own script: for each chart, the ids of what pushed
# its margins (plotly's own record) and every axis label or title drawn outside the
# chart's SVG (clipped: the reader cannot see it) or over another (plotly moves a title
# that has no room onto the tick labels), written to the body as JSON.
_PROBE = """<script>
(function probe() {
  if (!document.body.hasAttribute('data-memlord-ready')) { setTimeout(probe, 20); return; }
  var out = {};
  CHARTS.forEach(function(id) {
    var gd = document.getElementById(id);
    if (!gd || !gd._fullLayout) return;
    var svg = gd.querySelector('svg.main-svg').getBoundingClientRect();
    var outside = [], overlaps = [], boxes = [];
    gd.querySelectorAll('.xtick text, .ytick text, .g-xtitle text, .g-ytitle text')
      .forEach(function(el) {
        var r = el.getBoundingClientRect(), kind = el.parentNode.getAttribute('class');
        if (!r.width) return;
        if (r.left < svg.left - 0.5 || r.right > svg.right + 0.5 ||
            r.top < svg.top - 0.5 || r.bottom > svg.bottom + 0.5)
          outside.push(el.textContent);
        boxes.forEach(function(b) {
          // the x axis's first label and the y axis's first label may touch at the corner
          if (b.kind === kind || b.kind.indexOf('title') >= 0 || kind.indexOf('title') >= 0)
          if (r.left < b.r.right - 0.5 && b.r.left < r.right - 0.5 &&
              r.top < b.r.bottom - 0.5 && b.r.top < r.bottom - 0.5)
            overlaps.push([b.text, el.textContent]);
        });
        boxes.push({r: r, text: el.textContent, kind: kind});
      });
    out[id] = {pushers: Object.keys(gd._fullLayout._pushmarginIds || {}).sort(),
               outside: outside, overlaps: overlaps};
  });
  document.body.setAttribute('data-probe', JSON.stringify(out));
})();
</script></body>"""


def probe_charts(page: Path, browser: str | None, charts: tuple[str, ...]) -> dict[str, Any]:
    """Load a copy of ``page`` with _PROBE added: per chart id, ``pushers`` (what moved its
    margins, plotly's own record), ``outside`` and ``overlaps`` (labels clipped or drawn
    over another); asserts the page logged nothing.  The boxes are the labels' screen
    rectangles: labels plotly rotated (many categories) overlap there while their text
    does not, so ``overlaps`` means something for unrotated labels only."""
    probed = page.with_suffix(".probe.html")
    probe = _PROBE.replace("CHARTS", json.dumps(list(charts)))
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", probe), "utf-8")
    loaded = load_page(probed, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    found = re.search(r'data-probe="([^"]*)"', loaded.dom)
    assert found, "the probe did not run"
    return json.loads(html.unescape(found.group(1)))
