"""Driver calls per deferred move, on the fake CUDA driver (no GPU needed).

A loop of non_blocking moves of a fake-cuda tensor (tests/conftest.py's CudaLike) off
"cuda:0", on torch's legacy default stream, with every copy done at once (the fake's
auto-complete: the GPU keeps up), hooked by a MemLord; for each poll age (0: every
conversion's poll asks the driver; 50,000 ns: memlord's default), the fake's counters per
move. What it costs on a GPU is bench_cuda_costs.py's (run by tools/gpu_check.sh).

    python bench/fake_move_calls.py [--moves N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moves", type=int, default=5000)
    args = ap.parse_args()
    sys.path.insert(0, str(TESTS))
    import conftest
    from fakecuda_driver import FakeCuda, build, standins

    from memlord import MemLord, _core

    lib = build()
    drv = FakeCuda(lib)
    _core._testing.cuda_driver(str(lib))
    drv.reset()
    before = _core._testing.pending_poll_age()
    try:
        with standins(drv) as streams:
            streams.legacy_default()
            drv.set_current(0)
            drv.set_auto_complete(True)
            for age in (0, before):
                _core._testing.pending_poll_age(age)
                lord = MemLord(auto_gc_bytes=None)
                h = lord.hook_into_torch()
                x = conftest.fake_cuda(1024)
                drv.clear_calls()
                t0 = time.perf_counter()
                for _ in range(args.moves):
                    x.to("cpu", non_blocking=True)
                us = (time.perf_counter() - t0) / args.moves * 1e6
                counts = drv.counts()
                h.disable()
                per = ", ".join(
                    f"{k} {v / args.moves:.2f}"
                    for k, v in sorted(counts.items())
                    if v / args.moves >= 0.005  # the driver's loading, once, is left out
                )
                print(
                    f"poll age {age:>6} ns: {sum(counts.values()) / args.moves:.2f} driver "
                    f"calls per move ({per or 'none'}), {us:.1f} us per move"
                )
    finally:
        _core._testing.pending_poll_age(before)
        _core._testing.cuda_driver(None)


if __name__ == "__main__":
    main()
