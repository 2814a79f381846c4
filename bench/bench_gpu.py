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

import torch
from _harness import Config, Row, main
from torch import nn

import memlord

ROUNDS = 3
STEPS_PER_ROUND = 5
LAYERS, WIDTH, BATCH = 8, 4096, 64

OFFLOAD_TIME_TARGET = 1.10  # auto-GC's step time against never releasing
OFFLOAD_RESERVED_TARGET = 0.75  # auto-GC's peak reserved against never releasing
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
            OFFLOAD_RESERVED_TARGET,
            unit="B",
            note=f"every layer's peak: {every[1] / mib:.1f} MiB",
        ),
    ]
    return rows, {v: {"ms_per_step": ns / 1e6, "peak_reserved": p} for v, (ns, p) in med.items()}


def _train_model():
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 128, 512, device="cuda")
    return model, opt, x


def _train_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def training_rows(cfg: Config) -> list[Row]:
    model, opt, x = _train_model()
    for _ in range(3):
        _train_step(model, opt, x)
    torch.cuda.synchronize()

    def sample(on: bool | str) -> float:
        lord = handles = None
        if on == "ops":
            lord = memlord.MemLord()
            handles = [lord.hook_into_python(ops=True)]
        elif on:
            lord = memlord.MemLord()
            handles = [lord.hook_into_torch(), lord.hook_into_python(), lord.track_modules(model)]
            lord.record_events(1 << 16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            for _ in range(STEPS_PER_ROUND):
                _train_step(model, opt, x)
                if lord is not None and on is True:
                    lord.step()
            torch.cuda.synchronize()
        finally:
            for h in reversed(handles or []):
                h.disable()
        return (time.perf_counter() - t0) / STEPS_PER_ROUND * 1e9

    on, off, ops = [], [], []
    order = [(True, on), ("ops", ops), (False, off)]
    for i in range(max(cfg.samples // 3, 7)):
        for flag, out in order if i % 2 == 0 else order[::-1]:
            out.append(sample(flag))
    return [
        Row(
            "6-layer transformer train step, everything on",
            statistics.median(on),
            "the same step, bare torch",
            statistics.median(off),
            TRAIN_TARGET,
            note="both hooks, track_modules, the event ring, step(); width 512, 16 x 128",
            samples_ns=on,
            floor_samples_ns=off,
        ),
        Row(
            "6-layer transformer train step, hook_into_python(ops=True)",
            statistics.median(ops),
            "the same step, bare torch",
            statistics.median(off),
            OPS_TARGET,
            note="every operator's output counted (a dispatch mode in C); width 512, 16 x 128",
            samples_ns=ops,
            floor_samples_ns=off,
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
