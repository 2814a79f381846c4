"""The OOM post-mortem of 100,000 live tracked storages: built and written (JSON, HTML and
the memory_viz pickle) in at most 2 s (issue 28).

The live storages: a model of 5,000 ``Linear(16, 16)`` (10,000 parameters) after one
Adam step (10,000 gradients, 30,000 optimizer-state tensors), made under
``lord.hook_into_python(ops=True)``, plus 50,000 ``torch.empty(16)`` kept in a list:
100,000 storages, every one named or sited.  No ``track_modules``: the model and the
optimizer are found the way a post-mortem finds them when nothing told memlord about
them (the optimizer stepped under the hooks; the model by a scan of Python's objects).

Rows (medians of a few repetitions: each case takes a good fraction of a second):

* ``build_post_mortem`` + ``write_post_mortem`` (json, html, pickle) against a fixed
  2 s: target 1x;
* the same against its floor measured in the same run: the reads a post-mortem cannot
  do without (every live storage copied out of the registry, ``lord._live``, and one
  scan of Python's objects for modules, ``_core._gc_objects_of``): target 10x.

    python bench/bench_oom.py [--quick] [--json PATH]
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time

import torch
from _harness import Config, Row, main
from torch import nn

from memlord import MemLord, _core
from memlord.report._postmortem import build_post_mortem, write_post_mortem

LAYERS = 5_000
SCRATCH = 50_000
TARGET_S = 2.0


def _median_s(fn, repeat: int, cpu: list[float] | None = None) -> tuple[float, list[float]]:
    """The median wall time of ``repeat`` runs (and their process CPU times into ``cpu``:
    on a machine shared with other jobs the wall time includes waiting for a core)."""
    times = []
    for _ in range(repeat):
        c0 = time.process_time()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return statistics.median(times), times


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    quick = cfg.samples <= 5
    layers, scratch = (LAYERS // 10, SCRATCH // 10) if quick else (LAYERS, SCRATCH)
    repeat = 1 if quick else 5
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(1, 16)).sum().backward()
        opt.step()
        keep = [torch.empty(16) for _ in range(scratch)]
        request = {"device": "cpu", "bytes": 1 << 52, "what": "torch.empty", "source": "factory"}
        t0 = time.perf_counter()
        doc = build_post_mortem([lord], request)
        with tempfile.TemporaryDirectory() as tmp:
            write_post_mortem(doc, tmp, "first")
        t_first = time.perf_counter() - t0  # the process's first: imports included
        n = doc["devices"]["cpu"]["tracked"]["count"]
        cov = doc["devices"]["cpu"]["coverage"]
        assert n >= 2 * layers * 5 + scratch, n
        assert cov["named"] >= 2 * layers * 5 * 16, cov  # parameters, gradients, state named
        with tempfile.TemporaryDirectory() as tmp:
            count = iter(range(1 << 30))

            def build_and_write() -> None:
                d = build_post_mortem([lord], request)
                paths = write_post_mortem(d, tmp, f"pm-{next(count)}")
                assert len(paths) == 3

            def floor() -> None:
                # the reads a post-mortem cannot do without: every live storage out of the
                # registry, and one scan of Python's objects for the models
                lord._live(-1, -(2**63))
                _core._gc_objects_of(gc.get_objects, nn.Module, ())

            cpu: list[float] = []
            t_all, s_all = _median_s(build_and_write, repeat, cpu)
            t_floor, s_floor = _median_s(floor, repeat)
    del keep, opt, model
    note = f"{n:,} live tracked storages ({layers:,} Linear layers after an Adam step)"
    return [
        Row(
            f"OOM post-mortem built and written, {n:,} storages",
            t_all * 1e9,
            "2 s",
            TARGET_S * 1e9,
            target=1.0,
            note=note + f"; json + html + pickle; CPU time {statistics.median(cpu):.2f} s; "
            f"the process's first took {t_first:.2f} s",
            samples_ns=[x * 1e9 for x in s_all],
        ),
        Row(
            f"OOM post-mortem built and written, {n:,} storages",
            t_all * 1e9,
            "its reads alone: the registry's every storage and one object scan",
            t_floor * 1e9,
            target=10.0,
            note="the floor copies every live storage out of the registry (lord._live) and "
            "scans Python's objects for modules once",
            samples_ns=[x * 1e9 for x in s_all],
            floor_samples_ns=[x * 1e9 for x in s_floor],
        ),
    ]


if __name__ == "__main__":
    sys.exit(main(rows))
