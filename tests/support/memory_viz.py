"""How torch's memory_viz readers see a snapshot memlord wrote (a profile's pickle, an OOM
post-mortem's pickle): ``page_live_bytes`` transcribes what the MemoryViz.js page
(pytorch.org/memory_viz, the page ``trace_plot`` and ``segment_plot`` write) shows live
after the last event; ``trace_live_allocations`` asks torch's own
``torch.cuda._memory_viz.filter_alloc_free_pairs`` which of the trace's allocations are
never freed."""

from __future__ import annotations

import copy
from typing import Any

import torch.cuda._memory_viz as memory_viz


def blocks_at(snap: dict[str, Any], device: int) -> list[tuple[int, dict[str, Any]]]:
    """The device's blocks with their addresses as MemoryViz.js' ``annotate_snapshot``
    computes them: the segment's address plus the sizes of the blocks before."""
    out = []
    for seg in snap["segments"]:
        if seg["device"] != device:
            continue
        addr = seg["address"]
        for b in seg["blocks"]:
            out.append((addr, b))
            addr += b["size"]
    return out


def page_live_bytes(snap: dict[str, Any], device: int) -> int:
    """What torch's MemoryViz.js makes of a snapshot, transcribed: the bytes
    ``process_alloc_data`` shows allocated after the last event (the trace's allocations
    not freed, plus each ``active_allocated`` block no such allocation has the address of:
    allocated before the trace began), and ``MemoryView``'s check that every block the
    trace frees lies in one of the device's segments (``find_segment``; the page fails on
    ``null.occupied`` otherwise)."""
    segs = [s for s in snap["segments"] if s["device"] == device]
    addr_to_alloc: dict[int, int] = {}
    for e in snap["device_traces"][device]:
        if e["action"] == "alloc":
            addr_to_alloc[e["addr"]] = e["size"]
        elif e["action"] in ("free", "free_completed"):
            addr_to_alloc.pop(e["addr"], None)
            assert any(s["address"] <= e["addr"] < s["address"] + s["total_size"] for s in segs), (
                f"a freed block at {e['addr']:#x} lies in no segment"
            )
    before = sum(
        b["requested_size"]
        for addr, b in blocks_at(snap, device)
        if b["state"] == "active_allocated" and addr not in addr_to_alloc
    )
    return sum(addr_to_alloc.values()) + before


def trace_live_allocations(snap: dict[str, Any], device: int) -> list[dict[str, Any]]:
    """The device's trace allocations torch's ``filter_alloc_free_pairs`` (``trace_plot``'s
    ``filter_freed``) keeps: those no later free of the same address ends."""
    data = copy.deepcopy(snap)
    memory_viz.filter_alloc_free_pairs(data)
    return [e for e in data["device_traces"][device] if e["action"] == "alloc"]
