"""A GPT training step (bench_ops.py's) under ``hook_into_python(ops=True)`` without and
with the event ring recording, against bare: what the ring's one event per storage
costs a step (docs/benchmarks.md, "ring-per-storage").

    python bench/ring_events_step.py [ROUNDS]

Prints the medians of interleaved samples (3 steps each, the variants in a rotating
order) and the ring's events per step. Informative: no target.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import make_training  # noqa: E402

from memlord import MemLord  # noqa: E402

NAMES = ["bare", "ops", "ops+ring"]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(1)
    _model, _opt, step = make_training()
    lords = {name: MemLord() for name in NAMES}

    def enter(name: str) -> Callable[[], None]:
        if name == "bare":
            return lambda: None
        lord = lords[name]
        if name == "ops+ring":
            lord.record_events(1 << 20)
        hooks = lord.hook_into_python(ops=True)

        def leave() -> None:
            hooks.disable()
            lord.record_events(0)

        return leave

    times: dict[str, list[float]] = {name: [] for name in NAMES}
    for i in range(rounds + 1):
        for name in NAMES[i % 3 :] + NAMES[: i % 3]:
            leave = enter(name)
            step()
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            dt = (time.perf_counter() - t0) / 3
            leave()
            if i:  # the first round warms up
                times[name].append(dt)
    med = {name: statistics.median(v) for name, v in times.items()}
    lord = MemLord()
    lord.record_events(1 << 20)
    with lord.hook_into_python(ops=True):
        step()
        before = len(lord.events())
        step()
        per_step = len(lord.events()) - before
    for name in NAMES:
        print(f"{name:10s} {med[name] * 1e3:7.1f} ms  {med[name] / med['bare']:.3f}x")
    print(f"ring events per step: {per_step}")


if __name__ == "__main__":
    main()
