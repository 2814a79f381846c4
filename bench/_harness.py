"""A small benchmark harness: medians of repeated timings, and ratios to a floor
measured in the same process.

A benchmark module (bench/bench_*.py) exposes ``rows(cfg: Config) -> list[Row]``
and ends with ``if __name__ == "__main__": sys.exit(main(rows))`` so that it runs
alone; bench/run_all.py imports every bench_*.py and prints one table.

Each row compares a *subject* with a *floor*, both given as a :class:`Case`: one
Python statement and the names it uses. The harness

* compiles the statement, unrolled ``unroll`` times, into a timing loop whose
  names are all function locals (the same loop overhead for subject and floor);
* warms both up and picks, for each, an iteration count that makes one sample
  last about ``cfg.sample_ms`` (timer resolution and call overhead amortised);
* takes ``cfg.samples`` samples of each with time.perf_counter_ns, alternating
  subject and floor (so drift and noise from other processes hit both alike),
  with the cyclic garbage collector off, as timeit does;
* reports the median time of one operation of each and their ratio.

A subject and a floor that run the same statement in different states (torch's
methods hooked or not, say) give each Case a ``prepare`` callable: it runs,
untimed, before each of that case's samples.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Config:
    samples: int = 31
    sample_ms: float = 10.0
    warmup_samples: int = 3


@dataclass
class Case:
    """One statement to time. ``ops`` is how many operations one run of the
    statement performs: the reported time is per operation."""

    name: str
    stmt: str
    env: dict[str, object] = field(default_factory=dict)
    ops: int = 1
    unroll: int = 1
    # Called, untimed, before each of this case's samples (and its calibration): for a
    # subject and a floor that differ by state rather than by statement, e.g. hooks on/off.
    prepare: Callable[[], object] | None = None


@dataclass
class Row:
    name: str
    median_ns: float
    floor_name: str
    floor_median_ns: float
    target: float | None  # None: a measurement without a target (a floor of its own)
    note: str = ""
    unit: str = "ns"  # "ns" for times; any other unit is printed as is ("B")
    samples_ns: list[float] = field(default_factory=list, repr=False)
    floor_samples_ns: list[float] = field(default_factory=list, repr=False)

    @property
    def ratio(self) -> float:
        return self.median_ns / self.floor_median_ns

    @property
    def passed(self) -> bool:
        return self.target is None or self.ratio <= self.target


_TEMPLATE = """
def _make({params}):
    def _loop(_n, _timer=_timer, _range=_range, {defaults}):
        _t0 = _timer()
        for _ in _range(_n):
{body}
        return _timer() - _t0
    return _loop
"""


def make_loop(case: Case) -> Callable[[int], int]:
    """A function ``loop(n)`` that runs the statement ``n * case.unroll`` times and
    returns the elapsed nanoseconds."""
    names = ["_timer", "_range", *case.env]
    params = ", ".join(names)
    defaults = ", ".join(f"{n}={n}" for n in case.env) or "_unused=None"
    body = "\n".join("            " + case.stmt for _ in range(case.unroll))
    src = _TEMPLATE.format(params=params, defaults=defaults, body=body)
    namespace: dict[str, object] = {}
    exec(compile(src, f"<bench {case.name}>", "exec"), namespace)
    return namespace["_make"](time.perf_counter_ns, range, *case.env.values())


def calibrate(loop: Callable[[int], int], sample_ns: float) -> int:
    """An iteration count for which ``loop(n)`` lasts at least sample_ns."""
    n = 1
    while True:
        elapsed = loop(n)
        if elapsed >= sample_ns or n >= 1 << 30:
            break
        # aim a little past the target, at most 10x more per step
        n = max(n + 1, min(n * 10, int(n * sample_ns * 1.2 / max(elapsed, 1))))
    return n


def compare(
    subject: Case, floor: Case, *, target: float | None, cfg: Config, note: str = ""
) -> Row:
    """Time subject and floor in alternation; one row with their medians."""
    cases = (subject, floor)
    loops = [make_loop(c) for c in cases]
    per_op = [c.ops * c.unroll for c in cases]
    sample_ns = cfg.sample_ms * 1e6
    results: list[list[float]] = [[], []]
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        counts = []
        for case, loop in zip(cases, loops, strict=True):
            if case.prepare is not None:
                case.prepare()
            counts.append(calibrate(loop, sample_ns))
        for i in range(cfg.warmup_samples + cfg.samples):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for k in order:
                if cases[k].prepare is not None:
                    cases[k].prepare()
                elapsed = loops[k](counts[k])
                if i >= cfg.warmup_samples:
                    results[k].append(elapsed / (counts[k] * per_op[k]))
    finally:
        if was_enabled:
            gc.enable()
    return Row(
        name=subject.name,
        median_ns=statistics.median(results[0]),
        floor_name=floor.name,
        floor_median_ns=statistics.median(results[1]),
        target=target,
        note=note,
        samples_ns=results[0],
        floor_samples_ns=results[1],
    )


def switch_compare(
    case: Case,
    enable: Callable[[], Any],
    cfg: Config,
    *,
    min_samples: int = 21,
    after_sample: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Time one case with a process-wide switch on and off, alternating per sample.

    enable() turns the switch on and returns a handle whose disable() turns it off
    (memlord's hook_into_torch / hook_into_python).  The iteration count is calibrated
    on the slower side, switched on.  Returns (on, off) per-operation samples in ns.
    """
    loop = make_loop(case)
    per_op = case.ops * case.unroll
    sample_ns = cfg.sample_ms * 1e6
    samples = max(cfg.samples, min_samples)
    results: dict[bool, list[float]] = {True: [], False: []}

    def one(on: bool, n: int) -> float:
        handle = enable() if on else None
        try:
            elapsed = loop(n)
            if after_sample is not None:
                after_sample()
        finally:
            if handle is not None:
                handle.disable()
        return elapsed / (n * per_op)

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        handle = enable()
        try:
            n = calibrate(loop, sample_ns)
        finally:
            handle.disable()
        for i in range(cfg.warmup_samples + samples):
            for on in (True, False) if i % 2 == 0 else (False, True):
                t = one(on, n)
                if i >= cfg.warmup_samples:
                    results[on].append(t)
    finally:
        if was_enabled:
            gc.enable()
    return results[True], results[False]


