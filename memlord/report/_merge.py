"""``python -m memlord merge``: the files of several ranks (or processes) as one report.

No collective and no process group: each input is a file a rank wrote on its own (a
profile from :mod:`memlord.profiler` or ``lord.export``, or an out-of-memory
post-mortem), so a merge works after a crash or an OOM, when no rank can talk to
another.  The result has a row per input file (host, rank, pid, each device's peak, live
bytes and bytes by category at the peak, when it peaked, OOMs, top allocation sites) and
per device type (``cpu``, ``cuda``) the imbalance between ranks: the largest peak over
the smallest, and which rank peaked, when.

Times: each profile's clock is its own (monotonic ns); its ``start_ns`` and
``start_unix`` turn a time into wall-clock seconds, and the merge measures every time
from the earliest start of all inputs, so the ranks' times line up.

Reading is one function per input kind, chosen by the JSON's ``schema`` key
(:data:`READERS`).  docs/ranks.md documents the command and the merged document.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from .._bytes import human_bytes
from ._util import MiB, atomic_write, plain_int, unix_s

SCHEMA = "memlord.merge/1"
#: the profile's schema (memlord.report.SCHEMA) and the post-mortem's (docs/oom.md)
PROFILE_SCHEMA = "memlord.profile"
POST_MORTEM_SCHEMA = "memlord.oom/1"
#: top allocation sites kept per rank
TOP_SITES = 5
_RANK_IN_NAME = re.compile(r"(?:^|[_-])rank(\d+)(?=[_.-]|$)")


class InputError(ValueError):
    """One input file that cannot be merged; ``str()`` is ``"<file>: <why>"``."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


# ---- small readers --------------------------------------------------------------------------


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _cats(v: Any) -> dict[str, int]:
    """A ``{category: bytes}`` mapping, keeping the int entries only."""
    if not isinstance(v, dict):
        return {}
    return {str(k): int(n) for k, n in v.items() if plain_int(n) is not None}


def _rank_from_name(path: str) -> int | None:
    m = _RANK_IN_NAME.search(Path(path).name)
    return int(m.group(1)) if m else None


def _kind(data: Any) -> str:
    names: dict[type, str] = {dict: "an object", list: "a list", str: "a string"}
    return names.get(type(data), type(data).__name__)


# ---- one reader per input kind -----------------------------------------------------------------


def _row(path: str, kind: str) -> dict[str, Any]:
    return {
        "file": path,
        "kind": kind,
        "host": None,
        "pid": None,
        "rank": None,
        "world_size": None,
        "start_unix": None,
        "time_unix": None,
        "devices": {},
        "ooms": 0,
        "top_sites": [],
        "sites": None,
    }


