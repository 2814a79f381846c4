"""The event ring (issue 12): recording every event costs little.

Targets, in the same run:

1. a hooked 1 KiB cast (256 float32 -> float16 with ``t.half()``) with the event ring
   on (``lord.record_events(65536)``) costs at most 1.15x the bare cast (hooks off);
2. (informative) the same hooked cast with the ring on against the ring off, hooks on
   in both: what recording itself adds (target <= 1.05x);
3. one record costs at most 50 ns: ``lord._bench_emit(1000)`` (1,000 one-byte events
   through the seam, one ``ml_emit`` each) with the ring on minus the same with the ring
   off, per event (the floor is the 50 ns budget, so the ratio must be <= 1).

    python bench/bench_events.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]
"""

from __future__ import annotations

import statistics
import sys

import torch
from _harness import Case, Config, Row, compare, main, switch_compare

from memlord import MemLord, _core

CAST_TARGET = 1.15
RING_INCREMENT_TARGET = 1.05
RECORD_BUDGET_NS = 50.0
RING = 65536
N_EMIT = 1000


def cast_row(cfg: Config) -> Row:
    lord = MemLord()
    lord.record_events(RING)
    assert not _core._hooks_info()["installed"], "hooks already installed by someone else"
    t = torch.zeros(256)
    case = Case("1 KiB cast t.half()", "t.half()", {"t": t}, unroll=10)
    on, off = switch_compare(case, lord.hook_into_torch, cfg, min_samples=21)
    recorded = len(lord.events())
    assert recorded > 0, "the ring recorded nothing"
    dropped = lord.events_dropped
    lord.record_events(0)
    return Row(
        name="1 KiB cast t.half() (hooked, event ring on)",
        median_ns=statistics.median(on),
        floor_name="bare cast",
        floor_median_ns=statistics.median(off),
        target=CAST_TARGET,
        note=f"ring of {RING:,} records, wrapping: {dropped:,} overwritten",
        samples_ns=on,
        floor_samples_ns=off,
    )


def ring_increment_row(cfg: Config) -> Row:
    """The ring's own share: the hooked cast with the ring on against the hooked cast
    with the ring off, hooks on throughout."""
    lord = MemLord()
    t = torch.zeros(256)
    env = {"t": t}
    with lord.hook_into_torch():
        on = Case(
            "1 KiB cast t.half() (hooked, ring on)",
            "t.half()",
            env,
            unroll=10,
            prepare=lambda: lord.record_events(RING),
        )
        off = Case(
            "hooked, ring off", "t.half()", env, unroll=10, prepare=lambda: lord.record_events(0)
        )
        row = compare(on, off, target=RING_INCREMENT_TARGET, cfg=cfg)
    lord.record_events(0)
    row.note = "what recording adds to the hooked cast (the hooks' own cost is in bench_hooks)"
    return row


def record_row(cfg: Config) -> Row:
    lord = MemLord()
    env = {"lord": lord, "n": N_EMIT}
    on = Case(
        "emit, ring on",
        "lord._bench_emit(n)",
        env,
        ops=N_EMIT,
        prepare=lambda: lord.record_events(RING),
    )
    off = Case(
        "emit, ring off",
        "lord._bench_emit(n)",
        env,
        ops=N_EMIT,
        prepare=lambda: lord.record_events(0),
    )
    row = compare(on, off, target=1.0, cfg=cfg)
    lord.record_events(0)
    diffs = [a - b for a, b in zip(row.samples_ns, row.floor_samples_ns, strict=True)]
    cost = statistics.median(diffs)
    return Row(
        name="one event record",
        median_ns=cost,
        floor_name="budget 50 ns",
        floor_median_ns=RECORD_BUDGET_NS,
        target=1.0,
        note=(
            f"per event: {row.median_ns:.1f} ns with the ring on, {row.floor_median_ns:.1f} ns "
            "off (one ml_emit each); the row is the median of the per-sample differences"
        ),
        samples_ns=diffs,
        floor_samples_ns=[RECORD_BUDGET_NS] * len(diffs),
    )


def rows(cfg: Config) -> list[Row]:
    return [cast_row(cfg), ring_increment_row(cfg), record_row(cfg)]


if __name__ == "__main__":
    sys.exit(main(rows))
