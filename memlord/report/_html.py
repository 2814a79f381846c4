"""The self-contained HTML report (needs the optional extra: pip install memlord[report]).

One file, everything inline (plotly.js included), nothing fetched when it is opened:

* a summary header: devices, peaks, totals, GC runs, events, operations;
* a per-device memory timeline (allocated, stacked by category where the events carry
  one, running peak, pending, reserved where known),
  zoom with the mouse wheel or a drag, pan with the modebar; long histories are decimated
  to at most ``buckets`` time buckets per device keeping every bucket's minimum and
  maximum, so no peak is lost;
* a Gantt of operations and regions in compact lanes (overlapping spans never share a
  lane), colored by name, with tooltips (name, duration, memory delta, start, end); its
  time axis follows the timeline's zoom;
* the ledger by category, the modules' and regions' deltas by category;
* the largest live tensors of the last snapshot, the hotspots and the PyTorch operators.

Every string that comes from the profile is HTML-escaped.
"""

from __future__ import annotations

import html
import os
from typing import Any

import numpy as np

from .._bytes import human_bytes
from ._model import Profile, Span
from ._series import Series, decimate_indices, lanes, memory_series
from ._util import MiB, Progress, atomic_write, no_progress

EXTRA_HINT = "pip install memlord[report]"
DEFAULT_BUCKETS = 2000
MAX_BARS = 10000
MAX_NAMED_COLORS = 12
PALETTE = [
    "#4c78a8",
    "#f58518",
    "#54a24b",
    "#e45756",
    "#72b7b2",
    "#eeca3b",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
    "#1f77b4",
    "#d62728",
]
OTHER_COLOR = "#9aa0a6"
# one color per category (memlord.CATEGORIES), the same on every device and chart
CATEGORY_COLORS = {
    "other": "#9aa0a6",
    "parameter": "#4c78a8",
    "buffer": "#72b7b2",
    "gradient": "#e45756",
    "activation": "#f58518",
    "temporary": "#eeca3b",
    "optimizer_state": "#b279a2",
    "input": "#54a24b",
    "loaded": "#9d755d",
}
MAX_CATEGORY_ROWS = 200
# Legends sit above the plot area, anchored by their bottom edge: plotly then grows the
# top margin to fit them (however many rows), so no legend covers lane 0 of the Gantt or
# the top of the timeline.  A legend anchored by its top (y above 1 with the default
# anchor) hangs down into the plot area.
_LEGEND = {"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"}
# The legend is the only thing that moves a chart's margins.  Its wrapping width is the
# plot area's width, so a margin an axis pushed (plotly_white's axes have automargin on)
# feeds back into the legend's rows, the top margin, the plot's height, the tick labels
# and that axis's margin again: plotly redraws until it gives up and logs "Too many
# auto-margin redraws".  The axes' margins are fixed instead, wide enough for any tick
# label plotly writes for seconds, MiB or lanes (its labels stay within 7 characters).
_MARGIN = {"l": 72, "r": 32, "t": 30, "b": 56}
_XAXIS = {"title": {"text": "seconds since start"}, "automargin": False}


def _plotly() -> Any:
    try:
        import plotly  # noqa: F401
        import plotly.graph_objects as go
        import plotly.offline
    except ImportError as exc:
        raise ImportError(f"the HTML report needs plotly, an optional extra: {EXTRA_HINT}") from exc
    return go, plotly.offline


def _esc(value: object) -> str:
    """A user string as HTML text (the page's own elements and attributes)."""
    return html.escape(str(value), quote=True)


def _plot_text(value: object) -> str:
    """A user string as plotly text (trace names, hover data): plotly reads these as its
    own small HTML (tags like <b>, <br>), so '<', '>' and '&' are escaped, and decodes
    &lt; &gt; &amp; but not &quot;: quotes stay as they are (they open no tag)."""
    return html.escape(str(value), quote=False)


#: A trace's own name in a hovertemplate: user strings (module, region, category and
#: device names) reach a hovertemplate only through a reference like this one, or
#: through customdata; plotly substitutes %{...} in the template's own text, once, and
#: never in what it substitutes.
HOVER_NAME = "%{fullData.name}"


