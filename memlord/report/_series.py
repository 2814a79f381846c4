"""Per-device memory series derived from a profile, lanes for spans, and decimation."""

from __future__ import annotations

import dataclasses

import numpy as np

from ._model import Profile, Span, check_arguments


@dataclasses.dataclass
class Series:
    """One device's memory over time: values after each change, times in ns."""

    device: str
    t_ns: np.ndarray
    allocated: np.ndarray
    pending: np.ndarray
    reserved: np.ndarray | None  # None: not known for this device
    source: str  # "events" or "samples"
    # allocated split by category (each storage under its category), where the events
    # carry one: {category: values}, every category the device ever held
    categories: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.t_ns.shape[0])

    @property
    def peak(self) -> np.ndarray:
        """The running maximum of allocated."""
        # typed: numpy's stubs give copy() no type as CPython 3.10 reads them
        peak: np.ndarray = (
            self.allocated.copy() if not len(self) else np.maximum.accumulate(self.allocated)
        )
        return peak

    def take(self, idx: np.ndarray) -> Series:
        return Series(
            self.device,
            self.t_ns[idx],
            self.allocated[idx],
            self.pending[idx],
            None if self.reserved is None else self.reserved[idx],
            self.source,
            {c: v[idx] for c, v in self.categories.items()},
        )


def _from_events(doc: Profile, dev_index: int, device: str) -> Series:
    ev = doc.events
    mask = ev["device"] == dev_index
    t = ev["t_ns"][mask]
    kind = ev["kind"][mask]
    nbytes = ev["bytes"][mask]
    cat = ev["category"][mask]
    order = np.argsort(t, kind="stable")
    t, kind, nbytes, cat = t[order], kind[order], nbytes[order], cat[order]

    def code(name: str) -> int:
        return ev.kinds.index(name) if name in ev.kinds else -2

    d_alloc = np.zeros(t.shape[0], dtype=np.int64)
    d_pend = np.zeros(t.shape[0], dtype=np.int64)
    d_alloc[kind == code("alloc")] = nbytes[kind == code("alloc")]
    d_alloc[kind == code("free")] = -nbytes[kind == code("free")]
    req = kind == code("free_requested")
    done = kind == code("free_completed")
    d_pend[req] = nbytes[req]
    d_pend[done] = -nbytes[done]
    d_alloc[done] = -nbytes[done]
    baseline = doc.metadata.get("event_baseline", {}).get(device, 0)
    allocated = np.cumsum(d_alloc) + int(baseline)
    pending = np.cumsum(d_pend)
    res_mask = kind == code("reserved")
    reserved = None
    if res_mask.any():
        # forward-fill the last reserved sample; -1 before the first
        idx = np.where(res_mask, np.arange(t.shape[0]), -1)
        idx = np.maximum.accumulate(idx)
        reserved = np.where(idx >= 0, nbytes[np.maximum(idx, 0)], -1)
    return Series(
        device, t, allocated, pending, reserved, "events", _categories(doc, device, d_alloc, cat)
    )


def _categories(
    doc: Profile, device: str, d_alloc: np.ndarray, cat: np.ndarray
) -> dict[str, np.ndarray]:
    """Per category, the running sum of the device's allocated changes whose event has
    that category, plus the document's ``category_baseline``; empty when no event has a
    category.  Categories that are 0 throughout are left out."""
    names = doc.events.categories
    if not names or not (cat >= 0).any():
        return {}
    base = doc.metadata.get("category_baseline", {}).get(device, {})
    out: dict[str, np.ndarray] = {}
    for i, name in enumerate(names):
        mine = cat == i
        b = int(base.get(name, 0))
        if not mine.any() and not b:
            continue
        values = np.cumsum(np.where(mine, d_alloc, 0)) + b
        if values.any():
            out[name] = values
    return out


def _from_samples(doc: Profile, dev_index: int, device: str) -> Series:
    s = doc.samples
    mask = s["device"] == dev_index
    t = s["t_ns"][mask]
    order = np.argsort(t, kind="stable")
    reserved = s["reserved"][mask][order]
    return Series(
        device,
        t[order],
        s["allocated"][mask][order],
        s["pending"][mask][order],
        reserved if (reserved >= 0).any() else None,
        "samples",
    )


def memory_series(doc: Profile) -> dict[str, Series]:
    """Per device, its memory series: from the events where the device has any, else from
    the samples."""
    check_arguments("memory_series", doc)
    out: dict[str, Series] = {}
    ev_counts = (
        np.bincount(doc.events["device"], minlength=len(doc.events.devices))
        if len(doc.events)
        else np.zeros(len(doc.events.devices), dtype=np.int64)
    )
    for device in doc.devices():
        if device in doc.events.devices and ev_counts[doc.events.devices.index(device)]:
            out[device] = _from_events(doc, doc.events.devices.index(device), device)
        elif device in doc.samples.devices:
            series = _from_samples(doc, doc.samples.devices.index(device), device)
            if len(series):
                out[device] = series
    return out


def decimate_indices(t: np.ndarray, values: list[np.ndarray], buckets: int) -> np.ndarray:
    """Indices of the points to keep so that a step plot of ``values`` over ``t`` keeps,
    in each of ``buckets`` equal time buckets, every series' minimum and maximum (so no
    peak is lost), plus the first and last point.  Returns all indices when the series
    is short."""
    if not isinstance(buckets, (int, np.integer)) or isinstance(buckets, bool):
        raise TypeError(
            f"decimate_indices(): argument 'buckets' must be an int, not {type(buckets).__name__}"
        )
    if buckets < 1:
        raise ValueError(f"decimate_indices(): argument 'buckets' must be >= 1, got {buckets}")
    n = t.shape[0]
    if n <= 2 * buckets * max(1, len(values)):
        return np.arange(n)
    t0, t1 = int(t[0]), int(t[-1])
    span = max(t1 - t0, 1)
    bucket = ((t - t0).astype(np.float64) * (buckets / span)).astype(np.int64)
    np.clip(bucket, 0, buckets - 1, out=bucket)
    keep = [np.array([0, n - 1])]
    # bucket is non-decreasing (t sorted): bucket starts give each bucket's run
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    for v in values:
        # argmin/argmax per run via lexsort on (value, bucket)
        order = np.lexsort((v, bucket))
        ends = np.r_[starts[1:], n] - 1
        keep.append(order[starts])  # minimum of each bucket
        keep.append(order[ends])  # maximum of each bucket
    return np.unique(np.concatenate(keep))


def lanes(spans: list[Span]) -> list[int]:
    """Compact lanes: each span goes to the lowest lane free at its start (greedy
    interval partitioning), so overlapping spans never share a lane and the number of
    lanes is the highest concurrency."""
    import heapq

    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_ns, -spans[i].end_ns))
    lane_of = [0] * len(spans)
    busy: list[tuple[int, int]] = []  # (end_ns, lane)
    free: list[int] = []
    used = 0
    for i in order:
        s = spans[i]
        while busy and busy[0][0] <= s.start_ns:
            _, lane = heapq.heappop(busy)
            heapq.heappush(free, lane)
        if free:
            lane = heapq.heappop(free)
        else:
            lane = used
            used += 1
        lane_of[i] = lane
        heapq.heappush(busy, (max(s.end_ns, s.start_ns), lane))
    return lane_of
