"""Live snapshots (issue 12): ``lord.snapshot(top=10)`` against a heap scan.

*Subject*: ``lord.snapshot(top=10)`` with N = 100,000 live ``torch.empty(16)`` tracked
(made under ``lord.hook_into_python()``): the C core walks the lord's registry of
trackers, copying plain values (per-device totals and each device's 10 largest), and
Python builds the result.

*Floor*: what one would write without memlord's registry, in the same process with the
same tensors alive: ``gc.get_objects()`` and the sum of every tensor's ``nbytes``::

    sum(o.nbytes for o in gc.get_objects() if issubclass(type(o), torch.Tensor))

(a cheap scan: no storage deduplication, no per-device split, no top list).

**Target**: the snapshot at least 10x faster, i.e. subject / floor <= 0.1. Medians over
``cfg.samples`` samples, alternating subject and floor, the cyclic GC off (harness).

    python bench/bench_snapshot.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]

``rows(cfg)`` returns harness ``Row`` objects, as bench/run_all.py expects.
"""

from __future__ import annotations

import gc
import sys

import torch
from _harness import Case, Config, Row, compare, main

from memlord import MemLord, _core

N_TENSORS = 100_000
TARGET = 0.1


def _heap_scan(get_objects=gc.get_objects, tensor=torch.Tensor) -> int:
    return sum(o.nbytes for o in get_objects() if issubclass(type(o), tensor))


def snapshot_row(cfg: Config) -> Row:
    info = _core._hooks_info()
    assert not info["python_installed"], "python hooks already installed by someone else"
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    try:
        ts = [torch.empty(16) for _ in range(N_TENSORS)]
        snap = lord.snapshot(top=10)
        assert snap["cpu"]["count"] == N_TENSORS, snap["cpu"]["count"]
        assert snap["cpu"]["total_bytes"] == 64 * N_TENSORS
        assert _heap_scan() >= 64 * N_TENSORS
        env = {"lord": lord, "scan": _heap_scan}
        subject = Case(f"snapshot(top=10), {N_TENSORS:,} tracked", "lord.snapshot(10)", env)
        floor = Case("gc.get_objects() scan", "scan()", env)
        row = compare(
            subject,
            floor,
            target=TARGET,
            cfg=cfg,
            note=f"{N_TENSORS:,} live torch.empty(16) tracked; the floor sums tensor nbytes "
            "over gc.get_objects() in the same process; target: >= 10x faster",
        )
        del ts
    finally:
        h.disable()
    return row


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    return [snapshot_row(cfg)]


if __name__ == "__main__":
    sys.exit(main(rows))
