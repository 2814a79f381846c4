"""A profile document from a lord's own state: what ``lord.export(path)`` writes and what
the profiler's documents are fed from.

* **events** from the lord's event ring (``lord.record_events``): every record after
  the last ``reset()``, with its time, kind, source, device, bytes, address, thread,
  ``file:line`` site and innermost region; ``metadata["event_baseline"]`` makes each
  device's running sum end exactly at the ledger's allocated bytes, so a ring that
  dropped its oldest records (or started after memory was allocated) still draws the
  true levels;
* **regions**: the lord's history of closed regions (``REGION_HISTORY``, the newest),
  one span each with its start, end, thread, nesting depth and per-device delta and
  peak;
* **hotspots**, **counters** (``stats()`` plus pending and reserved) and one **sample**
  per device;
* a **snapshot** with the largest live tensors (``_snapshot_section``, the one place
  that finds them).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import threading
import time
from collections.abc import Container
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memlord._core import CATEGORIES
from memlord._events import EVENT_KINDS, EVENT_SOURCES
from memlord._regions import row_categories

from ._model import KNOWN_KINDS, Events, Profile, SampleBuilder, Span
from ._source import _snapshot_section, build_snapshot, lord_counters, lord_hotspots, lord_totals

if TYPE_CHECKING:
    from memlord._core import _RegionRaw

#: The document's kind for each ring kind code (memlord._events.EVENT_KINDS order:
#: alloc, free, gc, reset, reset_peak, reset_accumulated): the document's known kinds,
#: then the ring's others under their own names.
_KINDS = (*KNOWN_KINDS, *(k for k in EVENT_KINDS if k not in KNOWN_KINDS))
_RING_KIND = np.array([_KINDS.index(k) for k in EVENT_KINDS], np.int16)
_ALLOC, _FREE, _RESET = (EVENT_KINDS.index(k) for k in ("alloc", "free", "reset"))


def read_consistent(lord: Any, tries: int = 5) -> tuple[np.ndarray, dict[str, dict[str, Any]]]:
    """The ring's records and the lord's ``stats()`` at the same moment: read again when
    an event (a death run by the collector while the copy was made) came in between."""
    recs: np.ndarray = np.empty(0)
    after: dict[str, dict[str, Any]] = {}
    for _ in range(tries):
        before = lord.stats()
        recs = lord.events()
        after = lord.stats()
        if before == after:
            break
    return recs, after


def storage_categories(lord: Any, recs: np.ndarray) -> np.ndarray:
    """Each record's category as the index of its storage's category now, so that a
    storage counts under one category over its whole life in the timeline: an alloc
    takes the category of its storage's free (matched by device and address: the next
    free of that address), or, for a storage still alive, its category in the lord's
    registry of live storages; a storage that changed category while it lived (a
    parameter's gradient made in backward, optimizer state) is drawn under the one it
    ended with.  Records of no storage (address 0, an aggregate of several) keep the
    category the event carried."""
    cat = recs["category"].astype(np.int16)
    n = recs.shape[0]
    if not n:
        return cat
    kind, addr, dev = recs["kind"], recs["address"], recs["device"]
    alloc, free = kind == _ALLOC, kind == _FREE
    idx = np.flatnonzero((alloc | free) & (addr != 0))
    if not idx.size:
        return cat
    order = idx[np.lexsort((idx, addr[idx], dev[idx]))]
    a, b = order[:-1], order[1:]
    same = (dev[a] == dev[b]) & (addr[a] == addr[b])
    pair = same & alloc[a] & free[b]
    cat[a[pair]] = cat[b[pair]]
    last = order[np.r_[~same, True] & alloc[order]]  # an alloc no free follows: alive
    if last.size:
        try:
            live = lord._live(-1, -(2**63))[2] if lord._life_active() else []
        except Exception:  # noqa: BLE001 - a best effort: the events keep their own
            live = []
        if live:
            index = {name: i for i, name in enumerate(CATEGORIES)}
            now = {(e[0], e[2]): index.get(e[-1], 0) for e in live}
            for i in last.tolist():
                c = now.get((int(dev[i]), int(addr[i])))
                if c is not None:
                    cat[i] = c
    return cat


def category_baseline(
    events: Events, stats: dict[str, dict[str, Any]]
) -> dict[str, dict[str, int]]:
    """Per device and category, the bytes that make the category's running sum of the
    events end at ``stats``' ``categories`` (what the ledger holds now): the bytes
    counted before the ring's first record, and those that changed category (which is
    no event) without a record to relabel."""
    n = len(events)
    cats, devs = events.categories, events.devices
    net = np.zeros((max(len(devs), 1), max(len(cats), 1)), dtype=np.int64)
    if n and cats:
        kinds = events["kind"]
        alloc = kinds == events.kinds.index("alloc")
        free = kinds == events.kinds.index("free")
        signed = np.where(alloc, events["bytes"], np.where(free, -events["bytes"], 0))
        ok = events["category"] >= 0
        np.add.at(net, (events["device"][ok], events["category"][ok]), signed[ok])
    out: dict[str, dict[str, int]] = {}
    for dev, st in stats.items():
        have = st.get("categories")
        if not have:
            continue
        d = devs.index(dev) if dev in devs else -1
        out[dev] = {
            c: int(v) - (int(net[d, cats.index(c)]) if d >= 0 and c in cats else 0)
            for c, v in have.items()
        }
    return out


def ring_events(
    lord: Any, recs: np.ndarray, stats: dict[str, dict[str, Any]]
) -> tuple[Events, dict[str, int], int]:
    """The ring's records as document :class:`Events`, the per-device baseline that makes
    each device's running sum end at ``stats``' allocated bytes, and how many records
    (up to and including the last ``reset()``) were left out."""
    skipped = 0
    if recs.shape[0]:
        resets = np.flatnonzero(recs["kind"] == _RESET)
        if resets.size:
            skipped = int(resets[-1]) + 1
            recs = recs[skipped:]
    n = recs.shape[0]

    def table(codes: np.ndarray, name_of: Any, none: int | None) -> tuple[np.ndarray, list[str]]:
        # codes -> indices into a table of distinct names (two site ids can be one
        # file:line)
        uniq, inverse = np.unique(codes, return_inverse=True)
        names: list[str] = []
        index: dict[str, int] = {}
        remap = np.empty(uniq.shape[0], dtype=np.int64)
        for i, code in enumerate(uniq.tolist()):
            if none is not None and code == none:
                remap[i] = -1
                continue
            name = name_of(code)
            if name not in index:
                index[name] = len(names)
                names.append(name)
            remap[i] = index[name]
        return remap[inverse.reshape(-1)], names

    from memlord._sites import site_text

    region_names = lord._region_names()
    dev_col, devices = table(recs["device"], lord._device_name, None)
    site_col, sites = table(recs["site"], site_text, 0)
    region_col, regions = table(
        recs["region"],
        lambda c: region_names[c] if c < len(region_names) else "",
        0,
    )
    kind_codes = recs["kind"].astype(np.int64)
    if n and int(kind_codes.max()) >= _RING_KIND.shape[0]:  # a kind this build does not know
        raise ValueError(f"event ring: unknown event kind {int(kind_codes.max())}")
    events = Events(
        {
            "t_ns": recs["t_ns"],
            "kind": _RING_KIND[kind_codes] if n else np.empty(0, np.int16),
            "source": recs["source"].astype(np.int16),
            "device": dev_col,
            "bytes": recs["bytes"],
            "address": recs["address"],
            "site": site_col,
            "thread": recs["thread"].astype(np.int64),
            "region": region_col,
            # the ring measures a tracked storage's lifetime on its free; 0 elsewhere
            # (allocs, untracked storages) is the document's "unknown", -1
            "lifetime_ns": np.where(recs["lifetime_ns"] > 0, recs["lifetime_ns"], -1).astype(
                np.int64
            ),
            "category": storage_categories(lord, recs),
        },
        kinds=_KINDS,
        sources=EVENT_SOURCES,
        devices=devices,
        sites=sites,
        regions=regions,
        categories=CATEGORIES,
    )
    baseline: dict[str, int] = {}
    if n:
        signed = np.where(
            kind_codes == _ALLOC, recs["bytes"], np.where(kind_codes == _FREE, -recs["bytes"], 0)
        )
        net = np.zeros(len(devices), dtype=np.int64)
        np.add.at(net, dev_col, signed)
        for i, dev in enumerate(devices):
            allocated = int(stats.get(dev, {}).get("allocated", 0))
            baseline[dev] = allocated - int(net[i])
    return events, baseline, skipped


def region_span(name: str, raw: _RegionRaw, kind: str = "region") -> Span:
    """One closed region (``(name, (duration_ns, rows, start_ns, thread, depth))``) as a
    span: ``delta`` per device is the net bytes its own thread allocated inside,
    ``peak`` the device's allocated bytes at the region's highest point, ``pre_total``
    the devices' allocated bytes when the region first touched them and ``post_total``
    that plus the deltas, ``tensor_delta`` storages allocated minus freed, ``categories``
    per device the categories its events carried (``{category: {"delta", "peak_delta",
    "at_peak"}}``, as ``region.stats``)."""
    duration_ns, rows, start_ns, thread, depth = raw[:5]
    delta: dict[str, int] = {}
    peak: dict[str, int] = {}
    categories: dict[str, dict[str, dict[str, int]]] = {}
    pre = storages = 0
    for dev, entry, net, peak_net, allocs, frees, cats in rows:
        delta[dev] = net
        peak[dev] = entry + peak_net
        pre += entry
        storages += allocs - frees
        if cats:
            categories[dev] = {
                cat: {"delta": cnet, "peak_delta": cpeak, "at_peak": at_peak}
                for cat, cnet, cpeak, at_peak in row_categories(cats)
            }
    return Span(
        name=name,
        start_ns=start_ns,
        end_ns=start_ns + duration_ns,
        thread=thread,
        depth=depth,
        kind=kind,
        pre_total=pre,
        post_total=pre + sum(delta.values()),
        tensor_delta=storages,
        delta=delta,
        peak=peak,
        categories=categories,
    )


def region_spans(lord: Any, exclude: Container[int] = ()) -> tuple[list[Span], int, int]:
    """The lord's kept closed regions as spans (oldest first), except the items whose
    ``id`` is in ``exclude`` (the profiler's own operations); plus how many were kept
    and how many closed in all."""
    history, seen = lord._region_history()
    spans = [region_span(name, raw) for name, raw in (i for i in history if id(i) not in exclude)]
    spans.sort(key=lambda s: (s.start_ns, -s.end_ns))
    return spans, len(history), seen


def thread_names(idents: set[int]) -> dict[str, str]:
    """``{str(ident): name}``: a thread alive now by its name now; one that ended by the
    name memlord recorded when it first saw it (``memlord.lord.THREAD_NAMES``); else
    (a thread Python's threading module did not know) ``thread <ident>``."""
    from memlord.lord import THREAD_NAMES

    alive = {t.ident: t.name for t in threading.enumerate()}
    return {str(i): alive.get(i) or THREAD_NAMES.get(i) or f"thread {i}" for i in sorted(idents)}


def base_metadata(title: str, start_ns: int) -> dict[str, Any]:
    from memlord import __version__
    from memlord._ranks import rank_metadata

    now_mono, now_unix = time.monotonic_ns(), time.time()
    return {
        "generated_at": _dt.datetime.now().isoformat(timespec="seconds"),
        "title": title,
        "start_ns": start_ns,
        "start_unix": now_unix - (now_mono - start_ns) / 1e9,
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "memlord_version": __version__,
        **rank_metadata(),
    }


def site_frames_table(recs: np.ndarray) -> dict[str, list[dict[str, Any]]]:
    """For each site of the ring's records, by its text: its frames as torch's memory
    snapshots list them (``filename``, ``line``, ``name``; innermost first).  Kept in a
    profile's ``metadata["site_frames"]``; the memory_viz pickle reads it."""
    from memlord._sites import site_frames, site_text

    out: dict[str, list[dict[str, Any]]] = {}
    for site in np.unique(recs["site"]).tolist() if len(recs) else []:
        if site:
            frames = site_frames(int(site))
            if frames:
                out[site_text(int(site))] = frames
    return out


def profile_from_lord(lord: Any, *, top: int = 10, title: str | None = None) -> Profile:
    """The profile document of ``lord`` now (what ``lord.export`` writes)."""
    recs, stats = read_consistent(lord)
    events, baseline, skipped = ring_events(lord, recs, stats)
    spans, kept, seen = region_spans(lord)
    now = time.monotonic_ns()
    totals = lord_totals(lord)
    samples = SampleBuilder()
    for dev, t in totals.items():
        samples._add(now, dev, t["allocated"], t["pending"], t["reserved"])
    section, origin = _snapshot_section(lord, top)
    snapshot = build_snapshot(totals, section, "export", now)
    starts = [now] + [s.start_ns for s in spans]
    if len(events):
        starts.append(int(events["t_ns"].min()))
    idents = {s.thread for s in spans}
    if len(events):
        idents.update(int(t) for t in np.unique(events["thread"]).tolist())
    metadata = base_metadata(title or "memlord lord export", min(starts))
    metadata.update(
        {
            "operation_tracking_enabled": False,
            "threads": thread_names(idents),
            "top_tensors_from": origin,
            "event_baseline": baseline,
            "category_baseline": category_baseline(events, stats),
            "site_frames": site_frames_table(recs),
            "events_capacity": lord.events_capacity,
            "events_dropped": lord.events_dropped,
            "events_before_reset": skipped,
            "regions_kept": kept,
            "regions_closed": seen,
        }
    )
    return Profile(
        metadata=metadata,
        snapshots=[snapshot],
        regions=spans,
        samples=samples.build(),
        events=events,
        hotspots=lord_hotspots(lord),
        counters=lord_counters(lord),
    )
