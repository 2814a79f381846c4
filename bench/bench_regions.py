"""Regions (issue 12): entering and leaving a region against the memory-profiler seed's
method, summing tensor sizes over gc.get_objects() before and after a block.

Targets, in the same run:

* ``with lord.region("step"): pass`` (enter and exit, the Python face included) costs
  at most 1 µs (the floor is that budget, so the ratio must be <= 1);
* it is at least 1000x faster than the seed's two scans with 10,000 live tensors
  (ratio <= 0.001).

Measured, no target: a forward of 8 ``nn.Linear(16, 16)`` under ``track_modules`` against
the same forward untracked (a region per module call, each span pushed under the
tracker's lock).

    python bench/bench_regions.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]
"""

from __future__ import annotations

import gc
import sys

import torch
from _harness import Case, Config, Row, compare, main

from memlord import MemLord

N_LIVE = 10_000
BUDGET_NS = 1000.0


def _seed_scan() -> int:
    """What the memory-profiler seed does around a block: the bytes of every tensor the
    garbage collector knows."""
    total = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            total += obj.untyped_storage().nbytes()
    return total


def rows(cfg: Config) -> list[Row]:
    lord = MemLord()
    live = [torch.empty(4) for _ in range(N_LIVE)]  # noqa: F841  (kept alive for the scan)
    env = {"lord": lord, "scan": _seed_scan}
    subject = Case(
        'with lord.region("step"): pass', 'with lord.region("step"): pass', env, unroll=20
    )
    seed = Case("gc.get_objects() tensor sum, before + after", "scan(); scan()", env)
    vs_seed = compare(
        subject,
        seed,
        target=0.001,
        cfg=Config(samples=max(5, cfg.samples // 3), sample_ms=cfg.sample_ms, warmup_samples=1),
        note=f"{N_LIVE:,} live tensors; the seed scans before and after the block",
    )
    absolute = Row(
        name='with lord.region("step"): pass',
        median_ns=vs_seed.median_ns,
        floor_name="budget 1 µs",
        floor_median_ns=BUDGET_NS,
        target=1.0,
        note="enter + exit through the Python face (Region object, C enter/exit, aggregate)",
        samples_ns=vs_seed.samples_ns,
        floor_samples_ns=[BUDGET_NS] * len(vs_seed.samples_ns),
    )
    del live
    lord.regions(clear=True)
    return [absolute, vs_seed, _tracked_forward(lord, cfg)]


def _tracked_forward(lord: MemLord, cfg: Config) -> Row:
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    tracker: list = []

    def track() -> None:
        if not tracker:
            tracker.append(lord.track_modules(model, backward=False))

    def untrack() -> None:
        while tracker:
            tracker.pop().disable()

    env = {"model": model, "x": torch.randn(4, 16), "torch": torch}
    stmt = "with torch.no_grad(): model(x)"
    row = compare(
        Case("forward of 8 Linear, track_modules", stmt, env, prepare=track),
        Case("the same forward, untracked", stmt, env, prepare=untrack),
        target=None,
        cfg=cfg,
        note="9 module calls: a region each, its span pushed under the tracker's lock",
    )
    untrack()
    lord.regions(clear=True)
    return row


if __name__ == "__main__":
    sys.exit(main(rows))
