"""torch's memory snapshot layout (``torch.cuda.memory._snapshot()``), pickled.

``torch.cuda._memory_viz`` (``segsum``, ``trace``, ``memory``, ``segments``,
``trace_plot``, ``segment_plot``) and https://pytorch.org/memory_viz read the result.

memlord has no allocator segments, so each device gets one synthetic segment: one
``active_allocated`` block per allocation still live at the end of the event record
(with its allocation site as the frame), then one ``inactive`` block up to the device's
peak.  ``device_traces`` comes from the events: ``alloc``, ``free`` (as
``free_requested`` + ``free_completed``), ``free_requested``, ``free_completed`` and
``oom``.  Device indices: ``cuda:N`` is index N (as in torch); other devices (cpu, ...)
follow the highest cuda index, in order; ``memlord_devices`` lists the name of each
index at its position (None at an index no device has).
"""

from __future__ import annotations

import heapq
import os
import pickle
from typing import Any

from .._sites import VIA
from ._model import Profile, check_arguments
from ._series import memory_series
from ._util import Progress, atomic_write, no_progress

SEGMENT_BASE = 0x7F0000000000
SEGMENT_STRIDE = 1 << 40


def segment(
    index: int, device: str, address: int, total: int, allocated: int, blocks: list[dict[str, Any]]
) -> dict[str, Any]:
    """One synthetic segment of torch's snapshot layout: ``total`` bytes at ``address``
    on device ``index`` (memlord's name in ``memlord_device``), ``allocated`` of them in
    active blocks."""
    return {
        "device": index,
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": allocated,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
        "memlord_device": device,
    }


