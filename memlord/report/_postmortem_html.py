"""The post-mortem's HTML page: one self-contained file in the report's style (its CSS,
tables and category colours), no plotly and nothing fetched.  Every string from the
document is HTML-escaped."""

from __future__ import annotations

from typing import Any

from .._bytes import format_bytes
from ._html import _CSS, CATEGORY_COLORS, OTHER_COLOR, _esc, _table

_EXTRA_CSS = """
.bar{display:flex;height:18px;border-radius:3px;overflow:hidden;margin:6px 0;max-width:900px;
background:#eee}
.bar span{display:block;height:100%}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px}
.kv th{font-weight:600;color:#374151}
.err{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;background:#fef2f2;
border:1px solid #fecaca;border-radius:4px;padding:6px 8px;max-height:240px;overflow:auto}
h3{font-size:14px;margin:12px 0 4px}
.verdict{font-size:15px;margin:4px 0 10px}
"""

_JS = """document.body.setAttribute('data-memlord-ready', performance.now().toFixed(1));"""


def _b(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, int):
        return "n/a"
    return format_bytes(n)


def _n(v: Any) -> str:
    return "n/a" if isinstance(v, bool) or not isinstance(v, int) else f"{v:,}"


def _pct(part: Any, whole: Any) -> str:
    if not isinstance(part, int) or not isinstance(whole, int) or whole <= 0:
        return "n/a"
    return f"{100.0 * part / whole:.1f}%"


def _shape(shape: Any) -> str:
    if not isinstance(shape, list):
        return "?"
    return "x".join(map(str, shape)) or "()"


