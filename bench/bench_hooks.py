"""The torch move hooks' benchmarks (issue 3): hooked against unhooked, in the same run.

Each row times one statement at a real call site (``t.half()``, ``m.to(torch.float64)``...)
twice in the same process: with ``lord.hook_into_torch()`` enabled (the subject: the patched
attribute, the conversion, the accounting with call sites on) and with the hooks disabled (the
floor: torch's own method, the very same object it was before memlord). Both run the *same*
compiled timing loop; only the patch differs. Samples alternate A/B/B/A..., the hooks being
enabled or disabled between samples (outside the timed region), so drift and noise from other
processes hit both alike. Medians over ``cfg.samples`` (>= 21) samples of ~``cfg.sample_ms``.

1. a no-op ``.to`` (the result is the input): target <= 1.3x;
2. a 1 KiB same-device dtype cast (256 float32 -> float16, as ``.half()`` and as
   ``.to(torch.float16)``, and ``.half()`` inside a one-line function, as most code calls
   it: a fresh Python frame per cast): target <= 1.10x;
3. ``Module.to(dtype)`` of a 1,000-tensor module (500 x nn.Linear(4, 4)), float32 -> float64
   -> float32 round trips: target <= 1.10x;
4. on a GPU only: a 4 KiB non_blocking cuda -> cpu move on the default stream (the free
   waits on the stream: one stream query per move, an event only while the stream is
   busy): target <= 1.2x.
   Without CUDA the row is left out (and a note says so).

    python bench/bench_hooks.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]

``rows(cfg)`` returns harness ``Row`` objects, as bench/run_all.py expects; ``row_dicts(rows)``
turns them into plain dicts {name, median_ns, floor_name, floor_ns, ratio, target}.
"""

from __future__ import annotations

import statistics
import sys

import torch
from _harness import Case, Config, Row, compare, main, switch_compare
from torch import nn

from memlord import MemLord, _core

NOOP_TARGET = 1.3
CAST_TARGET = 1.10
MODULE_TARGET = 1.10
CUDA_MOVE_TARGET = 1.2
MIN_SAMPLES = 21
N_TENSORS = 1000


def hooked_vs_unhooked(
    case: Case,
    cfg: Config,
    *,
    target: float,
    note: str = "",
    after_sample=None,
    counts: bool = True,
) -> Row:
    """Time `case` with the hooks on (subject) and off (floor), alternating per sample."""
    lord = MemLord()  # the defaults: call sites on, auto-GC "auto"
    assert not _core._hooks_info()["installed"], "hooks already installed by someone else"
    on, off = switch_compare(
        case, lord.hook_into_torch, cfg, min_samples=MIN_SAMPLES, after_sample=after_sample
    )
    results = {True: on, False: off}
    # The subject really went through the hooks: conversions counted, no-ops not.
    assert bool(lord.stats()) == counts, (case.name, lord.stats())
    return Row(
        name=f"{case.name} (hooked)",
        median_ns=statistics.median(results[True]),
        floor_name="unhooked",
        floor_median_ns=statistics.median(results[False]),
        target=target,
        note=note,
        samples_ns=results[True],
        floor_samples_ns=results[False],
    )


def _linear_stack() -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(N_TENSORS // 2)))


def cpu_rows(cfg: Config) -> list[Row]:
    t = torch.zeros(256)  # 1 KiB of float32
    f16, f32, cpu = torch.float16, torch.float32, torch.device("cpu")

    def half(x: torch.Tensor) -> torch.Tensor:
        return x.half()

    env = {"t": t, "f16": f16, "f32": f32, "cpu": cpu, "half": half}
    assert t.to(f32) is t and t.to(cpu) is t
    rows = [
        hooked_vs_unhooked(
            Case("no-op t.to(torch.float32)", "t.to(f32)", env, unroll=20),
            cfg,
            target=NOOP_TARGET,
            counts=False,
        ),
        hooked_vs_unhooked(
            Case('no-op t.to(torch.device("cpu"))', "t.to(cpu)", env, unroll=20),
            cfg,
            target=NOOP_TARGET,
            counts=False,
        ),
        hooked_vs_unhooked(
            Case("1 KiB cast t.half()", "t.half()", env, unroll=10), cfg, target=CAST_TARGET
        ),
        hooked_vs_unhooked(
            Case("1 KiB cast t.to(torch.float16)", "t.to(f16)", env, unroll=10),
            cfg,
            target=CAST_TARGET,
        ),
        hooked_vs_unhooked(
            Case("1 KiB cast in a function, half(t)", "half(t)", env, unroll=10),
            cfg,
            target=CAST_TARGET,
            note="def half(x): return x.half(); the call site is read in a new frame each time",
        ),
    ]
    m = _linear_stack()
    assert sum(1 for _ in m.parameters()) == N_TENSORS
    rows.append(
        hooked_vs_unhooked(
            Case(
                f"Module.to(dtype), {N_TENSORS:,} tensors",
                "m.to(f64); m.to(f32)",
                {"m": m, "f64": torch.float64, "f32": f32},
                ops=2,
            ),
            cfg,
            target=MODULE_TARGET,
            note="float32 -> float64 -> float32; per Module.to call",
        )
    )
    return rows


def cuda_rows(cfg: Config) -> list[Row]:
    if not torch.cuda.is_available():
        return []
    x = torch.zeros(1024, device="cuda:0")  # 4 KiB
    cpu = torch.device("cpu")
    for _ in range(100):  # warm the pinned host allocator
        x.to(cpu, non_blocking=True)
    torch.cuda.synchronize()
    sync = getattr(torch.cuda.synchronize, "__wrapped__", torch.cuda.synchronize)
    stream = torch.cuda.current_stream()
    return [
        hooked_vs_unhooked(
            Case(
                "4 KiB cuda->cpu non_blocking",
                "x.to(cpu, non_blocking=True)",
                {"x": x, "cpu": cpu},
                unroll=10,
            ),
            cfg,
            target=CUDA_MOVE_TARGET,
            note="default stream: a stream query per move, an event only while it is busy; "
            "what is pending is credited at disable() after each sample",
            after_sample=sync,
        ),
        # what recording one CUDA event per move costs without memlord (through torch's
        # Python Event.record: its Python is in it too): the mechanism a deferred free
        # stands on, measured beside it
        compare(
            Case(
                "4 KiB cuda->cpu non_blocking + Event.record() (no memlord)",
                "x.to(cpu, non_blocking=True); ev.record(stream)",
                {"x": x, "cpu": cpu, "ev": torch.cuda.Event(), "stream": stream},
                unroll=10,
            ),
            Case(
                "4 KiB cuda->cpu non_blocking (no memlord)",
                "x.to(cpu, non_blocking=True)",
                {"x": x, "cpu": cpu},
                unroll=10,
            ),
            target=None,
            cfg=cfg,
            note="the floor of an event per move, recorded from Python",
        ),
    ]


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    return cpu_rows(cfg) + cuda_rows(cfg)


def row_dicts(rs: list[Row]) -> list[dict[str, object]]:
    return [
        {
            "name": r.name,
            "median_ns": r.median_ns,
            "floor_name": r.floor_name,
            "floor_ns": r.floor_median_ns,
            "ratio": r.ratio,
            "target": r.target,
        }
        for r in rs
    ]


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA GPU: the 4 KiB non_blocking cuda->cpu row is left out")
    sys.exit(main(rows))
