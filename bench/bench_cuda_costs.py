"""Where a deferred 4 KiB cuda->cpu move's time goes, on a GPU: the parts measured apart.

* the driver alone (bench/cuda_costs.c, built here with the system C compiler): a 4 KiB
  cuMemcpyDtoHAsync paced like torch's own host work, alone, with an event recorded and
  the previous one queried per copy, with a stream query before each copy, with two
  cuCtxGetCurrent;
* memlord's part without any driver call: the hooked move with no driver loaded (the free
  credited at once) against bare;
* the hooked move as users run it against bare (bench_hooks.py's row), and the same on a
  side stream, where memlord records an event per move;
* torch's current-stream read that each deferred move makes
  (``torch._C._cuda_getCurrentRawStream``) against a C builtin of the same arity.

    python bench/bench_cuda_costs.py [--samples N]      (needs a CUDA GPU)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _harness import Case, Config, Row, compare, main, switch_compare

from memlord import MemLord, _core

HERE = Path(__file__).resolve().parent


def driver_costs() -> str:
    exe = Path(tempfile.gettempdir()) / "memlord_cuda_costs"
    cc = os.environ.get("CC", "cc")
    built = subprocess.run(
        [cc, "-O2", "-o", str(exe), str(HERE / "cuda_costs.c"), "-ldl"],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        return f"cuda_costs.c did not build: {built.stderr.strip()}"
    out = []
    for pace in ("8000", "2000"):
        ran = subprocess.run([str(exe), pace], capture_output=True, text=True, timeout=120)
        out.append(ran.stdout + ran.stderr)
    return "".join(out)


def _move_row(cfg: Config, name: str, driver: str | None) -> Row:
    x = torch.zeros(1024, device="cuda:0")
    cpu = torch.device("cpu")
    sync = getattr(torch.cuda.synchronize, "__wrapped__", torch.cuda.synchronize)
    case = Case(name, "x.to(cpu, non_blocking=True)", {"x": x, "cpu": cpu}, unroll=10)
    if driver is not None:
        _core._testing.cuda_driver(driver)
    try:
        lord = MemLord()
        on, off = switch_compare(case, lord.hook_into_torch, cfg, after_sample=sync)
    finally:
        if driver is not None:
            _core._testing.cuda_driver(None)
    return Row(
        name=name,
        median_ns=statistics.median(on),
        floor_name="unhooked",
        floor_median_ns=statistics.median(off),
        target=None,
        samples_ns=on,
        floor_samples_ns=off,
    )


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    if not torch.cuda.is_available():
        return []
    x = torch.zeros(1024, device="cuda:0")
    for _ in range(100):  # warm the pinned host allocator
        x.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    raw = torch._C._cuda_getCurrentRawStream
    side = torch.cuda.Stream()
    torch.cuda.set_stream(side)
    try:
        on_side = _move_row(cfg, "4 KiB move hooked, on a side stream (an event per move)", None)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
    return [
        _move_row(cfg, "4 KiB move hooked, default stream (as users run it)", None),
        on_side,
        _move_row(
            cfg, "4 KiB move hooked, no driver (credited at once)", "/nonexistent/libcuda.so"
        ),
        compare(
            Case("_cuda_getCurrentRawStream(0)", "raw(0)", {"raw": raw}, unroll=10),
            Case("abs(0)", "f(0)", {"f": abs}, unroll=10),
            target=None,
            cfg=cfg,
        ),
    ]


if __name__ == "__main__":
    if torch.cuda.is_available():
        print(driver_costs())
    sys.exit(main(rows))
