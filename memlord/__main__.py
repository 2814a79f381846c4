"""python -m memlord: a short demo of the ledger on the CPU.

A small transformer-like model is built while lifetime tracking is on, cast
to bfloat16 with the torch move hooks on, then half of its blocks are
dropped.  The per-device table and the top allocation and free sites are
printed at the end.  Set DEBUG=1 to see every event as it happens.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import cast

import torch

from . import MemLord, __version__, _core, format_bytes


def info() -> int:
    print(f"memlord {__version__}")
    print(f"python  {sys.version.split()[0]} ({platform.platform()})")
    print(f"torch   {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    cuda = _core._cuda_info()
    if cuda["driver"]:
        print(
            f"CUDA driver: loaded from {cuda['library']}, {cuda['device_count']} visible device(s)"
        )
    else:
        print(f"CUDA driver: not available ({cuda['reason']})")
    abi = _core._tensor_abi()
    state = (
        "in use"
        if abi["enabled"]
        else ("off (MEMLORD_TENSOR_ABI=0)" if abi["valid"] else "not usable")
    )
    print(f"tensor metadata through torch's stable C ABI: {state}")
    lord = MemLord()
    for dev in ["cpu"] + [f"cuda:{i}" for i in range(cuda["device_count"])]:
        total, used, pct = lord.device_memory(dev)
        if total is not None:  # then used is an int too (three Nones otherwise)
            print(
                f"{dev:<8} {format_bytes(cast(int, used)):>10} used of "
                f"{format_bytes(total):>10} ({pct:.1f}%)"
            )
    return 0


def demo(layers: int) -> int:
    """Run the demo (memlord/_demo.py)."""
    from ._demo import demo as run_demo

    return run_demo(layers)


COMMANDS_HELP = """commands (each has its own --help):
  run [options] script.py [args...]
                  profile a Python script and write reports at its end
  report IN.json [-o OUT.html] [--trace F] [--pickle F]
                  convert a saved JSON profile (HTML, Perfetto trace, torch pickle)
  gantt IN.json OUT.html
                  the interactive Gantt chart of a saved profile
  top [--interval S] [--once] [--json]
                  every process of this user on the host publishing its memory, live
  merge FILES... -o OUT.json|OUT.html [--keep-going]
                  one report of several ranks' profiles or post-mortems

With no command it runs the demo (options above)."""


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in ("run", "report", "gantt", "top", "merge"):
        from .cli import main as cli_main

        return cli_main(args_in)
    parser = argparse.ArgumentParser(
        prog="python -m memlord",
        usage="python -m memlord {run,report,gantt,top,merge} ...\n"
        "       python -m memlord [-h] [--layers LAYERS] [--info] [--version]",
        description=__doc__.splitlines()[0],
        epilog=COMMANDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=4, help="blocks in the demo model (>= 2)")
    parser.add_argument("--info", action="store_true", help="print environment info and exit")
    parser.add_argument("--version", action="version", version=f"memlord {__version__}")
    args = parser.parse_args(args_in)
    if args.info:
        return info()
    if args.layers < 2:
        parser.error("--layers must be at least 2")
    return demo(args.layers)


def _run() -> int:
    """``main()`` for ``python -m memlord``: a reader of stdout that went away (``python
    -m memlord | head -1``) ends the output quietly, with status 1, as the Python
    documentation of SIGPIPE suggests; not with a BrokenPipeError traceback, and a second
    one when stdout is flushed at exit.  (A script that ``run`` runs keeps its own.)"""
    try:
        status = main()
        sys.stdout.flush()  # a block-buffered pipe is written here, not at each print
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        os.close(devnull)
        return 1


if __name__ == "__main__":
    sys.exit(_run())