def _json_for_script(obj: str) -> str:
    """JSON text made safe inside a <script> element (no '<', '>', '&', U+2028/9)."""
    return (
        obj.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


# ---- figures ---------------------------------------------------------------------------


def timeline_traces(series: dict[str, Series], t0: int, buckets: int) -> list[dict[str, Any]]:
    """Plotly trace dicts for the timeline: per device allocated, peak, pending (when any
    is pending) and reserved (when known)."""
    traces = []
    for i, (dev, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        values = [s.allocated, s.pending] + ([s.reserved] if s.reserved is not None else [])
        peak_full = s.peak
        idx = decimate_indices(s.t_ns, values, buckets)
        d = s.take(idx)
        x = (d.t_ns - t0) / 1e9
        dev_e = _plot_text(dev)

        def line(name: str, y: np.ndarray, x: np.ndarray = x, **style: Any) -> dict[str, Any]:
            return {
                "type": "scatter",
                "mode": "lines",
                "name": name,
                "x": x,
                "y": y / MiB,
                "line": {"shape": "hv", **style},
                # the name by reference, never in the template's text: plotly would
                # substitute a %{...} in a user's name (a category of a loaded profile)
                "hovertemplate": HOVER_NAME + "<br>%{x:.6f} s<br>%{y:.3f} MiB<extra></extra>",
            }

        # allocated stacked by category (each storage under its category): the stack's
        # top is the allocated line drawn next
        for cat, cat_values in d.categories.items():
            traces.append(
                line(
                    f"{_plot_text(cat)} {dev_e}",  # a loaded profile may name any category
                    cat_values,
                    color=CATEGORY_COLORS.get(cat, OTHER_COLOR),
                    width=0.5,
                )
                | {
                    "stackgroup": f"categories {dev_e}",
                    "legendgroup": f"category {cat}",
                    "meta": {"memlord": "category", "category": cat, "device": dev},
                }
            )
        traces.append(line(f"allocated {dev_e}", d.allocated, color=color, width=1.5))
        traces.append(line(f"peak {dev_e}", peak_full[idx], color=color, dash="dot", width=1))
        if (s.pending != 0).any():
            traces.append(line(f"pending {dev_e}", d.pending, color=color, dash="dash", width=1))
        if d.reserved is not None:
            traces.append(
                line(f"reserved {dev_e}", np.maximum(d.reserved, 0), color=color, width=1)
                | {"opacity": 0.5}
            )
    return traces


def instant_traces(doc: Profile, series: dict[str, Series], t0: int) -> list[dict[str, Any]]:
    """Markers for auto-GC runs and OOMs, drawn at the device's allocated bytes then."""
    ev = doc.events
    traces = []
    for kind, label, symbol, color in (
        ("gc", "auto-GC", "triangle-down", "#6b7280"),
        ("oom", "OOM", "x", "#dc2626"),
    ):
        if kind not in ev.kinds:
            continue
        mask = ev["kind"] == ev.kinds.index(kind)
        if not mask.any():
            continue
        t = ev["t_ns"][mask]
        devs = [ev.devices[i] for i in ev["device"][mask].tolist()]
        y = []
        for ti, dev in zip(t.tolist(), devs, strict=True):
            s = series.get(dev)
            if s is None or not len(s):
                y.append(0.0)
                continue
            i = int(np.searchsorted(s.t_ns, ti, side="right")) - 1
            y.append(float(s.allocated[max(i, 0)]) / MiB)
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": label,
                "x": (t - t0) / 1e9,
                "y": np.asarray(y),
                "customdata": [_plot_text(d) for d in devs],
                "marker": {"symbol": symbol, "size": 10, "color": color},
                "hovertemplate": HOVER_NAME + " on %{customdata}<br>%{x:.6f} s<extra></extra>",
            }
        )
    return traces