# ---------------------------------------------------------------------------- report


def format_ns(ns: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def format_value(value: float, unit: str) -> str:
    return format_ns(value) if unit == "ns" else f"{value:.4g} {unit}"


def machine() -> dict[str, str]:
    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": str(os.cpu_count()),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for mod in ("torch", "numpy", "memlord"):
        module = sys.modules.get(mod)
        if module is not None:
            info[mod] = getattr(module, "__version__", "?")
    return info


def table(rows: Sequence[Row]) -> str:
    header = ["benchmark", "median", "floor", "floor median", "ratio", "target", "result"]
    body = [
        [
            r.name,
            format_value(r.median_ns, r.unit),
            r.floor_name,
            format_value(r.floor_median_ns, r.unit),
            f"{r.ratio:.2f}x",
            "-" if r.target is None else f"<= {r.target:g}x",
            "measured" if r.target is None else "pass" if r.passed else "FAIL",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = {1, 3, 4, 5}

    def fmt(line: list[str]) -> str:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        return "| " + " | ".join(cells) + " |"

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([fmt(header), sep, *map(fmt, body)])


def report(rows: Sequence[Row], cfg: Config, json_path: str | None = None) -> int:
    info = machine()
    print(
        "machine: "
        + ", ".join(f"{k} {v}" for k, v in info.items() if k != "platform")
        + f"; {cfg.samples} samples of ~{cfg.sample_ms:g} ms, medians"
    )
    print(table(rows))
    notes = [f"  {r.name}: {r.note}" for r in rows if r.note]
    if notes:
        print("notes:\n" + "\n".join(notes))
    failed = [r.name for r in rows if not r.passed]
    if json_path:
        out = {
            "machine": info,
            "config": asdict(cfg),
            "rows": [dict(asdict(r), ratio=r.ratio, passed=r.passed) for r in rows],
        }
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {json_path}")
    if failed:
        print(f"{len(failed)} of {len(rows)} benchmarks missed their target", file=sys.stderr)
        return 1
    print(f"all {len(rows)} benchmarks within target")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="memlord benchmarks")
    parser.add_argument("--samples", type=int, default=Config.samples, help="samples per case")
    parser.add_argument(
        "--sample-ms", type=float, default=Config.sample_ms, help="length of one sample"
    )
    parser.add_argument("--quick", action="store_true", help="5 samples of 2 ms (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("-k", metavar="SUBSTRING", help="only benchmark modules whose name has it")
    args = parser.parse_args(argv)
    if args.quick:
        cfg = Config(samples=5, sample_ms=2.0, warmup_samples=1)
    else:
        cfg = Config(samples=args.samples, sample_ms=args.sample_ms)
    return cfg, args


def main(rows_fn: Callable[[Config], list[Row]], argv: Sequence[str] | None = None) -> int:
    """Entry point of a benchmark module run on its own."""
    cfg, args = parse_args(argv)
    return report(rows_fn(cfg), cfg, args.json)
