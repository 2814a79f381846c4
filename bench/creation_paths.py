"""The creation paths the python hooks wrap since 2026-11-27 (``Tensor.new_*``,
``torch.UntypedStorage(...)``, ``torch.get_rng_state()``, ``Generator.get_state()``),
beside ``torch.zeros`` (a factory wrapped all along), each hooked
(``hook_into_python()``, lifetime tracking on) against the same call bare, in the same
run: the floor is torch's own call.  Then an optimizer's step (AdamW, foreach, 500 small
parameters) with ``track_modules`` and both hooks against bare: what the optimizer
sources' walk over parameters, gradients and state costs a step (docs/benchmarks.md,
"creation-paths").

    python bench/creation_paths.py [ROUNDS]

Medians of interleaved rounds (hooked and bare alternate); informative, no target.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from memlord import MemLord

CALLS = 20_000


def per_call_ns(fn: Callable[[], Any], n: int = CALLS) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e9


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    torch.set_num_threads(1)
    x = torch.ones(4)
    g = torch.Generator().manual_seed(0)
    cases: dict[str, Callable[[], Any]] = {
        "torch.zeros(4)": lambda: torch.zeros(4),
        "x.new_zeros(4)": lambda: x.new_zeros(4),
        "x.new_empty(4)": lambda: x.new_empty(4),
        "torch.UntypedStorage(16)": lambda: torch.UntypedStorage(16),
        "torch.get_rng_state()": lambda: torch.get_rng_state(),
        "g.get_state()": lambda: g.get_state(),
    }
    lord = MemLord(auto_gc_bytes=None)
    times: dict[str, dict[str, list[float]]] = {k: {"bare": [], "hooked": []} for k in cases}
    for i in range(rounds):
        for how in ("bare", "hooked") if i % 2 == 0 else ("hooked", "bare"):
            hooks = lord.hook_into_python() if how == "hooked" else None
            for name, fn in cases.items():
                n = CALLS // 10 if "state" in name else CALLS
                times[name][how].append(per_call_ns(fn, n))
            if hooks is not None:
                hooks.disable()
            gc.collect()
    print(f"{'call':28} {'bare ns':>9} {'hooked ns':>10} {'ratio':>7}")
    for name, t in times.items():
        bare, hooked = statistics.median(t["bare"]), statistics.median(t["hooked"])
        print(f"{name:28} {bare:9.0f} {hooked:10.0f} {hooked / bare:6.2f}x")

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(250)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    steps: dict[str, list[float]] = {"bare": [], "tracked": []}
    for i in range(rounds):
        for how in ("bare", "tracked") if i % 2 == 0 else ("tracked", "bare"):
            handles: list[Any] = []
            if how == "tracked":
                handles = [lord.hook_into_torch(), lord.hook_into_python()]
                handles.append(lord.track_modules(model))
            opt.step()  # a first step meets the model once
            samples = []
            for _ in range(10):
                t0 = time.perf_counter()
                opt.step()
                samples.append(time.perf_counter() - t0)
            steps[how].append(statistics.median(samples) * 1e3)
            for h in reversed(handles):
                h.disable()
    bare, tracked = statistics.median(steps["bare"]), statistics.median(steps["tracked"])
    print(
        f"AdamW step, 500 parameters: bare {bare:.2f} ms, tracked {tracked:.2f} ms, "
        f"{tracked / bare:.2f}x"
    )


if __name__ == "__main__":
    main()