def row_from_profile(data: dict[str, Any], path: str) -> dict[str, Any]:
    """A rank's row from a memlord profile (``schema: "memlord.profile"``): the ledger's
    counters per device (peak, live, bytes by category at the peak, OOMs), the peak's
    time from the memory series (events, else samples), the top allocation sites."""
    from ._json import from_dict
    from ._series import memory_series
    from ._validate import ProfileError

    try:
        doc = from_dict(data, source=path)
    except ProfileError as exc:
        problems = "; ".join(exc.problems)
        raise InputError(path, "not a readable memlord profile: " + problems) from None
    md = doc.metadata
    if not doc.counters:
        raise InputError(path, "the profile has no per-device counters (memlord.counters)")
    row = _row(path, "profile")
    row["host"] = _str(md.get("host"))
    row["pid"] = plain_int(md.get("pid"))
    row["rank"] = plain_int(md.get("rank"))
    if row["rank"] is None:
        row["rank"] = _rank_from_name(path)
    row["world_size"] = plain_int(md.get("world_size"))
    row["start_unix"] = _num(md.get("start_unix"))
    try:
        series = memory_series(doc)
    except (ValueError, IndexError, KeyError):  # a document the timeline cannot draw
        series = {}

    ends = []
    for dev, c in sorted(doc.counters.items(), key=lambda kv: (kv[0] != "cpu", kv[0])):
        if not isinstance(c, dict):
            continue
        peak = plain_int(c.get("peak_allocated"))
        live = plain_int(c.get("allocated"))
        entry: dict[str, Any] = {
            "peak": peak if peak is not None else live,
            "live": live,
            "categories": _cats(c.get("categories")),
            "peak_categories": _cats(c.get("peak_categories")),
            "peak_unix": None,
            "ooms": plain_int(c.get("ooms")) or 0,
        }
        s = series.get(dev)
        if s is not None and len(s):
            i = int(np.argmax(s.allocated))
            # the moment of the peak where the record reaches the ledger's peak (a ring
            # that dropped it, or a lord without one, does not say when)
            if peak is not None and int(s.allocated[i]) == peak:
                entry["peak_unix"] = unix_s(md, int(s.t_ns[i]))
            ends.append(int(s.t_ns[-1]))
        row["devices"][dev] = entry
    row["ooms"] = sum(d["ooms"] for d in row["devices"].values())
    if ends:
        row["time_unix"] = unix_s(md, max(ends))
    sites: list[dict[str, Any]] = [
        {"device": str(h.get("device")), "site": str(h.get("site")), "bytes": int(h["bytes"])}
        for h in doc.hotspots
        if isinstance(h, dict)
        and h.get("kind") == "alloc"
        and plain_int(h.get("bytes")) is not None
    ]
    sites.sort(key=lambda h: (-h["bytes"], h["device"], h["site"]))
    row["top_sites"] = sites[:TOP_SITES]
    row["sites"] = "allocated in all"
    return row


def row_from_post_mortem(data: dict[str, Any], path: str) -> dict[str, Any]:
    """A rank's row from an out-of-memory post-mortem (``schema: "memlord.oom/1"``,
    docs/oom.md): per device the ledger's peak, live bytes and categories at the OOM,
    the live bytes' top sites, one OOM at the document's ``time``.

    ADAPTER: after the post-mortem's own check (``validate_post_mortem``), it reads only
    documented keys (``host``, ``pid``, ``rank``, ``world_size``, ``time``,
    ``request.device``, ``devices[d].ledger``, ``devices[d].by_site``), each
    defensively: a value of another type reads as unknown."""
    from ._postmortem import validate_post_mortem

    try:  # the post-mortem's own check of its schema and top-level keys
        validate_post_mortem(data, path)
    except ValueError as exc:
        raise InputError(path, str(exc).removeprefix(f"{path}: ")) from None
    devices = data.get("devices")
    if not isinstance(devices, dict):
        raise InputError(path, "not a readable post-mortem: 'devices' is not an object")
    row = _row(path, "post-mortem")
    row["host"] = _str(data.get("host"))
    row["pid"] = plain_int(data.get("pid"))
    row["rank"] = plain_int(data.get("rank"))
    if row["rank"] is None:
        row["rank"] = _rank_from_name(path)
    row["world_size"] = plain_int(data.get("world_size"))
    row["time_unix"] = _num(data.get("time"))
    sites: list[dict[str, Any]] = []
    for dev in sorted(devices, key=lambda d: (d != "cpu", d)):
        d = devices[dev]
        if not isinstance(d, dict):
            continue
        ledger = cast(
            "dict[str, Any]", d.get("ledger") if isinstance(d.get("ledger"), dict) else {}
        )
        live = plain_int(ledger.get("allocated"))
        peak = plain_int(ledger.get("peak_allocated"))
        row["devices"][str(dev)] = {
            "peak": peak if peak is not None else live,
            "live": live,
            "categories": _cats(ledger.get("categories") or d.get("categories")),
            "peak_categories": _cats(ledger.get("peak_categories")),
            "peak_unix": None,  # a post-mortem says when memory ran out, not when it peaked
            "ooms": 0,
        }
        table = d.get("by_site")
        for entry in table.get("top", []) if isinstance(table, dict) else []:
            if isinstance(entry, dict) and plain_int(entry.get("bytes")) is not None:
                sites.append(
                    {
                        "device": str(dev),
                        "site": str(entry.get("name") or "(no site)"),
                        "bytes": int(entry["bytes"]),
                    }
                )
    request = cast(
        "dict[str, Any]", data.get("request") if isinstance(data.get("request"), dict) else {}
    )
    failed = _str(request.get("device"))
    if failed in row["devices"]:
        row["devices"][failed]["ooms"] = 1
    row["ooms"] = 1
    sites.sort(key=lambda h: (-h["bytes"], h["device"], h["site"]))
    row["top_sites"] = sites[:TOP_SITES]
    row["sites"] = "live at the OOM"
    return row