def gantt_traces(spans: list[Span], t0: int) -> tuple[list[dict[str, Any]], int, int]:
    """Plotly bar traces for the Gantt (one per color group) and the number of lanes and
    of bars drawn (at most MAX_BARS, the longest spans)."""
    if len(spans) > MAX_BARS:
        spans = sorted(spans, key=lambda s: s.duration_ns, reverse=True)[:MAX_BARS]
    lane_of = lanes(spans)
    n_lanes = max(lane_of, default=-1) + 1
    totals: dict[str, int] = {}
    for s in spans:
        totals[s.name] = totals.get(s.name, 0) + s.duration_ns
    named = sorted(totals, key=lambda n: -totals[n])[:MAX_NAMED_COLORS]
    group_of = {name: i for i, name in enumerate(named)}
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        groups.setdefault(group_of.get(s.name, -1), []).append(i)
    traces = []
    for g in sorted(groups, key=lambda g: (g < 0, g)):
        members = groups[g]
        base = np.array([(spans[i].start_ns - t0) / 1e9 for i in members])
        width = np.array([max(spans[i].duration_ns, 0) / 1e9 for i in members])
        custom = [
            [
                _plot_text(spans[i].name),
                f"{spans[i].duration_ns / 1e6:.3f} ms",
                human_bytes(spans[i].memory_delta),
                f"{(spans[i].start_ns - t0) / 1e9:.6f} s",
                f"{(spans[i].end_ns - t0) / 1e9:.6f} s",
                _plot_text(spans[i].kind),
                _span_categories(spans[i]),
            ]
            for i in members
        ]
        traces.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": _plot_text(named[g]) if g >= 0 else "other",
                "base": base,
                "x": width,
                "y": np.array([lane_of[i] for i in members]),
                "customdata": custom,
                "marker": {
                    "color": PALETTE[g % len(PALETTE)] if g >= 0 else OTHER_COLOR,
                    "line": {"width": 0},
                },
                "hovertemplate": (
                    "<b>%{customdata[0]}</b> (%{customdata[5]})<br>"
                    "duration %{customdata[1]}<br>memory delta %{customdata[2]}<br>"
                    "start %{customdata[3]}<br>end %{customdata[4]}%{customdata[6]}"
                    "<extra></extra>"
                ),
            }
        )
    return traces, n_lanes, len(spans)


def _span_categories(span: Span) -> str:
    """A span's deltas by category for its tooltip (``<br>``-separated), or ""."""
    parts = []
    for dev, cats in span.categories.items():
        for cat, c in cats.items():
            parts.append(
                f"<br>{_plot_text(cat)} {_plot_text(dev)}: {_signed(int(c.get('delta', 0)))}"
                f" (peak +{human_bytes(int(c.get('peak_delta', 0)))})"
            )
    return "".join(parts)


#: Rows per grouping in the peak composition.
PEAK_ROWS = 8


def _peak_composition_rows(doc: Profile) -> list[list[str]]:
    """Per device, what was live at its peak of the events' running sum: the storages
    allocated at or before the peak whose next event at the same address comes after it,
    by category, by module or region (the innermost region at birth) and by call site
    (the largest :data:`PEAK_ROWS` of each); bytes the events do not attribute to one
    storage (alive before the first event, aggregates) as "(not attributed)"."""
    ev = doc.events
    if not len(ev) or "alloc" not in ev.kinds or "free" not in ev.kinds:
        return []
    kind, addr, nbytes = ev["kind"], ev["address"], ev["bytes"]
    alloc, free = kind == ev.kinds.index("alloc"), kind == ev.kinds.index("free")
    signed = np.where(alloc, nbytes, np.where(free, -nbytes, 0))
    baseline = doc.metadata.get("event_baseline") or {}
    rows: list[list[str]] = []
    for d, dev in enumerate(ev.devices):
        idx = np.flatnonzero(ev["device"] == d)
        if not idx.size:
            continue
        level = int(baseline.get(dev, 0)) + np.cumsum(signed[idx])
        k = int(np.argmax(level))
        peak, at = int(level[k]), int(idx[k])
        if peak <= 0:
            continue
        one = idx[(alloc[idx] | free[idx]) & (addr[idx] != 0)]
        order = one[np.lexsort((one, addr[one]))]
        nxt = np.full(order.shape[0], -1, np.int64)
        if order.shape[0] > 1:
            nxt[:-1] = np.where(addr[order[1:]] == addr[order[:-1]], order[1:], -1)
        live = order[alloc[order] & (order <= at) & ((nxt < 0) | (nxt > at))]
        weights = nbytes[live].astype(np.float64)
        rest = peak - int(weights.sum())

        def group(
            codes: np.ndarray, names: list[str], live: np.ndarray = live, w: np.ndarray = weights
        ) -> list[tuple[str, int]]:
            sums = np.bincount(codes[live] + 1, weights=w, minlength=len(names) + 1)
            pairs = [
                (names[i - 1] if i else "(none)", int(v)) for i, v in enumerate(sums.tolist()) if v
            ]
            return sorted(pairs, key=lambda kv: (-kv[1], kv[0]))[:PEAK_ROWS]

        cats = group(ev["category"], ev.categories)
        if rest > 0:
            cats.append(("(not attributed)", rest))
        for by, pairs in (
            ("category", cats),
            ("module or region", group(ev["region"], ev.regions)),
            ("site", group(ev["site"], ev.sites)),
        ):
            for name, b in pairs:
                rows.append([dev, by, name, human_bytes(b), f"{b / peak:.1%}"])
    return rows


