"""Where the "everything on" training step's extra time goes: bench_gpu.py's 6-layer encoder
step, bare and with memlord's variants, each timed, then profiled with cProfile (the
Python functions by their own time, memlord's first).

    python tools/profile_train_step.py [--device cuda|cpu] [--steps N] [--width W]

On a CPU the default width (512) is slow; ``--width 64`` keeps the step launch-bound as
it is on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import memlord

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_gpu import _train_model, _train_step  # noqa: E402 - bench/ is not a package


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    dev, w = torch.device(args.device), args.width
    if w % 8:
        ap.error("--width must be a multiple of 8 (the encoder has 8 heads)")
    model, opt, x = _train_model(args.device, w)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step() -> None:
        _train_step(model, opt, x)

    def variant(name: str) -> tuple[memlord.MemLord | None, list]:
        if name == "bare":
            return None, []
        lord = memlord.MemLord()
        if name == "track_modules":
            return lord, [lord.track_modules(model)]
        if name == "track_modules, forward only":
            return lord, [lord.track_modules(model, backward=False)]
        handles = [lord.hook_into_torch(), lord.hook_into_python()]
        if name == "everything on":
            handles.append(lord.track_modules(model))
            lord.record_events(1 << 16)
        return lord, handles

    names = ["bare", "default hooks", "track_modules, forward only", "track_modules"]
    names.append("everything on")
    for _ in range(3):
        step()
    sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(5):
        for name in names if r % 2 == 0 else names[::-1]:
            lord, handles = variant(name)
            try:
                step()
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                    if name == "everything on":
                        lord.step()
                sync()
                times[name].append((time.perf_counter() - t0) / args.steps * 1e3)
            finally:
                for h in reversed(handles):
                    h.disable()
    nmod = sum(1 for _ in model.modules())
    bare = statistics.median(times["bare"])
    print(f"profile_train_step: {dev}, width {w}, {nmod} modules, medians of 5 rounds")
    for name in names:
        m = statistics.median(times[name])
        extra = (m - bare) * 1e3 / nmod
        print(f"  {name:<28} {m:8.2f} ms  {m / bare:5.2f}x  {extra:+7.1f} us per module")
    lord, handles = variant("everything on")
    try:
        step()
        sync()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
            lord.step()
        sync()
        prof.disable()
    finally:
        for h in reversed(handles):
            h.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())


if __name__ == "__main__":
    main()