#: schema -> reader (a reader takes the parsed JSON object and the path as given)
READERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    PROFILE_SCHEMA: row_from_profile,
    POST_MORTEM_SCHEMA: row_from_post_mortem,
}


def read_input(path: str) -> dict[str, Any]:
    """One input file as a row; :class:`InputError` saying why it cannot be merged."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError("read_input(): argument 'path' must be a str or os.PathLike")
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, "is a folder, not a file") from None
    except OSError as exc:
        raise InputError(path, f"cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(path, "not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise InputError(path, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise InputError(path, "not JSON that can be read (nested too deeply)") from None
    if not isinstance(data, dict):
        raise InputError(path, f"not a memlord profile or post-mortem (the JSON is {_kind(data)})")
    schema = data.get("schema")
    if schema == SCHEMA:
        raise InputError(path, "a merged report already: merge the per-rank files instead")
    reader = READERS.get(schema) if isinstance(schema, str) else None
    if reader is None:
        what = "no 'schema' key" if "schema" not in data else f"schema {schema!r}"
        raise InputError(
            path,
            f"not a memlord profile or post-mortem ({what}; expected "
            + " or ".join(repr(s) for s in READERS)
            + ")",
        )
    try:
        return reader(data, path)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - a value no check foresaw: still one line
        what = "profile" if reader is row_from_profile else "post-mortem"
        raise InputError(path, f"not a readable {what}: {type(exc).__name__}: {exc}") from None


# ---- the merged document -------------------------------------------------------------------


def _dev_type(dev: str) -> str:
    return dev.partition(":")[0]


def _label(row: dict[str, Any]) -> str:
    return f"rank {row['rank']}" if row["rank"] is not None else Path(row["file"]).name


def merge_rows(rows: Sequence[dict[str, Any]], bad: Sequence[InputError] = ()) -> dict[str, Any]:
    """The merged document of ``rows`` (from :func:`read_input`)."""
    rows = sorted(rows, key=lambda r: (r["rank"] is None, r["rank"] or 0, r["file"]))
    starts = [r["start_unix"] for r in rows if r["start_unix"] is not None]
    starts += [r["time_unix"] for r in rows if r["start_unix"] is None and r["time_unix"]]
    t0 = min(starts) if starts else None

    def rel(t: float | None) -> float | None:
        return None if t is None or t0 is None else round(t - t0, 6)

    for r in rows:
        r["time_s"] = rel(r["time_unix"])
        for d in r["devices"].values():
            d["peak_s"] = rel(d["peak_unix"])
    imbalance: dict[str, Any] = {}
    types = sorted(
        {_dev_type(d) for r in rows for d in r["devices"]}, key=lambda t: (t == "cpu", t)
    )
    for typ in types:
        # a rank's peak on a device type: its largest device peak of that type
        best = []
        for r in rows:
            devs = [
                (d["peak"], dev)
                for dev, d in r["devices"].items()
                if _dev_type(dev) == typ and d["peak"] is not None
            ]
            if devs:
                peak, dev = max(devs)
                best.append((peak, r, dev))
        if not best:
            continue

        # of equal peaks, a file that says when it peaked (a rank's profile beside its
        # post-mortem: the same ledger peak), then the lowest rank
        def known(b: tuple[int, dict[str, Any], str]) -> bool:
            return b[1]["devices"][b[2]]["peak_s"] is not None

        hi = max(best, key=lambda b: (b[0], known(b), -(b[1]["rank"] or 0)))
        lo = min(best, key=lambda b: (b[0], not known(b), b[1]["rank"] or 0))

        def who(b: tuple[int, dict[str, Any], str]) -> dict[str, Any]:
            peak, r, dev = b
            return {
                "rank": r["rank"],
                "file": r["file"],
                "host": r["host"],
                "device": dev,
                "peak": peak,
                "peak_s": r["devices"][dev]["peak_s"],
            }

        imbalance[typ] = {
            "files": len(best),
            "ratio": (hi[0] / lo[0]) if lo[0] > 0 else None,
            "max": who(hi),
            "min": who(lo),
        }
    main = next(iter(imbalance), None)
    return {
        "schema": SCHEMA,
        "generated_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "t0_unix": t0,
        "inputs": [r["file"] for r in rows],
        "bad_inputs": [{"file": e.path, "problem": e.problem} for e in bad],
        "ranks": rows,
        "imbalance": imbalance,
        "peaked": None if main is None else {"type": main, **imbalance[main]["max"]},
    }


def merge_files(paths: Sequence[str]) -> tuple[list[dict[str, Any]], list[InputError]]:
    """Every path read: the rows of the good ones and the errors of the others."""
    rows, bad = [], []
    for p in paths:
        try:
            rows.append(read_input(p))
        except InputError as exc:
            bad.append(exc)
    return rows, bad


# ---- writing --------------------------------------------------------------------------------


def output_format(path: str) -> str:
    name = os.fspath(path).lower()
    if name.endswith(".trace.json"):
        raise ValueError(
            f"-o {path}: a merged report is .json or .html, not a trace (--trace writes one)"
        )
    if name.endswith(".json"):
        return "json"
    if name.endswith((".html", ".htm")):
        return "html"
    raise ValueError(f"-o {path}: the name must end in .json, .html or .htm")


def write_merged(doc: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write the merged document to ``path`` (JSON or HTML by its name), atomically."""
    fmt = output_format(os.fspath(path))
    text = (
        json.dumps(doc, indent=1, allow_nan=False) + "\n"
        if fmt == "json"
        else render_merged_html(doc)
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(text)
    return fmt


def _bytes(n: int | None) -> str:
    return "" if n is None else human_bytes(n)


def _secs(t: float | None) -> str:
    return "" if t is None else f"{t:.3f} s"


def render_merged_html(doc: dict[str, Any]) -> str:
    """The merged report as one self-contained HTML page, in the report's style (its
    CSS, tables and category colors); the chart of peaks by category needs plotly, as
    the profile's report does."""
    from ._html import (
        CATEGORY_COLORS,
        HOVER_NAME,
        OTHER_COLOR,
        _esc,
        _plot_text,
        _plotly,
        _table,
        plotly_page,
    )

    go, _ = _plotly()
    rows = doc["ranks"]
    imb = doc["imbalance"]
    peaked = doc["peaked"]
    parts = [
        f"generated {_esc(doc['generated_at'])}",
        f"{len(rows)} file{'s' if len(rows) != 1 else ''}",
    ]
    if doc["bad_inputs"]:
        parts.append(f"{len(doc['bad_inputs'])} left out")
    sections = []
    # imbalance, per device type
    imb_rows = []
    for typ, v in imb.items():
        imb_rows.append(
            [
                typ,
                str(v["files"]),
                "" if v["ratio"] is None else f"{v['ratio']:.3f}",
                _label_of(v["max"]),
                _bytes(v["max"]["peak"]),
                _secs(v["max"]["peak_s"]),
                _label_of(v["min"]),
                _bytes(v["min"]["peak"]),
            ]
        )
    lead = ""
    if peaked is not None:
        lead = (
            f'<p id="peaked">{_esc(_label_of(peaked))} peaked highest on '
            f"{_esc(peaked['device'])}: {_esc(_bytes(peaked['peak']))}"
            + (
                f", {_esc(_secs(peaked['peak_s']))} after the earliest start"
                if peaked["peak_s"] is not None
                else ""
            )
            + "</p>"
        )
    sections.append(
        '<section id="imbalance"><h2>Imbalance</h2>'
        + lead
        + _table(
            [
                "device type",
                "files",
                "max / min peak",
                "highest",
                "its peak",
                "when",
                "lowest",
                "its peak",
            ],
            imb_rows,
            {1, 2, 4, 5, 7},
        )
        + '<p class="note">Per device type, each file\'s largest device peak; the ratio is '
        "empty when the smallest is 0. Times are seconds after the earliest start of "
        "all inputs (wall clock).</p></section>"
    )
    # a row per rank and device
    table_rows = []
    for r in rows:
        for dev, d in r["devices"].items():
            table_rows.append(
                [
                    _label(r),
                    r["host"] or "",
                    "" if r["pid"] is None else str(r["pid"]),
                    r["kind"],
                    Path(r["file"]).name,
                    dev,
                    _bytes(d["peak"]),
                    _bytes(d["live"]),
                    _secs(d["peak_s"]),
                    str(d["ooms"]),
                ]
            )
    sections.append(
        '<section id="ranks"><h2>Ranks</h2>'
        + _table(
            ["rank", "host", "pid", "kind", "file", "device", "peak", "live", "peak at", "OOMs"],
            table_rows,
            {2, 6, 7, 8, 9},
        )
        + '<p class="note">Live: at the end of a profile, or when memory ran out for a '
        "post-mortem.</p></section>"
    )
    # the peak by category: a stacked bar per rank, per device type
    traces = []
    cats_seen: list[str] = []
    for r in rows:
        for d in r["devices"].values():
            for c, n in d["peak_categories"].items():
                if n and c not in cats_seen:
                    cats_seen.append(c)
    xs = [f"{_plot_text(_label(r))} {_plot_text(dev)}" for r in rows for dev in r["devices"]]
    for c in cats_seen:
        ys = [d["peak_categories"].get(c, 0) / MiB for r in rows for d in r["devices"].values()]
        traces.append(
            {
                "type": "bar",
                "name": _plot_text(c),
                "x": xs,
                "y": ys,
                "marker": {"color": CATEGORY_COLORS.get(c, OTHER_COLOR)},
                # the name by reference: plotly substitutes %{...} in the template's text
                "hovertemplate": HOVER_NAME + "<br>%{x}<br>%{y:.3f} MiB<extra></extra>",
            }
        )
    fig = go.Figure(
        data=traces,
        layout={
            "height": 380,
            "barmode": "stack",
            "margin": {"l": 72, "r": 20, "t": 30, "b": 60},
            # a fixed left margin (see _html._MARGIN: an axis moving a margin as well as
            # the legend can keep plotly redrawing); the x axis keeps automargin for its
            # labels, whatever their length
            "yaxis": {"title": {"text": "MiB at the peak"}, "automargin": False},
            "legend": {"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
            "template": "plotly_white",
        },
    )
    cat_rows = []
    for r in rows:
        for dev, d in r["devices"].items():
            for c, n in d["peak_categories"].items():
                if n or d["categories"].get(c):
                    cat_rows.append(
                        [_label(r), dev, c, _bytes(n), _bytes(d["categories"].get(c, 0))]
                    )
    sections.append(
        '<section id="categories"><h2>By category</h2>'
        + ('<div id="peaks" class="plot"></div>' if traces else "")
        + _table(["rank", "device", "category", "at the peak", "live"], cat_rows, {3, 4})
        + "</section>"
    )
    site_rows = [
        [_label(r), s["device"], s["site"], _bytes(s["bytes"]), r["sites"] or ""]
        for r in rows
        for s in r["top_sites"]
    ]
    sections.append(
        '<section id="sites"><h2>Top sites per rank</h2>'
        + _table(["rank", "device", "site", "bytes", "bytes counted"], site_rows, {3})
        + "</section>"
    )
    if doc["bad_inputs"]:
        sections.append(
            '<section id="left-out"><h2>Files left out</h2>'
            + _table(["file", "why"], [[b["file"], b["problem"]] for b in doc["bad_inputs"]], set())
            + "</section>"
        )
    payload = '{"peaks":' + fig.to_json() + "}"
    title = "memlord: ranks merged"
    return plotly_page(title, " · ".join(parts), sections, payload, _JS)


def _label_of(who: dict[str, Any]) -> str:
    return f"rank {who['rank']}" if who["rank"] is not None else Path(who["file"]).name


_JS = """
(function(){
  var t0 = performance.now();
  var data = JSON.parse(document.getElementById('memlord-data').textContent);
  var div = document.getElementById('peaks');
  var done = div && data.peaks.data.length
    ? Plotly.newPlot(div, data.peaks.data, data.peaks.layout,
                     {displaylogo: false, responsive: true})
    : Promise.resolve();
  Promise.resolve(done).then(function(){
    document.body.setAttribute('data-memlord-ready', performance.now().toFixed(1));
    document.body.setAttribute('data-memlord-draw-ms', (performance.now() - t0).toFixed(1));
  });
})();
"""


# ---- the command ------------------------------------------------------------------------------


def _trace_profiles(rows: Sequence[dict[str, Any]]) -> list[Any]:
    """The profiles among the merged files, read as documents, in rank order (then
    path): what ``--trace`` draws.  A post-mortem has no time line."""
    from ._json import load

    profiles = [r for r in rows if r["kind"] == "profile"]
    profiles.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["file"]))
    return [load(r["file"]) for r in profiles]