def device_indices(devices: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    top = -1
    for d in devices:
        if d.startswith("cuda:") and d[5:].isdigit():
            out[d] = int(d[5:])
            top = max(top, out[d])
    for d in devices:
        if d not in out:
            top += 1
            out[d] = top
    return out


def device_names(index: dict[str, int]) -> list[str | None]:
    """``memlord_devices``: the name of each device index, at its position (that of its
    ``device_traces`` entry); None at an index no device has (``cuda:0`` where only
    ``cuda:1`` held memory)."""
    out: list[str | None] = [None] * (max(index.values(), default=-1) + 1)
    for d, i in index.items():
        out[i] = d
    return out


def _frame(where: str) -> dict[str, Any]:
    filename, _, line = where.rpartition(":")
    if not filename or not line.isdigit():
        return {"filename": where, "line": 0, "name": "?"}
    return {"filename": filename, "line": int(line), "name": "?"}


def _is_frame(f: Any) -> bool:
    return (
        isinstance(f, dict)
        and isinstance(f.get("filename"), str)
        and isinstance(f.get("line"), int)
        and isinstance(f.get("name"), str)
    )


def _frames(site: str | None, table: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A site's frames, innermost first: from the profile's ``site_frames`` (with the
    functions' names), else from its text (``file:line``, or ``user.py:12 via
    lib.py:110``), named ``?``."""
    if not site:
        return []
    known = table.get(site) if table else None
    if isinstance(known, list) and known and all(_is_frame(f) for f in known):
        return [{"filename": f["filename"], "line": f["line"], "name": f["name"]} for f in known]
    return [_frame(part) for part in reversed(site.split(VIA))]


def live_at_end(doc: Profile) -> dict[str, dict[int, int]]:
    """Per device, the allocations the events leave alive: address -> index of its
    ``alloc`` event (events without an address left out)."""
    ev = doc.events
    live: dict[str, dict[int, int]] = {d: {} for d in ev.devices}
    if not len(ev):
        return live
    kinds = ev.kinds
    kind_col = ev["kind"].tolist()
    dev_col = ev["device"].tolist()
    addr_col = ev["address"].tolist()
    for i, (k, d, addr) in enumerate(zip(kind_col, dev_col, addr_col, strict=True)):
        if not addr:
            continue
        kind = kinds[k]
        if kind == "alloc":
            live[ev.devices[d]][addr] = i
        elif kind in ("free", "free_completed"):
            live[ev.devices[d]].pop(addr, None)
    return live


def site_table(doc: Profile) -> dict[str, Any] | None:
    """The profile's ``site_frames`` (a site's frames with their functions' names), if any."""
    table = doc.metadata.get("site_frames")
    return table if isinstance(table, dict) else None


def remap_traces(
    doc: Profile,
    index: dict[str, int],
    layout: dict[str, tuple[int, int]],
    block_at: dict[int, int],
    table: dict[str, Any] | None,
    progress: Progress = no_progress,
) -> tuple[list[list[dict[str, Any]]], dict[str, int]]:
    """The events as torch's ``device_traces``, each allocation at a synthetic address:
    ``block_at[i]`` for the ``alloc`` event ``i`` of an allocation a live block stands for;
    every other allocation an address of its own while it lives, in the device's segment
    after its live blocks (``layout[device]``: the segment's address, the bytes of its live
    blocks).  Events of a device ``index`` or ``layout`` lacks are left out.  Returns the
    traces (one per index) and, per device, how many addresses after the live blocks the
    trace used (the segment must reach that far)."""
    n_traces = max(index.values(), default=-1) + 1
    traces: list[list[dict[str, Any]]] = [[] for _ in range(n_traces)]
    ev = doc.events
    slots_used: dict[str, int] = {d: 0 for d in layout}
    if not len(ev):
        return traces, slots_used
    start_ns = doc.metadata.get("start_ns", doc.t0_ns())
    start_unix = float(doc.metadata.get("start_unix", 0.0))
    free_slots: dict[str, list[int]] = {d: [] for d in layout}
    current: dict[str, dict[int, int]] = {d: {} for d in layout}  # real -> synthetic

    def new_address(dev: str) -> int:
        free = free_slots[dev]
        if free:
            return heapq.heappop(free)
        address, used = layout[dev]
        slots_used[dev] += 1
        return address + used + slots_used[dev] - 1

    def release(dev: str, synthetic: int) -> None:
        address, used = layout[dev]
        if synthetic >= address + used:  # a slot, not a live block
            heapq.heappush(free_slots[dev], synthetic)

    kinds = ev.kinds
    kind_col = ev["kind"].tolist()
    dev_col = ev["device"].tolist()
    addr_col = ev["address"].tolist()
    size_col = ev["bytes"].tolist()
    site_col = ev["site"].tolist()
    t_col = ((ev["t_ns"] - start_ns) // 1000 + int(start_unix * 1e6)).tolist()
    n = len(kind_col)
    for i in range(n):
        if i % 65536 == 0:
            progress(0.8 * i / n, "pickle traces")
        kind = kinds[kind_col[i]]
        dev = ev.devices[dev_col[i]]
        if dev not in layout or dev not in index:
            continue
        trace = traces[index[dev]]
        addr, size = addr_col[i], size_col[i]
        site = ev.sites[site_col[i]] if site_col[i] >= 0 else None
        mapped = current[dev]
        if kind == "alloc":
            if addr in mapped:  # a second alloc at an address the record never freed
                release(dev, mapped.pop(addr))
            synthetic = block_at.get(i)
            if synthetic is None:
                synthetic = new_address(dev)
            mapped[addr] = synthetic
        elif kind in ("free", "free_requested", "free_completed"):
            synthetic = mapped.get(addr)
            if synthetic is None:  # allocated before the record began
                synthetic = mapped[addr] = new_address(dev)
            if kind != "free_requested":
                release(dev, mapped.pop(addr))
        else:
            synthetic = 0
        base = {"addr": synthetic, "size": size, "stream": 0, "time_us": t_col[i]}
        if kind == "alloc":
            trace.append({"action": "alloc", **base, "frames": _frames(site, table)})
        elif kind == "free":
            trace.append({"action": "free_requested", **base, "frames": _frames(site, table)})
            trace.append({"action": "free_completed", **base, "frames": []})
        elif kind in ("free_requested", "free_completed"):
            trace.append({"action": kind, **base, "frames": _frames(site, table)})
        elif kind == "oom":
            trace.append(
                {"action": "oom", **base, "device_free": 0, "frames": _frames(site, table)}
            )
    return traces, slots_used


def to_snapshot(doc: Profile, progress: Progress = no_progress) -> dict[str, Any]:
    """The document as a torch memory snapshot dictionary.

    The trace's addresses are the synthetic segment's, as torch's readers need them
    (MemoryViz.js matches an allocation to its segment block, and places every block of
    the trace in a segment, by address): an allocation still live at the end has the
    address of its ``active_allocated`` block; every other one an address of its own
    (while it lives) inside the segment, after the live blocks."""
    check_arguments("to_snapshot", doc, progress=progress)
    devices = doc.devices()
    index = device_indices(devices)
    ev = doc.events
    table = site_table(doc)
    series = memory_series(doc)
    site_col = ev["site"].tolist() if len(ev) else []
    size_col = ev["bytes"].tolist() if len(ev) else []
    end_live = live_at_end(doc)
    # the segment of each device: the live blocks first, then the rest up to the peak
    layout: dict[str, tuple[int, int, int, list[dict[str, Any]]]] = {}
    block_at: dict[int, int] = {}  # index of a live allocation's alloc event -> its address
    for dev in devices:
        s = series.get(dev)
        final = int(s.allocated[-1]) if s is not None and len(s) else 0
        peak = int(s.allocated.max()) if s is not None and len(s) else 0
        counters = doc.counters.get(dev, {})
        final = int(counters.get("allocated", final))
        peak = max(peak, int(counters.get("peak_allocated", peak)), final)
        address = SEGMENT_BASE + index[dev] * SEGMENT_STRIDE
        blocks = []
        offset = 0
        alive = end_live.get(dev, {})
        alive_bytes = sum(size_col[i] for i in alive.values())
        if alive and alive_bytes <= final:
            for _addr, i in sorted(alive.items()):
                size = size_col[i]
                site = ev.sites[site_col[i]] if site_col[i] >= 0 else None
                block_at[i] = address + offset
                blocks.append(
                    {
                        "address": address + offset,
                        "size": size,
                        "requested_size": size,
                        "state": "active_allocated",
                        "frames": _frames(site, table),
                    }
                )
                offset += size
        if final > offset:  # live bytes no event of the record shows allocated
            blocks.append(
                {
                    "address": address + offset,
                    "size": final - offset,
                    "requested_size": final - offset,
                    "state": "active_allocated",
                    "frames": [],
                }
            )
            offset = final
        layout[dev] = (address, offset, peak, blocks)
    traces, slots_used = remap_traces(
        doc, index, {d: lay[:2] for d, lay in layout.items()}, block_at, table, progress
    )
    segments = []
    for dev in devices:
        address, offset, peak, blocks = layout[dev]
        # every address the trace used lies in the segment (MemoryViz.js draws each block
        # of the trace in the segment that holds its address)
        total = max(peak, offset + slots_used[dev])
        if total > offset:
            blocks.append(
                {
                    "address": address + offset,
                    "size": total - offset,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        segments.append(segment(index[dev], dev, address, total, offset, blocks))
    progress(1.0, "pickle")
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {
            "backend": "memlord (synthetic segments: one per device)",
            "expandable_segments": False,
        },
        "memlord_devices": device_names(index),
    }


def write_pickle(
    doc: Profile, path: str | os.PathLike[str], progress: Progress = no_progress
) -> None:
    check_arguments("write_pickle", doc, path, progress)
    snap = to_snapshot(doc, progress)
    with atomic_write(path, binary=True) as f:
        pickle.dump(snap, f, protocol=pickle.HIGHEST_PROTOCOL)


__all__ = ["to_snapshot", "write_pickle", "device_indices", "live_at_end", "remap_traces"]
