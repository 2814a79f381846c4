"""Lifetime tracking benchmarks: ``lord.hook_into_python()`` on against off.

memlord follows storages: a tracked tensor's ``torch.UntypedStorage`` object carries a weak
reference (the tracker) whose callback credits the storage's bytes when it dies.

1. ``torch.empty(16)`` created and dropped (one expression statement: the tensor dies at
   once), lifetime hooks on against off in the same run: **target <= 1.5x**. Subject and
   floor run the *same* compiled timing loop, which looks ``torch.empty`` up at every call;
   between samples (outside the timed region) the hooks are enabled (the subject: the
   wrapped factory counts the tensor and tracks its storage, the storage's death credits the
   free through the tracker's callback, call sites on) or disabled (the floor: torch's own
   function, the very object it was before memlord). Samples alternate A/B/B/A..., medians over
   ``max(cfg.samples, 21)`` samples of ~``cfg.sample_ms`` each, the cyclic GC off.
   The row's note gives, from the same run, what the mechanism costs without memlord:
   ``torch.empty(16).untyped_storage()`` (the storage object torch materialises for the
   tracker to watch) and ``weakref.ref(torch.empty(16).untyped_storage(), id)`` (plus a weak
   reference whose C callback runs at the storage's death), each against the bare call.

2. Extra memory per live tracked storage, C allocations plus Python objects: **target <= 192
   bytes**. Measured with tracemalloc (default allocator; memlord's PyMem_* allocations and
   its tracker objects are visible to tracemalloc, torch's C++ allocations are not and are
   the same either way) as

       (traced bytes after creating N = 100,000 ``torch.empty(16)`` under the hooks)
     - (traced bytes after creating the same N tensors without them), divided by N,

   the hooks being disabled again before the measurement is read (the trackers outlive
   disable(); the patch table does not), the median of a few interleaved repetitions. The
   row's figures are **bytes** (shown in the table's time columns): the subject is the
   measured cost, the "floor" is the 192 B budget, so the ratio must be <= 1. It includes
   the Python storage object that tracking makes torch materialise (``t.untyped_storage()``;
   torch keeps it for the storage's lifetime, about 64 B on CPython 3.11): that object is
   what the tracker watches.

   The same figure for tensors tracked by ``lord.allocate(list_of_tensors)`` is reported in
   the row's note, in two parts: (allocate with hooks - nothing) per tensor, the storage
   object part (allocate without hooks does not materialise it: it reads the storage in C),
   and their difference.

3. The ``device_memory()`` cached read is benchmarked in bench/bench_device_memory.py.

    python bench/bench_lifetime.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]

``rows(cfg)`` returns harness ``Row`` objects, as bench/run_all.py expects.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tracemalloc

import torch
from _harness import Case, Config, Row, compare, main, switch_compare

from memlord import MemLord, _core

EMPTY_TARGET = 1.5
BYTES_BUDGET = 192
MIN_SAMPLES = 21
N_TENSORS = 100_000
MEM_REPEATS = 3


def _assert_unhooked() -> None:
    info = _core._hooks_info()
    assert not info["python_installed"], "python hooks already installed by someone else"


# ---------------------------------------------------------------------------- 1. time


def empty_row(cfg: Config) -> Row:
    """torch.empty(16) created and dropped, hooks on (subject) against off (floor)."""
    _assert_unhooked()
    lord = MemLord()  # the defaults: call sites on, auto-GC "auto"
    empty = torch.empty
    case = Case(
        "torch.empty(16) created and dropped", "torch.empty(16)", {"torch": torch}, unroll=20
    )
    on, off = switch_compare(case, lord.hook_into_python, cfg, min_samples=MIN_SAMPLES)
    results = {True: on, False: off}
    assert torch.empty is empty
    # The subject really went through the hooks: every tensor counted, and credited at its
    # death by its tracker, nothing left registered.
    s = lord.stats()["cpu"]
    assert s["allocs"] > 0 and s["allocs"] == s["frees"], s
    assert s["allocated"] == 0 and s["freed_total"] == s["allocated_total"], s
    mech = mechanism_floor(cfg)
    return Row(
        name=f"{case.name} (python hooks)",
        median_ns=statistics.median(results[True]),
        floor_name="hooks off",
        floor_median_ns=statistics.median(results[False]),
        target=EMPTY_TARGET,
        note="factory wrapper + storage object + tracker + (del) credit through the weakref "
        "callback, call sites on. The mechanism alone, without memlord, in this run: "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in mech)
        + " the bare torch.empty(16)",
        samples_ns=results[True],
        floor_samples_ns=results[False],
    )


def mechanism_floor(cfg: Config) -> list[tuple[str, float]]:
    """What following storages costs before memlord does anything: materialising the
    storage's Python object (``untyped_storage()``), then also weak-referencing it with
    a C callback (``id``) that runs at its death, as torch's own mem_tracker does (with a
    Python callback). Each against the bare ``torch.empty(16)``, in alternation."""
    import weakref

    env = {"torch": torch, "ref": weakref.ref}
    bare = Case("torch.empty(16)", "torch.empty(16)", env, unroll=20)
    out = []
    for name, stmt in (
        ("untyped_storage()", "torch.empty(16).untyped_storage()"),
        ("weakref.ref(untyped_storage(), id)", "ref(torch.empty(16).untyped_storage(), id)"),
    ):
        row = compare(Case(name, stmt, env, unroll=20), bare, target=EMPTY_TARGET, cfg=cfg)
        out.append((name, row.ratio))
    return out


# ---------------------------------------------------------------------------- 2. memory


def _traced() -> int:
    return tracemalloc.get_traced_memory()[0]


def _factory_bytes(lord: MemLord, n: int, hooked: bool) -> int:
    """Traced bytes that n live torch.empty(16) tensors (and their list) add."""
    gc.collect()
    before = _traced()
    h = lord.hook_into_python() if hooked else None
    try:
        ts = [torch.empty(16) for _ in range(n)]
    finally:
        if h is not None:
            h.disable()
    after = _traced()
    if hooked:
        assert h.tracked >= n, h.tracked
    del ts
    gc.collect()
    return after - before


def _allocate_bytes(lord: MemLord, n: int, hooked: bool) -> int:
    """Traced bytes that lord.allocate(ts) adds for n fresh, never-accounted tensors."""
    ts = [torch.empty(16) for _ in range(n)]  # made unhooked, storages not materialised
    gc.collect()
    h = lord.hook_into_python() if hooked else None
    try:
        before = _traced()
        lord.allocate(ts)
        if h is not None:
            h.disable()
            h = None
        after = _traced()
    finally:
        if h is not None:
            h.disable()
    lord.free(ts)
    del ts
    gc.collect()
    return after - before


def memory_row(cfg: Config) -> Row:
    _assert_unhooked()
    lord = MemLord(auto_gc_bytes=None)
    repeats = MEM_REPEATS if cfg.samples >= MIN_SAMPLES else 1
    was_tracing = tracemalloc.is_tracing()
    was_enabled = gc.isenabled()
    if not was_tracing:
        tracemalloc.start()
    gc.disable()
    try:
        # warm up: the lord's registry, its call-site tables, torch's caches
        _factory_bytes(lord, 1000, True)
        _factory_bytes(lord, 1000, False)
        _allocate_bytes(lord, 1000, True)
        _allocate_bytes(lord, 1000, False)
        per_factory, per_alloc_total, per_storage = [], [], []
        for i in range(repeats):
            order = (True, False) if i % 2 == 0 else (False, True)
            got = {hooked: _factory_bytes(lord, N_TENSORS, hooked) for hooked in order}
            per_factory.append((got[True] - got[False]) / N_TENSORS)
            got = {hooked: _allocate_bytes(lord, N_TENSORS, hooked) for hooked in order}
            per_alloc_total.append(got[True] / N_TENSORS)
            per_storage.append(got[False] / N_TENSORS)
    finally:
        if not was_tracing:
            tracemalloc.stop()
        if was_enabled:
            gc.enable()
    tracker = statistics.median(per_factory)
    alloc_total = statistics.median(per_alloc_total)
    storage = statistics.median(per_storage)
    note = (
        f"N = {N_TENSORS:,} live torch.empty(16) made under the hooks minus "
        f"the same made without them, per storage (tracemalloc): the storage object torch "
        f"keeps (~64 B), the tracker and its table slot. Via lord.allocate(list): "
        f"{alloc_total:.0f} B per tensor with the hooks, {storage:.0f} B without"
    )
    return Row(
        name="extra memory per live tracked storage",
        median_ns=tracker,
        floor_name="budget",
        floor_median_ns=float(BYTES_BUDGET),
        unit="B",
        target=1.0,
        note=note,
        samples_ns=per_factory,
        floor_samples_ns=[float(BYTES_BUDGET)] * len(per_factory),
    )


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    return [empty_row(cfg), memory_row(cfg)]


if __name__ == "__main__":
    sys.exit(main(rows))
