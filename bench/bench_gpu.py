"""GPU benchmarks (a CUDA GPU only; without one this module reports nothing).

    python bench/bench_gpu.py [--samples N] [--json PATH]      (tools/gpu_check.sh runs it)

1. **The layer-offload loop**: a stack of 8 fp16 linear layers of 4096 x 4096 (32 MiB
   each) that live on the CPU in pinned memory; each step moves every layer to the GPU
   (``non_blocking``), runs it, and moves it back. Three variants, each in a fresh
   allocator state (cache emptied, peaks reset) and warmed up first, interleaved over
   ``ROUNDS`` rounds (never the same variant twice in a row), each reporting the median
   time per step and the allocator's peak reserved bytes:
   - ``never``: ``torch.cuda.empty_cache()`` is never called (the cache keeps every layer);
   - ``every layer``: ``empty_cache()`` after every layer (the cache is given back at once);
   - ``memlord auto-GC``: ``MemLord(auto_gc_bytes=2 layers)`` with the torch hooks on: the
     cache is released once the moved-away layers add up to the threshold.
   Rows: auto-GC's time per step against ``never`` (what releasing costs) and against
   ``every layer``; auto-GC's peak reserved against ``never``'s (what it saves).
2. **A training step with everything on**: a 6-layer transformer encoder (width 512,
   batch 16 x 128 tokens) with AdamW, one step per sample; memlord with both hooks,
   ``track_modules``, the event ring and ``step()`` against bare torch, interleaved; and
   the same step with ``hook_into_python(ops=True)`` (every operator's output counted).
3. The 4 KiB ``non_blocking`` cuda->cpu move hooked against bare lives in bench_hooks.py
   (its ``cuda_rows``); run_all.py and tools/gpu_check.sh run both modules.
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import torch
from _harness import Config, Row, main
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memlord

ROUNDS = 3
STEPS_PER_ROUND = 5
LAYERS, WIDTH, BATCH = 8, 4096, 64

OFFLOAD_TIME_TARGET = 1.10  # auto-GC's step time against never releasing
TRAIN_TARGET = 1.05  # everything on against bare
OPS_TARGET = 1.02  # hook_into_python(ops=True) against bare (issue #27)


def _offload_layers() -> list[nn.Linear]:
    layers = []
    for _ in range(LAYERS):
        layer = nn.Linear(WIDTH, WIDTH, bias=False).half()
        for p in layer.parameters():
            p.data = p.data.pin_memory()
        layers.append(layer)
    return layers


@torch.no_grad()  # inference: with autograd on, each output's graph kept every layer's weight
def _offload_step(layers, x, *, empty_each: bool) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for layer in layers:
        layer.to(cuda, non_blocking=True)
        x = layer(x)
        layer.to(cpu, non_blocking=True)
        if empty_each:
            torch.cuda.empty_cache()
    torch.cuda.synchronize()


def _offload_variant(name: str, layers, x) -> tuple[float, int]:
    """(median seconds per step, peak reserved bytes) of one round of one variant."""
    lord = hooks = None
    if name == "memlord auto-GC":
        layer_bytes = WIDTH * WIDTH * 2
        lord = memlord.MemLord(auto_gc_bytes=2 * layer_bytes)
        hooks = lord.hook_into_torch()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        _offload_step(layers, x, empty_each=name == "every layer")  # warm-up
        times = []
        for _ in range(STEPS_PER_ROUND):
            t0 = time.perf_counter()
            _offload_step(layers, x, empty_each=name == "every layer")
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_reserved()
        if lord is not None:
            s = lord.stats().get("cuda:0", {})
            print(
                f"  auto-GC round: gc_runs {s.get('gc_runs')}, freed {s.get('freed_total')} B, "
                f"pending {hooks.pending()} B, peak reserved {peak >> 20} MiB"
            )
    finally:
        if hooks is not None:
            hooks.disable()
    return statistics.median(times), peak


def offload_rows(cfg: Config) -> tuple[list[Row], dict]:
    layers = _offload_layers()
    x = torch.randn(BATCH, WIDTH, device="cuda", dtype=torch.float16)
    variants = ["never", "every layer", "memlord auto-GC"]
    results: dict[str, dict[str, list[float]]] = {v: {"s": [], "peak": []} for v in variants}
    for r in range(ROUNDS):
        order = variants[r % 3 :] + variants[: r % 3]
        for v in order:
            s, peak = _offload_variant(v, layers, x)
            results[v]["s"].append(s)
            results[v]["peak"].append(peak)
    med = {
        v: (statistics.median(d["s"]) * 1e9, statistics.median(d["peak"]))
        for v, d in results.items()
    }
    mib = 1 << 20
    for v, (ns, peak) in med.items():
        print(f"  offload {v:<16} {ns / 1e6:8.2f} ms/step  peak reserved {peak / mib:8.1f} MiB")
    auto, never, every = med["memlord auto-GC"], med["never"], med["every layer"]
    rows = [
        Row(
            "offload step, auto-GC",
            auto[0],
            "offload step, never empty_cache",
            never[0],
            OFFLOAD_TIME_TARGET,
            note="time per step of 8 x 32 MiB layers moved in and out",
        ),
        Row(
            "offload step, auto-GC",
            auto[0],
            "offload step, empty_cache every layer",
            every[0],
            1.0,
            note="releasing at a threshold against releasing after every layer",
        ),
        Row(
            "offload peak reserved, auto-GC",
            auto[1],
            "offload peak reserved, never",
            never[1],
            None,
            unit="B",
            note=f"every layer's peak: {every[1] / mib:.1f} MiB",
        ),
    ]
    return rows, {v: {"ms_per_step": ns / 1e6, "peak_reserved": p} for v, (ns, p) in med.items()}


def _train_model(device: str = "cuda", width: int = 512):
    """The 6-layer encoder (8 heads, feed-forward 4 x width), AdamW, 16 x 128 tokens
    (tools/profile_train_step.py uses it too)."""
    layer = nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 128, width, device=device)
    return model, opt, x


def _train_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


class _DoNothingMode(TorchDispatchMode):
    """A dispatch mode in Python that only calls the operator: what any dispatch mode costs
    a step (torch calls into Python for every operator), the floor of ``ops=True``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