def _signed(n: int) -> str:
    return ("" if n < 0 else "+") + human_bytes(n)


def _category_rows(doc: Profile) -> list[list[str]]:
    """Per device and category the ledger's bytes at the end (the counters' ``categories``,
    ``peak_categories`` and ``category_peaks``), categories that are 0 throughout left
    out."""
    rows = []
    for dev in doc.devices():
        c = doc.counters.get(dev, {})
        now, at_peak, own = (
            c.get(k) or {} for k in ("categories", "peak_categories", "category_peaks")
        )
        for cat in now:
            values = (int(now.get(cat, 0)), int(at_peak.get(cat, 0)), int(own.get(cat, 0)))
            if any(values):
                rows.append([dev, cat, *(human_bytes(v) for v in values)])
    return rows


def _span_category_rows(spans: list[Span]) -> list[list[str]]:
    """The modules' and regions' deltas by category, per span name, device and category:
    calls, total delta, largest delta and largest peak delta (the largest peaks first, at
    most MAX_CATEGORY_ROWS)."""
    agg: dict[tuple[str, str, str], list[int]] = {}
    for s in spans:
        for dev, cats in s.categories.items():
            for cat, c in cats.items():
                d, p = int(c.get("delta", 0)), int(c.get("peak_delta", 0))
                a = agg.get((s.name, dev, cat))
                if a is None:
                    agg[(s.name, dev, cat)] = [1, d, d, p]
                else:
                    a[0] += 1
                    a[1] += d
                    a[2] = max(a[2], d)
                    a[3] = max(a[3], p)
    order = sorted(agg.items(), key=lambda kv: (-kv[1][3], kv[0]))[:MAX_CATEGORY_ROWS]
    return [
        [name, dev, cat, str(n), _signed(total), _signed(mx), human_bytes(peak)]
        for (name, dev, cat), (n, total, mx, peak) in order
    ]


