"""Instructions (and, with --cache-sim, cache misses) per hooked 1 KiB cast, from callgrind.

Wall-clock ratios on a shared machine move by several percent from run to run; callgrind
counts what one cast executes, the same every run. The instrumentation is switched on
around the timed casts only, by callgrind's client requests from a small C library built
here (gcc and valgrind's headers), after warm-up casts; the hash seed is fixed. Each
figure is per cast: the whole process's count over the casts, unhooked and hooked
(``MemLord()`` defaults, ``hook_into_torch()``), and their difference, memlord's part.

    python bench/cg_cast.py [--loop lines|function] [--casts N] [--cache-sim] [--own] [--ring N]

``--loop lines``: ten ``t.half()`` lines in a loop (bench_hooks.py's row); ``function``:
``half(t)`` with ``def half(x): return x.half()``, a fresh frame per cast. ``--own`` also
prints memlord's own instructions per cast: the hook's inclusive count minus torch's
``THPVariable_half``'s (the difference of the two processes' totals also moves with what
differs between them outside the casts, a few tens of instructions). Needs valgrind
(``callgrind_annotate`` for ``--own``). ``--ring N``: the hooked lord records its events
too (``lord.record_events(N)``, bench_events.py's row): every cast's events carry a time
and a thread. docs/benchmarks.md quotes its figures.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CLIENT = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""

WARMUP_ROUNDS = 30


def child(lib: str, loop: str, hooked: bool, rounds: int, ring: int = 0) -> None:
    import ctypes
    import gc

    import torch

    from memlord import MemLord

    cg = ctypes.CDLL(lib)
    t = torch.zeros(256)  # 1 KiB of float32

    # ten casts on one line of the loop (the layout of docs/benchmarks.md's figures),
    # compiled from text so that the formatter leaves them there
    ns = {"t": t}
    exec(
        compile(
            "def half(x):\n    return x.half()\n"
            "def lines(n, t=t):\n    for _ in range(n):\n        "
            + "; ".join(["t.half()"] * 10)
            + "\ndef function(n, t=t, half=half):\n    for _ in range(n):\n        "
            + "; ".join(["half(t)"] * 10)
            + "\n",
            "<cg_cast>",
            "exec",
        ),
        ns,
    )
    lines, function = ns["lines"], ns["function"]

    f = lines if loop == "lines" else function
    if hooked:
        lord = MemLord()
        lord.hook_into_torch()
        if ring:
            lord.record_events(ring)
    gc.disable()
    f(WARMUP_ROUNDS)
    cg.cg_start()
    f(rounds)
    cg.cg_stop()


def totals(path: Path) -> dict[str, int]:
    events = values = None
    for line in path.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("totals:"):
            values = [int(v) for v in line.split()[1:]]
    if events is None or values is None:
        raise SystemExit(f"cg_cast: no totals in {path}")
    return dict(zip(events, values, strict=True))


def own_per_cast(dump: Path, casts: int) -> float:
    """The hook's inclusive instructions minus THPVariable_half's, per cast."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--auto=no", str(dump)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    hook = half = None
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\([^)]*\)\s+\S*?:(\S+)", line)
        if m is None:
            continue
        count, fn = int(m.group(1).replace(",", "")), m.group(2)
        if hook is None and fn.startswith("hook_tensor"):
            hook = count
        if half is None and "THPVariable_half" in fn:
            half = count
    if hook is None or half is None:
        raise SystemExit(f"cg_cast: no hook_tensor or THPVariable_half in {dump}")
    return (hook - half) / casts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop", choices=("lines", "function"), default="lines")
    parser.add_argument("--casts", type=int, default=2000, help="casts counted (multiple of 10)")
    parser.add_argument("--cache-sim", action="store_true", help="count cache misses too")
    parser.add_argument(
        "--own", action="store_true", help="also memlord's own instructions per cast"
    )
    parser.add_argument(
        "--ring", type=int, default=0, help="the hooked lord records events (ring size)"
    )
    parser.add_argument(
        "--child", nargs=3, metavar=("LIB", "HOOKED", "ROUNDS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        lib, hooked, rounds = args.child
        child(lib, args.loop, hooked == "1", int(rounds), args.ring)
        return 0
    if args.casts <= 0 or args.casts % 10:
        parser.error(f"--casts must be a positive multiple of 10, got {args.casts}")
    for tool in ("valgrind", "gcc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"cg_cast: {tool} is not installed")
    rounds = args.casts // 10
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp, "cgctl.c"), Path(tmp, "libcgctl.so")
        src.write_text(CLIENT)
        subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        env = dict(os.environ, PYTHONHASHSEED="0")
        got = {}
        for hooked in (0, 1):
            out = Path(tmp, f"cg.{hooked}")
            cmd = [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
            ]
            if args.cache_sim:
                cmd.append("--cache-sim=yes")
            cmd += [
                sys.executable,
                __file__,
                "--loop",
                args.loop,
                "--ring",
                str(args.ring),
                "--child",
                str(lib),
                str(hooked),
                str(rounds),
            ]
            subprocess.run(
                cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            dumps = sorted(Path(tmp).glob(f"cg.{hooked}.*"))
            if not dumps:
                raise SystemExit("cg_cast: callgrind wrote no dump (client requests not seen)")
            got[hooked] = totals(dumps[0])
            if hooked and args.own:
                own = own_per_cast(dumps[0], args.casts)
    ring = f", event ring {args.ring:,}" if args.ring else ""
    print(f"callgrind, {args.casts} casts ({args.loop}{ring}), {sys.version.split()[0]}, per cast:")
    print(f"{'event':>6} {'unhooked':>10} {'hooked':>10} {'memlord':>9}")
    for ev in got[0]:
        a, b = got[0][ev] / args.casts, got[1][ev] / args.casts
        print(f"{ev:>6} {a:10.1f} {b:10.1f} {b - a:+9.1f}")
    if args.own:
        print(f"memlord's own (the hook minus THPVariable_half, inclusive): {own:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