def _kv(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
    return f'<table class="kv"><tbody>{body}</tbody></table>'


def _library_rows(seg: dict[str, Any]) -> list[tuple[str, str]]:
    """The untracked bytes named library workspaces (by their size), and the rest."""
    lib = seg.get("library_workspaces")
    if not isinstance(lib, dict) or not isinstance(lib.get("by_name"), dict):
        return []
    rows = []
    for name, g in lib["by_name"].items():
        if isinstance(g, dict):
            rows.append(
                (
                    f"of which {name} (by size)",
                    f"{_b(g.get('bytes'))} in {_n(g.get('blocks'))} blocks",
                )
            )
    share = _pct(seg.get("explained"), seg.get("allocated"))
    rows.append(
        ("tracked storages and library workspaces", f"{_b(seg.get('explained'))} ({share})")
    )
    rows.append(("unexplained", _b(seg.get("unexplained"))))
    return rows


def _category_bar(cats: dict[str, int]) -> str:
    total = sum(v for v in cats.values() if isinstance(v, int) and v > 0)
    if total <= 0:
        return ""
    parts = []
    for name, v in cats.items():
        if not isinstance(v, int) or v <= 0:
            continue
        color = CATEGORY_COLORS.get(name, OTHER_COLOR)
        parts.append(
            f'<span style="width:{100.0 * v / total:.3f}%;background:{color}" '
            f'title="{_esc(name)}: {_esc(format_bytes(v))}"></span>'
        )
    return '<div class="bar">' + "".join(parts) + "</div>"


def _grouped(title: str, what: str, t: Any, total: int) -> str:
    if not isinstance(t, dict):
        return ""
    rows = [
        [
            str(r.get("name") if r.get("name") is not None else "(none)"),
            _b(r.get("bytes")),
            _pct(r.get("bytes"), total),
            str(r.get("count", "")),
        ]
        for r in t.get("top", [])
    ]
    rest = t.get("rest") or {}
    if rest.get("groups"):
        rows.append(
            [
                f"{rest['groups']} more",
                _b(rest.get("bytes")),
                _pct(rest.get("bytes"), total),
                str(rest.get("count", "")),
            ]
        )
    if not rows:
        return ""
    return f"<h3>{_esc(title)}</h3>" + _table([what, "bytes", "share", "storages"], rows, {1, 2, 3})


def _device(dev: str, d: dict[str, Any], top: int) -> str:
    out = [f'<section class="device" id="device-{_esc(dev)}"><h2>{_esc(dev)}</h2>']
    led = d.get("ledger") or {}
    tracked = d.get("tracked") or {}
    cov = d.get("coverage") or {}
    rows = [
        ("memlord's live bytes (ledger)", _b(led.get("allocated"))),
        ("peak", _b(led.get("peak_allocated"))),
        ("tracked live storages", f"{_b(tracked.get('bytes'))} in {tracked.get('count', 0)}"),
    ]
    if cov:
        rows += [
            ("with a category (not other)", _pct(cov.get("with_category"), cov.get("bytes"))),
            ("with a call site", _pct(cov.get("with_site"), cov.get("bytes"))),
            (
                "named (parameter, gradient, optimizer state, buffer)",
                _pct(cov.get("named"), cov.get("bytes")),
            ),
        ]
    if d.get("untracked_ledger_bytes"):
        rows.append(
            ("counted but not tracked (allocate(), moves)", _b(d["untracked_ledger_bytes"]))
        )
    out.append(_kv(rows))
    cats = d.get("categories")
    if isinstance(cats, dict):
        out.append("<h3>By category</h3>" + _category_bar(cats))
        total = sum(v for v in cats.values() if isinstance(v, int))
        crow = [
            [f"{k}", _b(v), _pct(v, total)]
            for k, v in sorted(cats.items(), key=lambda kv: -kv[1])
            if isinstance(v, int) and v > 0
        ]
        if crow:
            out.append(_table(["category", "bytes", "share"], crow, {1, 2}))
    largest = d.get("largest") or []
    if largest:
        rows2 = [
            [
                str(e.get("name") or ""),
                _b(e.get("nbytes")),
                str(e.get("category") or ""),
                _shape(e.get("shape")),
                str(e.get("dtype") or ""),
                str(e.get("site") or ""),
                str(e.get("region") or ""),
            ]
            for e in largest
        ]
        out.append(
            f"<h3>Largest live storages (top {len(largest)})</h3>"
            + _table(["name", "bytes", "category", "shape", "dtype", "site", "region"], rows2, {1})
        )
    total = int(tracked.get("bytes") or 0)
    out.append(_grouped("By module", "module", d.get("by_module"), total))
    out.append(_grouped("By region (at birth)", "region", d.get("by_region"), total))
    out.append(_grouped("By call site", "site", d.get("by_site"), total))
    alloc = d.get("allocator")
    if isinstance(alloc, dict):
        counts = ("retries", "ooms", "segments", "allocations")
        out.append(
            "<h3>The CUDA caching allocator</h3>"
            + _kv(
                [(k.replace("_", " "), _n(v) if k in counts else _b(v)) for k, v in alloc.items()]
            )
        )
    seg = d.get("segments")
    if isinstance(seg, dict):
        share = _pct(seg.get("attributed"), seg.get("allocated"))
        out.append(
            "<h3>Allocator blocks attributed to tracked storages</h3>"
            + _kv(
                [
                    ("segments", str(seg.get("segments"))),
                    ("reserved", _b(seg.get("reserved"))),
                    ("allocated blocks", _b(seg.get("allocated"))),
                    (
                        "attributed to tracked storages",
                        f"{_b(seg.get('attributed'))} ({share})",
                    ),
                    (
                        "untracked",
                        f"{_b(seg.get('untracked'))} in {seg.get('untracked_blocks_count')} blocks",
                    ),
                    *_library_rows(seg),
                    ("awaiting free", _b(seg.get("awaiting_free"))),
                    ("inactive (cached, free)", _b(seg.get("inactive"))),
                ]
            )
        )
        ub = seg.get("untracked_blocks") or []
        if ub:
            out.append(
                "<h3>Largest untracked blocks</h3>"
                + _table(
                    ["address", "bytes", "library", "allocated at"],
                    [
                        [
                            hex(int(b.get("address", 0))),
                            _b(b.get("size")),
                            str(b.get("library") or ""),
                            "; ".join(
                                f"{f.get('filename')}:{f.get('line')}"
                                for f in (b.get("frames") or [])[:3]
                                if isinstance(f, dict)
                            )
                            or "(no frames recorded)",
                        ]
                        for b in ub
                    ],
                    {1},
                )
            )
    drv = d.get("driver")
    if isinstance(drv, dict):
        out.append(
            "<h3>The device (driver)</h3>"
            + _kv(
                [
                    ("total", _b(drv.get("total"))),
                    ("free", _b(drv.get("free"))),
                    ("reserved by this process", _b(drv.get("reserved"))),
                    ("held by other processes", _b(drv.get("other_processes"))),
                ]
            )
        )
    out.append("</section>")
    return "".join(out)


def devices_of(doc: dict[str, Any]) -> dict[str, Any]:
    d = doc.get("devices")
    return d if isinstance(d, dict) else {}


def _verdict(req: dict[str, Any], devices: dict[str, Any]) -> str:
    """One sentence: what was asked, what memlord counts on that device, the largest
    category and holder, and (CUDA) what the allocator and other processes hold."""
    dev = req.get("device")
    d = devices.get(dev) if isinstance(dev, str) else None
    parts = [f"{_b(req.get('bytes'))} requested on {dev or '?'}"]
    if isinstance(d, dict):
        led = d.get("ledger") or {}
        if isinstance(led.get("allocated"), int):
            parts.append(f"memlord counts {_b(led['allocated'])} live there")
        cats = d.get("categories") or {}
        if cats:
            cat, n = max(cats.items(), key=lambda kv: kv[1] if isinstance(kv[1], int) else -1)
            if isinstance(n, int) and n > 0:
                parts.append(f"most of it {cat} ({_b(n)})")
        largest = d.get("largest") or []
        if largest:
            first = largest[0]
            parts.append(f"the largest storage: {first.get('name')} ({_b(first.get('nbytes'))})")
        alloc = d.get("allocator") or {}
        if isinstance(alloc.get("reserved"), int):
            parts.append(
                f"the allocator has {_b(alloc.get('allocated'))} allocated, "
                f"{_b(alloc.get('reserved'))} reserved"
            )
        drv = d.get("driver") or {}
        if isinstance(drv.get("other_processes"), int):
            parts.append(f"other processes hold {_b(drv['other_processes'])}")
    return f'<p class="verdict">{_esc("; ".join(parts))}.</p>'


def render(doc: dict[str, Any]) -> str:
    req = doc.get("request") or {}
    dev = req.get("device") or "?"
    title = f"memlord: out of memory on {dev}"
    meta = " · ".join(
        _esc(x)
        for x in (
            str(doc.get("time_iso", "")),
            f"host {doc.get('host', '?')}",
            f"pid {doc.get('pid', '?')}",
            f"rank {doc['rank']}" if doc.get("rank") is not None else "",
            f"schema {doc.get('schema', '?')}",
        )
        if x
    )
    sections = []
    rrows = [
        ("device", str(dev)),
        ("bytes requested", f"{_b(req.get('bytes'))} ({req.get('bytes')})"),
        ("what", str(req.get("what") or "?")),
        ("source", str(req.get("source") or "?")),
        ("call site", str(req.get("site") or "?")),
        ("module", str(req.get("module") or "")),
        ("regions open", " > ".join(map(str, req.get("regions") or []))),
        ("thread", str((req.get("thread") or {}).get("name") or "")),
    ]
    body = _verdict(req, devices_of(doc)) + _kv(rrows)
    stack = req.get("stack") or []
    if stack:
        body += "<h3>Stack (innermost last)</h3>" + _table(
            ["file", "line", "function"],
            [[str(f.get("file")), str(f.get("line")), str(f.get("function"))] for f in stack],
            {1},
        )
    if req.get("error"):
        body += f'<h3>Error</h3><div class="err">{_esc(req["error"])}</div>'
    sections.append(f'<section id="request"><h2>The failed request</h2>{body}</section>')
    top = int(doc.get("top") or 20)
    devices = doc.get("devices") or {}
    # the failed request's device first
    order = sorted(devices, key=lambda k: (k != dev, str(k)))
    for name in order:
        if isinstance(devices[name], dict):
            sections.append(_device(str(name), devices[name], top))
    notes = doc.get("notes") or []
    if notes:
        sections.append(
            '<section id="notes"><h2>Notes</h2><ul>'
            + "".join(f"<li>{_esc(n)}</li>" for n in notes)
            + "</ul></section>"
        )
    legend = "".join(
        f'<span class="swatch" style="background:{c}"></span>{_esc(k)} &nbsp;'
        for k, c in CATEGORY_COLORS.items()
    )
    sections.append(f'<p class="note">{legend}</p>')
    return "".join(
        [
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_esc(title)}</title><style>{_CSS}{_EXTRA_CSS}</style></head><body>",
            f'<header><h1>{_esc(title)}</h1><div class="meta">{meta}</div></header><main>',
            "".join(sections),
            f"</main>\n<script>{_JS}</script></body></html>\n",
        ]
    )
