"""Run every benchmark module in bench/ (bench_*.py) and print one table.

    python bench/run_all.py [--samples N] [--sample-ms MS] [--quick] [--json PATH] [-k NAME]

Exit status 1 when a benchmark misses its target. Each module can also run alone:
``python bench/bench_core.py``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from _harness import parse_args, report

BENCH_DIR = Path(__file__).resolve().parent


def modules(select: str | None) -> list[str]:
    names = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))
    return [n for n in names if select is None or select in n]


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    names = modules(args.k)
    if not names:
        print(f"no benchmark module matches {args.k!r}", file=sys.stderr)
        return 2
    rows = []
    for name in names:
        print(f"running {name} ...", flush=True)
        rows.extend(importlib.import_module(name).rows(cfg))
    return report(rows, cfg, args.json)


if __name__ == "__main__":
    sys.exit(main())
