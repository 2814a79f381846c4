"""A synthetic profile of any size, for tests, benchmarks and trying the viewers.

    cd tests && python -c "from support.synthetic import synthetic_profile as s; \
from memlord.report import export; export(s(100_000), 'demo.html')"
"""

from __future__ import annotations

import time

import numpy as np

from memlord.report._model import KNOWN_KINDS, Events, Profile, SampleBuilder, Span


def synthetic_profile(
    n_events: int = 10_000,
    *,
    steps: int = 20,
    devices: tuple[str, ...] = ("cpu", "cuda:0"),
    names: tuple[str, ...] = ("forward", "backward", "optimizer"),
    seed: int = 0,
) -> Profile:
    """A training-loop-shaped profile: ``n_events`` alloc/free events over ``steps``
    steps on ``devices`` (blocks of allocations freed in random order, a little growth),
    reserved samples, a few auto-GC and one OOM event, and per step a ``step`` operation
    with the ``names`` nested inside plus a ``data_loader`` operation on a second thread
    that overlaps it."""
    rng = np.random.default_rng(seed)
    start_ns = 1_000_000_000_000
    block = 50
    n_blocks = max(1, n_events // (2 * block))
    n = n_blocks * 2 * block
    duration_ns = max(steps, 1) * 10_000_000  # 10 ms per step
    t = start_ns + np.sort(rng.integers(0, duration_ns, size=n, dtype=np.int64))
    sizes = rng.integers(1, 64, size=(n_blocks, block), dtype=np.int64) * 4096
    # each block: `block` allocations, then the same storages freed in a random order;
    # one storage in ten blocks is never freed (slow growth)
    perm = np.argsort(rng.random((n_blocks, block)), axis=1)
    addr = (np.arange(n_blocks * block, dtype=np.uint64) * np.uint64(1 << 20)).reshape(
        n_blocks, block
    ) + np.uint64(0x10000000)
    kind_alloc, kind_free = KNOWN_KINDS.index("alloc"), KNOWN_KINDS.index("free")
    kinds = np.empty((n_blocks, 2 * block), dtype=np.int16)
    kinds[:, :block] = kind_alloc
    kinds[:, block:] = kind_free
    leak = rng.random(n_blocks) < 0.1
    freed_sizes = np.take_along_axis(sizes, perm, axis=1)
    freed_addr = np.take_along_axis(addr, perm, axis=1)
    freed_sizes[leak, -1] = 0  # a zero-byte free keeps the leaked one live
    by = np.concatenate([sizes, freed_sizes], axis=1).ravel()
    ad = np.concatenate([addr, freed_addr], axis=1).ravel()
    ad[by == 0] = 0
    kinds = kinds.ravel()
    dev = (np.arange(n_blocks) % len(devices)).repeat(2 * block).astype(np.int16)
    sites = [f"train.py:{10 + i}" for i in range(16)]
    site = rng.integers(0, len(sites), size=n, dtype=np.int32)
    lifetime = np.where(kinds == kind_free, rng.integers(1000, 10_000_000, size=n), -1)
    # a few extra kinds: reserved samples on CUDA devices, auto-GC, one OOM
    extra_t, extra_kind, extra_dev, extra_bytes = [], [], [], []
    signed = np.where(kinds == kind_alloc, by, -by)
    for d, name in enumerate(devices):
        if name.startswith("cuda"):
            # the backend's reserved bytes: the peak so far, rounded up to 2 MiB, plus 2 MiB
            mine = dev == d
            peak = np.maximum.accumulate(np.cumsum(signed[mine]))
            for k in range(steps):
                t_k = start_ns + k * 10_000_000
                i = int(np.searchsorted(t[mine], t_k + 10_000_000)) - 1
                so_far = int(peak[i]) if i >= 0 else 0
                extra_t.append(t_k)
                extra_kind.append(KNOWN_KINDS.index("reserved"))
                extra_dev.append(d)
                extra_bytes.append((so_far // (2 << 20) + 2) * (2 << 20))
    for k in range(3):
        extra_t.append(start_ns + (k + 1) * duration_ns // 4)
        extra_kind.append(KNOWN_KINDS.index("gc"))
        extra_dev.append(len(devices) - 1)
        extra_bytes.append(0)
    extra_t.append(start_ns + duration_ns - 1)
    extra_kind.append(KNOWN_KINDS.index("oom"))
    extra_dev.append(len(devices) - 1)
    extra_bytes.append(1 << 30)
    m = len(extra_t)
    cols = {
        "t_ns": np.concatenate([t, np.asarray(extra_t, dtype=np.int64)]),
        "kind": np.concatenate([kinds, np.asarray(extra_kind, dtype=np.int16)]),
        "source": np.zeros(n + m, dtype=np.int16),
        "device": np.concatenate([dev, np.asarray(extra_dev, dtype=np.int16)]),
        "bytes": np.concatenate([by, np.asarray(extra_bytes, dtype=np.int64)]),
        "address": np.concatenate([ad, np.zeros(m, dtype=np.uint64)]),
        "site": np.concatenate([site, np.full(m, -1, dtype=np.int32)]),
        "thread": np.full(n + m, 1, dtype=np.int64),
        "region": np.full(n + m, -1, dtype=np.int32),
        "lifetime_ns": np.concatenate([lifetime, np.full(m, -1, dtype=np.int64)]),
    }
    order = np.argsort(cols["t_ns"], kind="stable")
    cols = {k: v[order] for k, v in cols.items()}
    events = Events(cols, sources=["factory"], devices=list(devices), sites=sites)
    ops: list[Span] = []
    samples = SampleBuilder()
    step_ns = duration_ns // max(steps, 1)
    for k in range(steps):
        s0 = start_ns + k * step_ns
        ops.append(Span("step", s0, s0 + step_ns - 1000, thread=1, depth=0, pre_total=k * 4096))
        ops[-1].post_total = (k + 1) * 4096
        part = (step_ns - 2000) // max(len(names), 1)
        for j, name in enumerate(names):
            a = s0 + 500 + j * part
            ops.append(
                Span(
                    name,
                    a,
                    a + part - 100,
                    thread=1,
                    depth=1,
                    pre_total=1 << 20,
                    post_total=(1 << 20) + (j - 1) * 65536,
                    tensor_delta=j - 1,
                    delta={devices[-1]: (j - 1) * 65536},
                )
            )
        ops.append(Span("data_loader", s0 + step_ns // 2, s0 + step_ns + step_ns // 3, thread=2))
        samples.add(s0, devices[0], k * 4096)
    return Profile(
        metadata={
            "title": "synthetic profile",
            "generated_at": "2025-01-13T10:30:00",
            "start_ns": start_ns,
            "start_unix": time.mktime((2025, 1, 13, 10, 30, 0, 0, 0, -1)),
            "operation_tracking_enabled": True,
            "threads": {"1": "MainThread", "2": "data_loader"},
        },
        snapshots=[
            {
                "timestamp": "2025-01-13T10:30:00",
                "checkpoint_name": "end",
                "t_ns": start_ns + duration_ns,
                "total_mb": 1.0,
                "total_bytes": 1 << 20,
                "tensor_count": 2,
                "device_breakdown": {
                    devices[-1]: {
                        "total_mb": 1.0,
                        "total_bytes": 1 << 20,
                        "count": 2,
                        "tensors": [
                            {
                                "size_mb": 0.75,
                                "shape": [768, 256],
                                "dtype": "torch.float32",
                                "device": devices[-1],
                                "requires_grad": True,
                                "operation": names[0] if names else None,
                            },
                            {
                                "size_mb": 0.25,
                                "shape": [256, 256],
                                "dtype": "torch.float32",
                                "device": devices[-1],
                                "requires_grad": False,
                                "operation": None,
                            },
                        ],
                    }
                },
            }
        ],
        operations=ops,
        samples=samples.build(),
        events=events,
        hotspots=[{"device": devices[-1], "kind": "alloc", "site": sites[0], "bytes": 1 << 20}],
        counters={d: {"gc_runs": 3 if i == len(devices) - 1 else 0} for i, d in enumerate(devices)},
        pytorch_operations=[
            {
                "op_name": "aten::mm",
                "count": 4,
                "cpu_time_us": 10.0,
                "cuda_time_us": 0.0,
                "cpu_memory_mb": 0.5,
                "cuda_memory_mb": 0.0,
                "input_shapes": [[4, 4], [4, 4]],
            }
        ],
    )