# ---- the page --------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;
color:#202124;background:#fafafa}
header{padding:16px 24px;background:#1f2937;color:#f9fafb}
header h1{margin:0 0 6px;font-size:20px}
header .meta{color:#cbd5e1;font-size:13px}
main{padding:8px 24px 32px}
section{background:#fff;border:1px solid #e5e7eb;border-radius:6px;margin:14px 0;padding:10px 14px}
section h2{font-size:16px;margin:4px 0 8px}
table{border-collapse:collapse;font-size:13px}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
.note{color:#5f6368;font-size:12px}
.plot{width:100%}
code{font-size:12px}
"""

_JS = """
(function(){
  var t0 = performance.now();
  var data = JSON.parse(document.getElementById('memlord-data').textContent);
  var config = {scrollZoom: true, displaylogo: false, responsive: true};
  var done = [];
  var tl = document.getElementById('timeline'), gt = document.getElementById('gantt');
  function plot(div, fig) {
    if (div && fig.data.length) done.push(Plotly.newPlot(div, fig.data, fig.layout, config));
  }
  plot(tl, data.timeline);
  plot(gt, data.gantt);
  var syncing = false;
  function link(src, dst) {
    src.on('plotly_relayout', function(ev) {
      if (syncing || !dst.data) return;
      var upd = {};
      if (ev['xaxis.range[0]'] !== undefined) {
        upd['xaxis.range'] = [ev['xaxis.range[0]'], ev['xaxis.range[1]']];
      } else if (ev['xaxis.range']) { upd['xaxis.range'] = ev['xaxis.range']; }
      else if (ev['xaxis.autorange']) { upd['xaxis.autorange'] = true; }
      else return;
      syncing = true;
      var clear = function() { syncing = false; };
      Plotly.relayout(dst, upd).then(clear, clear);
    });
  }
  Promise.all(done).then(function(){
    // a profile without samples or without spans has one chart's element, or none
    if (tl && gt && tl.on && gt.on && tl.data && gt.data) { link(tl, gt); link(gt, tl); }
    // milliseconds since navigation started, and the charts' own parse-and-draw time
    document.body.setAttribute('data-memlord-ready', performance.now().toFixed(1));
    document.body.setAttribute('data-memlord-draw-ms', (performance.now() - t0).toFixed(1));
  });
})();
"""


def _legend_px(traces: list[dict[str, Any]]) -> int:
    """About the height the legend of ``traces`` takes above the plot (it pushes the top
    margin by that much): one 24-pixel row per 1,000 pixels of entries."""
    width = sum(45 + 7 * min(len(str(t.get("name", ""))), 60) for t in traces)
    return 24 * max(1, -(-width // 1000)) if traces else 0


def _table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    head = "".join(
        f'<th class="num">{_esc(h)}</th>' if i in numeric else f"<th>{_esc(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_esc(c)}</td>' if i in numeric else f"<td>{_esc(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _summary(doc: Profile, series: dict[str, Series]) -> tuple[str, list[list[str]]]:
    rows = []
    ev = doc.events
    gc_events: dict[str, int] = {}
    if "gc" in ev.kinds:
        gc_devs = ev["device"][ev["kind"] == ev.kinds.index("gc")]
        for i, count in enumerate(np.bincount(gc_devs, minlength=len(ev.devices)).tolist()):
            gc_events[ev.devices[i]] = count
    for dev in doc.devices():
        c = doc.counters.get(dev, {})
        s = series.get(dev)
        peak = c.get("peak_allocated", int(s.allocated.max()) if s is not None and len(s) else 0)
        final = c.get("allocated", int(s.allocated[-1]) if s is not None and len(s) else 0)
        reserved = c.get("reserved")
        if reserved is None and s is not None and s.reserved is not None and len(s):
            reserved = int(s.reserved[-1])
        rows.append(
            [
                dev,
                human_bytes(peak),
                human_bytes(final),
                "" if reserved is None or reserved < 0 else human_bytes(reserved),
                human_bytes(c["allocated_total"]) if "allocated_total" in c else "",
                human_bytes(c["freed_total"]) if "freed_total" in c else "",
                str(c.get("allocs", "")),
                str(c.get("frees", "")),
                str(c.get("gc_runs", gc_events.get(dev, ""))),
            ]
        )
    t0 = doc.t0_ns()
    ends = [s.end_ns for s in doc.spans()]
    if len(doc.events):
        ends.append(int(doc.events["t_ns"].max()))
    if len(doc.samples):
        ends.append(int(doc.samples["t_ns"].max()))
    duration = (max(ends) - t0) / 1e9 if ends else 0.0
    md = doc.metadata
    parts = [
        f"generated {_esc(md.get('generated_at', ''))}",
        f"duration {duration:.3f} s",
        f"{len(doc.events):,} events",
        f"{len(doc.operations):,} operations",
        f"{len(doc.regions):,} regions",
        f"{len(doc.snapshots):,} snapshots",
    ]
    for key in ("torch_version", "memlord_version", "command"):
        if md.get(key):
            parts.append(f"{_esc(key.replace('_', ' '))} {_esc(md[key])}")
    return " · ".join(parts), rows


def _top_tensors(doc: Profile) -> list[list[str]]:
    for snap in reversed(doc.snapshots):
        breakdown = snap.get("device_breakdown") or {}
        rows = []
        for dev, info in breakdown.items():
            for t in info.get("tensors", []):
                rows.append(
                    [
                        dev,
                        f"{float(t.get('size_mb', 0.0)):.3f}",
                        str(t.get("shape", "")),
                        str(t.get("dtype", "")),
                        str(t.get("requires_grad", "")),
                        str(t.get("category") or ""),
                        str(t.get("operation") or ""),
                        str(snap.get("checkpoint_name") or ""),
                    ]
                )
        if rows:
            rows.sort(key=lambda r: -float(r[1]))
            return rows
    return []


def render_html(
    doc: Profile,
    *,
    buckets: int = DEFAULT_BUCKETS,
    progress: Progress = no_progress,
) -> str:
    """The report as one HTML string."""
    if not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 1:
        raise ValueError(f"buckets must be a positive int, got {buckets!r}")
    go, offline = _plotly()
    progress(0.05, "html series")
    series = memory_series(doc)
    t0 = doc.t0_ns()
    progress(0.3, "html timeline")
    tl_traces = timeline_traces(series, t0, buckets) + instant_traces(doc, series, t0)
    progress(0.5, "html gantt")
    spans = doc.spans()
    gt_traces, n_lanes, n_bars = gantt_traces(spans, t0)
    tl_fig = go.Figure(
        data=tl_traces,
        layout={
            "height": 380,
            "margin": _MARGIN,
            "xaxis": _XAXIS,
            "yaxis": {"title": {"text": "MiB"}, "rangemode": "tozero", "automargin": False},
            "legend": _LEGEND,
            "hovermode": "closest",
            "template": "plotly_white",
        },
    )
    gt_fig = go.Figure(
        data=gt_traces,
        layout={
            "height": max(200, 60 + 22 * n_lanes) + _legend_px(gt_traces),
            "margin": _MARGIN,
            "barmode": "overlay",
            "bargap": 0.15,
            "xaxis": _XAXIS,
            "yaxis": {
                "title": {"text": "lane"},
                "autorange": "reversed",
                "dtick": 1,
                "automargin": False,
            },
            "legend": _LEGEND,
            "template": "plotly_white",
        },
    )
    progress(0.65, "html json")
    payload = '{"timeline":' + tl_fig.to_json() + ',"gantt":' + gt_fig.to_json() + "}"
    header, rows = _summary(doc, series)
    title = doc.metadata.get("title") or "memlord memory report"
    sections = []
    sections.append(
        "<section><h2>Devices</h2>"
        + _table(
            [
                "device",
                "peak",
                "allocated at end",
                "reserved",
                "allocated total",
                "freed total",
                "allocs",
                "frees",
                "GC runs",
            ],
            rows,
            {1, 2, 3, 4, 5, 6, 7, 8},
        )
        + "</section>"
    )
    cat_rows = _category_rows(doc)
    if cat_rows:
        sections.append(
            '<section id="categories"><h2>By category</h2>'
            + _table(
                ["device", "category", "at end", "at the peak", "own peak"], cat_rows, {2, 3, 4}
            )
            + '<p class="note">What the ledger holds by category: at the end of the profile, '
            "when the device reached its peak, and each category's own highest.</p></section>"
        )
    peak_rows = _peak_composition_rows(doc)
    if peak_rows:
        sections.append(
            '<section id="peak-composition"><h2>Peak composition</h2>'
            + _table(["device", "by", "name", "bytes", "share of the peak"], peak_rows, {3, 4})
            + '<p class="note">What was live when each device reached its peak: the '
            "storages the events show alive at that moment, by category (the one each "
            "storage ended with, as in the timeline), by the module or region it was made "
            "in, and by the line that made it.</p></section>"
        )
    decimated = any(len(s) > 2 * buckets for s in series.values())
    note = (
        f"Decimated to {buckets} time buckets per device; every bucket keeps its minimum "
        "and maximum, so peaks are exact. "
        if decimated
        else ""
    )
    sections.append(
        '<section><h2>Memory timeline</h2><div id="timeline" class="plot"></div>'
        f'<p class="note">{note}Wheel or drag to zoom, double-click to reset; the Gantt '
        "follows the zoom.</p></section>"
        if tl_traces
        else "<section><h2>Memory timeline</h2><p>No memory samples or events.</p></section>"
    )
    shown = f"{n_bars:,} of {len(spans):,} (the longest)" if n_bars < len(spans) else f"{n_bars:,}"
    sections.append(
        '<section><h2>Operations and regions</h2><div id="gantt" class="plot"></div>'
        f'<p class="note">{shown} spans in {n_lanes} lanes; overlapping spans never '
        "share a lane.</p></section>"
        if gt_traces
        else "<section><h2>Operations and regions</h2><p>None recorded.</p></section>"
    )
    span_rows = _span_category_rows(spans)
    if span_rows:
        sections.append(
            '<section id="span-categories"><h2>Modules and regions by category</h2>'
            + _table(
                [
                    "module or region",
                    "device",
                    "category",
                    "calls",
                    "total delta",
                    "largest delta",
                    "largest peak delta",
                ],
                span_rows,
                {3, 4, 5, 6},
            )
            + '<p class="note">Each storage counts under its category as it changes: a '
            "gradient that backward makes is a temporary until it is accumulated into the "
            "parameter's .grad, and a gradient from then on.</p></section>"
        )
    top = _top_tensors(doc)
    if top:
        sections.append(
            "<section><h2>Largest live tensors (last snapshot)</h2>"
            + _table(
                [
                    "device",
                    "MiB",
                    "shape",
                    "dtype",
                    "requires_grad",
                    "category",
                    "operation",
                    "snapshot",
                ],
                top,
                {1},
            )
            + "</section>"
        )
    if doc.hotspots:
        sections.append(
            "<section><h2>Hotspots</h2>"
            + _table(
                ["device", "kind", "site", "bytes"],
                [
                    [
                        str(h.get("device", "")),
                        str(h.get("kind", "")),
                        str(h.get("site", "")),
                        human_bytes(int(h.get("bytes", 0))),
                    ]
                    for h in doc.hotspots
                ],
                {3},
            )
            + "</section>"
        )
    if doc.pytorch_operations:
        ops = sorted(doc.pytorch_operations, key=lambda o: -float(o.get("cpu_time_us", 0)))[:50]
        sections.append(
            "<section><h2>PyTorch operators</h2>"
            + _table(
                ["operator", "count", "CPU µs", "CUDA µs", "CPU MiB", "CUDA MiB", "input shapes"],
                [
                    [
                        str(o.get("op_name", "")),
                        str(o.get("count", "")),
                        f"{float(o.get('cpu_time_us', 0)):.0f}",
                        f"{float(o.get('cuda_time_us', 0)):.0f}",
                        f"{float(o.get('cpu_memory_mb', 0)):.3f}",
                        f"{float(o.get('cuda_memory_mb', 0)):.3f}",
                        str(o.get("input_shapes", "")),
                    ]
                    for o in ops
                ],
                {1, 2, 3, 4, 5},
            )
            + "</section>"
        )
    progress(0.85, "html page")
    page = plotly_page(title, header, sections, payload)
    progress(1.0, "html")
    return page


def plotly_page(
    title: str, header: str, sections: list[str], payload: str, script: str | None = None
) -> str:
    """A self-contained report page: the title, the header line (HTML), the sections,
    plotly.js inlined and the figures' JSON (``payload``) that the page's ``script``
    (default: the profile report's) draws."""
    return "".join(
        [
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
            f'<header><h1>{_esc(title)}</h1><div class="meta">{header}</div></header><main>',
            "".join(sections),
            "</main>\n<script>",
            _plotly()[1].get_plotlyjs().replace("</script", "<\\/script"),
            '</script>\n<script type="application/json" id="memlord-data">',
            _json_for_script(payload),
            "</script>\n<script>",
            _JS if script is None else script,
            "</script></body></html>\n",
        ]
    )


def write_html(
    doc: Profile,
    path: str | os.PathLike[str],
    progress: Progress = no_progress,
    *,
    buckets: int = DEFAULT_BUCKETS,
) -> None:
    text = render_html(doc, buckets=buckets, progress=progress)
    with atomic_write(path) as f:
        f.write(text)


__all__ = ["render_html", "write_html", "EXTRA_HINT"]
