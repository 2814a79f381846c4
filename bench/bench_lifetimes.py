"""LifetimeAnalyzer over 1,000,000 ring events (issue 29): at most 2 s.

The workload: a lord with lifetime tracking records 1,000,000 events into its ring
(500,000 ``torch.empty`` storages of 4 sizes, made at 4 lines inside 2 regions and freed
again, some held across a step; ``lord.step()`` every 1,000 iterations: 500 steps).

*Subject*: ``LifetimeAnalyzer(lord)`` (the ring copied and read once: allocs paired with
their frees, the name tables, the steps), then ``peak_composition()`` and
``get_optimization_suggestions()`` (which includes the reuse plan of the peak's step).

*Floors*, in the same process over the same ring: the 2 s budget itself (row 1: the
ratio is the share of the budget used, target <= 1), and NumPy's own ``lexsort`` of the
ring's (device, address) columns, the one sort the pairing needs (row 2: how far the
analyzer is from that sort alone). Row 3 is ``compute_reuse_plan()`` over all 500 steps
(the interval assignment in one pass over 1,000,000 sorted endpoints) against the budget.

    python bench/bench_lifetimes.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import torch
from _harness import Case, Config, Row, compare, main

from memlord import LifetimeAnalyzer, MemLord

N_EVENTS = 1_000_000
STEP_EVERY = 1_000
BUDGET_NS = 2e9
SAMPLES = 7


def _workload() -> MemLord:
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(N_EVENTS + 64)
    sizes = (16, 64, 256, 1024)
    held = []
    with lord.hook_into_python():
        for i in range(N_EVENTS // 2):
            with lord.region("fwd" if i % 2 else "bwd"):
                k = i % 4
                if k == 0:
                    t = torch.empty(sizes[0])
                elif k == 1:
                    t = torch.empty(sizes[1])
                elif k == 2:
                    t = torch.empty(sizes[2])
                else:
                    t = torch.empty(sizes[3])
                held.append(t)
                if len(held) > 8:
                    del held[0]
            if i % STEP_EVERY == STEP_EVERY - 1:
                lord.step()
        held.clear()
    return lord


def _analyze(lord: MemLord) -> int:
    a = LifetimeAnalyzer(lord)
    a.peak_composition()
    return len(a.get_optimization_suggestions()["suggestions"])


def _plan(a: LifetimeAnalyzer) -> int:
    return len(a.compute_reuse_plan())


def _floor_sort(recs: np.ndarray) -> int:
    return int(np.lexsort((recs["address"], recs["device"]))[0])


def _against_budget(row: Row, name: str) -> Row:
    return replace(
        row,
        floor_name=name,
        floor_median_ns=BUDGET_NS,
        floor_samples_ns=[BUDGET_NS] * len(row.samples_ns),
        target=1.0,
    )


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    cfg = replace(cfg, samples=min(cfg.samples, SAMPLES), warmup_samples=1)
    lord = _workload()
    recs = lord.events()
    assert recs.shape[0] >= N_EVENTS and lord.events_dropped == 0, recs.shape
    a = LifetimeAnalyzer(lord)
    assert len(a.steps()) >= N_EVENTS // 2 // STEP_EVERY
    env = {"lord": lord, "analyze": _analyze, "recs": recs, "sort": _floor_sort}
    env2 = {"a": a, "plan": _plan}
    noop = Case("nothing", "pass", {})
    analyze = Case(
        f"LifetimeAnalyzer({recs.shape[0]:,} events) + peak + suggestions", "analyze(lord)", env
    )
    r2 = compare(
        analyze,
        Case("numpy lexsort of (device, address)", "sort(recs)", env),
        target=40.0,
        cfg=cfg,
        note="the floor is the one sort the pairing of allocs with frees needs",
    )
    r1 = _against_budget(r2, "the 2 s budget")
    r1.target = 1.0
    r1.note = "the ring read once, peak_composition(), get_optimization_suggestions()"
    plan = Case("compute_reuse_plan(), 500 steps", "plan(a)", env2)
    r3 = _against_budget(compare(plan, noop, target=1.0, cfg=cfg), "the 2 s budget")
    r3.note = f"{len(a.compute_reuse_plan()):,} buffers for the storages of every step"
    return [r1, r2, r3]


if __name__ == "__main__":
    sys.exit(main(rows))
