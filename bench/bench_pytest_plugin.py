"""The pytest plugin's cost: a suite of 200 trivial tests (tiny tensor ops) run by pytest
in a subprocess with ``--memlord`` against the same suite run bare, alternating, in the
same run of this script; the medians of a few rounds of each and their ratio.

Target: the suite with ``--memlord`` takes at most 1.3x its bare wall time.  Both runs
start a fresh interpreter and import torch (the tests use it), as a CI job would; the
``--memlord`` run also imports memlord and measures every test's call (a lord with both
hooks, a region around the call).  The note gives the extra time per test.

    python bench/bench_pytest_plugin.py [--samples N] [--quick] [--json PATH]

Each round runs pytest twice (a few seconds each), so the rounds are
``min(samples, 5)`` (3 with ``--quick``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import Config, Row, main

N_TESTS = 200
TARGET = 1.3

SUITE = """
import pytest
import torch


@pytest.mark.parametrize("i", range({n}))
def test_tiny(i):
    x = torch.ones(8)
    y = (x + i).sum()
    assert y.item() == 8 * (1 + i)
"""


def _run(folder: Path, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, "."]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    t0 = time.perf_counter_ns()
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter_ns() - t0
    if done.returncode != 0 or f"{N_TESTS} passed" not in done.stdout:
        raise RuntimeError(f"pytest {' '.join(extra)} failed:\n{done.stdout}\n{done.stderr}")
    return float(elapsed)


def rows(cfg: Config) -> list[Row]:
    rounds = 3 if cfg.samples <= 5 else min(cfg.samples, 5)
    with tempfile.TemporaryDirectory(prefix="memlord-bench-pytest-") as tmp:
        folder = Path(tmp)
        (folder / "test_tiny.py").write_text(SUITE.format(n=N_TESTS))
        _run(folder, [])  # warm the file system caches: torch's files, the test file
        bare: list[float] = []
        measured: list[float] = []
        for _ in range(rounds):
            bare.append(_run(folder, []))
            measured.append(_run(folder, ["--memlord"]))
    b, m = statistics.median(bare), statistics.median(measured)
    note = (
        f"{N_TESTS} tests, {rounds} rounds; whole pytest runs: bare {b / 1e9:.2f} s, "
        f"--memlord {m / 1e9:.2f} s, {(m - b) / N_TESTS / 1e3:.0f} us more per test"
    )
    return [
        Row(
            name=f"pytest --memlord, {N_TESTS} trivial tests (wall)",
            median_ns=m,
            floor_name="the same suite without --memlord",
            floor_median_ns=b,
            target=TARGET,
            note=note,
            samples_ns=measured,
            floor_samples_ns=bare,
        )
    ]


if __name__ == "__main__":
    sys.exit(main(rows))