#: the variants of the training step, each timed in its own samples, interleaved
TRAIN_VARIANTS = ("bare", "default hooks", "everything on", "ops", "do-nothing mode")


def training_rows(cfg: Config) -> list[Row]:
    model, opt, x = _train_model()
    for _ in range(3):
        _train_step(model, opt, x)
    torch.cuda.synchronize()

    def sample(variant: str) -> float:
        lord = None
        handles: list = []
        if variant == "ops":
            lord = memlord.MemLord()
            handles = [lord.hook_into_python(ops=True)]
        elif variant == "default hooks":
            lord = memlord.MemLord()
            handles = [lord.hook_into_torch(), lord.hook_into_python()]
        elif variant == "everything on":
            lord = memlord.MemLord()
            handles = [lord.hook_into_torch(), lord.hook_into_python(), lord.track_modules(model)]
            lord.record_events(1 << 16)
        elif variant == "do-nothing mode":
            mode = _DoNothingMode()
            mode.__enter__()
            handles = [types.SimpleNamespace(disable=lambda: mode.__exit__(None, None, None))]
        try:
            # one step first, untimed: a new lord meets the model's parameters, gradients
            # and optimizer state once (what a long run pays once, not per step)
            _train_step(model, opt, x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(STEPS_PER_ROUND):
                _train_step(model, opt, x)
                if lord is not None and variant == "everything on":
                    lord.step()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / STEPS_PER_ROUND * 1e9
        finally:
            for h in reversed(handles):
                h.disable()

    got: dict[str, list[float]] = {v: [] for v in TRAIN_VARIANTS}
    for i in range(max(cfg.samples // 3, 7)):
        order = TRAIN_VARIANTS if i % 2 == 0 else TRAIN_VARIANTS[::-1]
        for v in order:
            got[v].append(sample(v))
    med = {v: statistics.median(x) for v, x in got.items()}
    for v, ns in med.items():
        print(f"  train step {v:<16} {ns / 1e6:8.2f} ms  ({ns / med['bare']:.2f}x of bare)")
    shape = "width 512, 16 x 128"
    return [
        Row(
            "6-layer transformer train step, default hooks",
            med["default hooks"],
            "the same step, bare torch",
            med["bare"],
            TRAIN_TARGET,
            note=f"hook_into_torch() and hook_into_python(); {shape}",
            samples_ns=got["default hooks"],
            floor_samples_ns=got["bare"],
        ),
        Row(
            "6-layer transformer train step, everything on",
            med["everything on"],
            "the same step, bare torch",
            med["bare"],
            TRAIN_TARGET,
            note=f"both hooks, track_modules, the event ring, step(); {shape}",
            samples_ns=got["everything on"],
            floor_samples_ns=got["bare"],
        ),
        Row(
            "6-layer transformer train step, hook_into_python(ops=True)",
            med["ops"],
            "the same step, bare torch",
            med["bare"],
            OPS_TARGET,
            note=f"every operator's output counted (a dispatch mode in C); {shape}",
            samples_ns=got["ops"],
            floor_samples_ns=got["bare"],
        ),
        Row(
            "6-layer transformer train step, do-nothing dispatch mode",
            med["do-nothing mode"],
            "the same step, bare torch",
            med["bare"],
            None,
            note="the floor of ops=True: torch calls into Python for every operator",
            samples_ns=got["do-nothing mode"],
            floor_samples_ns=got["bare"],
        ),
        Row(
            "6-layer transformer train step, hook_into_python(ops=True)",
            med["ops"],
            "the same step, do-nothing dispatch mode",
            med["do-nothing mode"],
            1.0,
            note="memlord's mode against the least any dispatch mode costs",
            samples_ns=got["ops"],
            floor_samples_ns=got["do-nothing mode"],
        ),
    ]


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    if not torch.cuda.is_available():
        return []
    offload, _ = offload_rows(cfg)
    return offload + training_rows(cfg)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA GPU: bench_gpu.py has no rows here")
    sys.exit(main(rows))
