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
* the same against its floor measured in the same run: writing a document of the same
  size without building it (``json.dumps`` of the built document plus ``pickle.dumps``
  of its memory_viz snapshot, the two files' serialisation alone); informational
  target 10x;
* ``build_post_mortem`` alone against ``lord.snapshot(top=20)`` (the registry walk
  that gives the 20 largest, without naming or tables): informational, target 100x.

    python bench/bench_oom.py [--quick] [--json PATH]
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
import tempfile
import time

import torch
from _harness import Config, Row, main
from torch import nn

from memlord import MemLord
from memlord.report._postmortem import build_post_mortem, write_post_mortem

LAYERS = 5_000
SCRATCH = 50_000
TARGET_S = 2.0


def _median_s(fn, repeat: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
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
        doc = build_post_mortem([lord], request)
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
                json.dumps({k: v for k, v in doc.items() if not k.startswith("_")}, indent=1)
                pickle.dumps(doc["_memory_snapshot"], protocol=pickle.HIGHEST_PROTOCOL)

            t_all, s_all = _median_s(build_and_write, repeat)
            t_floor, s_floor = _median_s(floor, repeat)
            t_build, s_build = _median_s(lambda: build_post_mortem([lord], request), repeat)
            t_snap, s_snap = _median_s(lambda: lord.snapshot(top=20), max(repeat, 5))
    del keep, opt, model
    note = f"{n:,} live tracked storages ({layers:,} Linear layers after an Adam step)"
    return [
        Row(
            f"OOM post-mortem built and written, {n:,} storages",
            t_all * 1e9,
            "2 s",
            TARGET_S * 1e9,
            target=1.0,
            note=note + "; json + html + pickle",
            samples_ns=[x * 1e9 for x in s_all],
        ),
        Row(
            f"OOM post-mortem built and written, {n:,} storages",
            t_all * 1e9,
            "json.dumps + pickle.dumps of the same document",
            t_floor * 1e9,
            target=10.0,
            note="the floor serialises the built document and its snapshot, without building",
            samples_ns=[x * 1e9 for x in s_all],
            floor_samples_ns=[x * 1e9 for x in s_floor],
        ),
        Row(
            f"build_post_mortem alone, {n:,} storages",
            t_build * 1e9,
            "lord.snapshot(top=20)",
            t_snap * 1e9,
            target=100.0,
            note="naming (object scan included), tables by category, region, module, site",
            samples_ns=[x * 1e9 for x in s_build],
            floor_samples_ns=[x * 1e9 for x in s_snap],
        ),
    ]


if __name__ == "__main__":
    sys.exit(main(rows))