def command(
    files: Sequence[str],
    output: str | None,
    *,
    keep_going: bool,
    say: Callable[[str], None],
    trace: str | None = None,
) -> int:
    """``python -m memlord merge FILES... [-o OUT] [--trace OUT.trace.json]
    [--keep-going]``.  Exit status: 0 when every file was merged; 2 when an output name
    is wrong, an output cannot be written, or a file is bad without ``--keep-going``
    (nothing written); 1 when ``--keep-going`` wrote the outputs of the good files and
    left bad ones out."""
    try:
        if output is None and trace is None:
            raise ValueError("merge: -o OUT (.json or .html) or --trace F (.trace.json), or both")
        if trace is not None and not os.fspath(trace).lower().endswith(".trace.json"):
            raise ValueError(f"--trace {trace}: the name must end in .trace.json")
        if output is not None and output_format(output) == "html":
            from ._html import _plotly

            _plotly()  # the chart needs plotly: say so before reading anything
    except (ValueError, ImportError) as exc:
        say(str(exc))
        return 2
    rows, bad = merge_files(files)
    for error in bad:
        say(str(error))
    if bad and not keep_going:
        say(f"nothing written: {len(bad)} bad file(s) (--keep-going merges the others)")
        return 2
    if not rows:
        say("nothing written: no file could be merged")
        return 2
    docs: list[Any] = []
    if trace is not None:
        try:
            docs = _trace_profiles(rows)
        except Exception as exc:  # noqa: BLE001 - read once already: one line, as a bad file
            say(f"nothing written: --trace: a profile could not be read again: {exc}")
            return 2
        if not docs:
            say(
                f"nothing written: --trace {trace}: no profile among the files (a post-mortem "
                "has no time line)"
            )
            return 2
        left = sum(1 for r in rows if r["kind"] != "profile")
        if left:
            say(f"--trace: {left} post-mortem(s) have no time line: not in the trace")
    written = []
    for what, out in (("report", output), ("trace", trace)):
        if out is None:
            continue
        try:
            if what == "report":
                write_merged(merge_rows(rows, bad), out)
            else:
                from ._trace import merged_chunks

                Path(out).parent.mkdir(parents=True, exist_ok=True)
                with atomic_write(out) as f:
                    for chunk in merged_chunks(docs):
                        f.write(chunk)
        except OSError as exc:
            say(f"cannot write {out}: {exc.strerror or exc}")
            return 2
        written.append(out)
    merged = f"({len(rows)} file(s) merged" + (f", {len(bad)} left out)" if bad else ")")
    for out in written:
        say(f"wrote {out} {merged}")
    return 1 if bad else 0
