"""Many threads calling allocate/free/queries on one lord keep exact counts.

The long 8 x 50,000 run lives in test_stress.py; these are quick versions that run every time,
plus a re-entrancy case (a finalizer that calls into the lord while it is walking a module).
"""

import gc
import logging
import sys
import threading
import weakref

import numpy as np
import pytest
import torch
from conftest import fake_cuda, scaled
from torch import nn

from memlord import MemLord

JOIN_TIMEOUT_S = 120


@pytest.fixture(autouse=True)
def _fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave threads as often as the interpreter allows
    yield
    sys.setswitchinterval(old)


def run_threads(target, n):
    errors = []
    barrier = threading.Barrier(n)

    def wrap(i):
        try:
            barrier.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "deadlock: threads still running"
    if errors:
        raise errors[0]


def test_concurrent_allocate_free_exact_totals():
    lord = MemLord(auto_gc_bytes=None)
    nthreads, iters = 8, scaled(2000)
    tensors = [torch.empty(i + 1) for i in range(nthreads)]  # 4*(i+1) bytes each

    def work(i):
        t = tensors[i]
        for k in range(iters):
            lord.allocate(t)
            if k % 3 == 0:
                lord.allocated("cpu")
            lord.free(t)

    run_threads(work, nthreads)
    total = iters * sum(4 * (i + 1) for i in range(nthreads))
    s = lord.stats()["cpu"]
    assert s["allocated"] == 0
    assert s["allocated_total"] == s["freed_total"] == s["freed"] == total
    assert s["allocs"] == s["frees"] == nthreads * iters
    assert 0 < s["peak_allocated"] <= sum(4 * (i + 1) for i in range(nthreads))


def test_concurrent_mixed_kinds_and_devices():
    lord = MemLord(auto_gc_bytes=None)
    nthreads, iters = 6, scaled(1000)
    m = nn.Linear(8, 8)  # 288 B
    a = np.zeros(100, dtype=np.uint8)
    fakes = [fake_cuda(10 + i, i % 2) for i in range(nthreads)]

    def work(i):
        for _ in range(iters):
            lord.allocate([m, a[10:], fakes[i]])
            lord.stats()
            lord.top_alloc_site()
            lord.free(m)

    run_threads(work, nthreads)
    s = lord.stats()
    assert s["cpu"]["allocated_total"] == nthreads * iters * (288 + 100)
    assert s["cpu"]["freed_total"] == nthreads * iters * 288
    assert s["cpu"]["allocated"] == nthreads * iters * 100
    for dev in (0, 1):
        want = iters * sum(4 * (10 + i) for i in range(nthreads) if i % 2 == dev)
        assert s[f"cuda:{dev}"]["allocated"] == want
        assert s[f"cuda:{dev}"]["allocs"] == iters * (nthreads // 2)


def test_concurrent_gc_counts_are_exact():
    # Every free on cuda:1 is 400 B and the threshold is 1000 B, so whatever the interleaving,
    # a GC runs on every third free: gc_runs == frees // 3 and freed == (frees % 3) * 400.
    lord = MemLord(auto_gc_bytes=1000)
    nthreads, iters = 4, scaled(1000) + 1
    t = fake_cuda(100, 1)

    def work(i):
        for _ in range(iters):
            lord.free(t)
            lord.freed("cuda:1")

    run_threads(work, nthreads)
    s = lord.stats()["cuda:1"]
    n = nthreads * iters
    assert s["frees"] == n
    assert s["gc_runs"] == n // 3
    assert s["freed"] == (n % 3) * 400
    assert s["freed_total"] == n * 400


def test_concurrent_reset_and_queries_do_not_crash():
    lord = MemLord(auto_gc_bytes=None)
    t = torch.empty(16)
    iters = scaled(1000)

    def work(i):
        for _ in range(iters):
            if i == 0:
                lord.reset()
            else:
                lord.allocate(t)
                lord.free(t)
                repr(lord)
                lord.stats("cpu")

    run_threads(work, 4)
    s = lord.stats().get("cpu")
    if s is not None:
        assert s["allocated"] >= 0 and s["allocated"] % 64 == 0
        assert s["freed"] % 64 == 0


def test_reentrant_finalizer_during_allocate():
    """A weakref callback that calls into the lord runs while allocate walks a module."""
    lord = MemLord(auto_gc_bytes=None)
    side = torch.empty(8)  # 32 B
    calls = []

    class Cycle:
        pass

    def make_garbage():
        c = Cycle()
        c.self = c
        weakref.finalize(c, lambda: (calls.append(1), lord.allocate(side), lord.allocated()))

    m = nn.Sequential(*[nn.Linear(2, 2) for _ in range(50)])
    gc.collect()
    old = gc.get_threshold()
    gc.set_threshold(1)  # collect at nearly every container allocation
    try:
        for _ in range(20):
            make_garbage()
            lord.allocate(m)
            lord.free(m)
    finally:
        gc.set_threshold(*old)
        gc.collect()
    assert calls, "the finalizer never ran"
    s = lord.stats()["cpu"]
    per_m = 50 * 6 * 4
    assert s["allocated_total"] == 20 * per_m + len(calls) * 32
    assert s["allocated"] == len(calls) * 32


def test_reentrant_call_from_debug_log_writer(monkeypatch):
    """A logging handler runs Python code in the middle of allocate's logging; a call back into
    the lord from there must neither deadlock nor corrupt the counts."""
    lord = MemLord(auto_gc_bytes=None)
    side = torch.empty(2)  # 8 B
    state = {"inside": False, "reentered": 0, "text": []}

    class Reenter(logging.Handler):
        def emit(self, record):
            state["text"].append(record.getMessage())
            if not state["inside"]:
                state["inside"] = True
                try:
                    lord.allocate(side)
                    lord.stats()
                    state["reentered"] += 1
                finally:
                    state["inside"] = False

    monkeypatch.setenv("DEBUG", "1")
    handler = Reenter()
    logging.getLogger("memlord").addHandler(handler)
    m = nn.Linear(4, 4)  # 80 B
    try:
        for _ in range(5):
            lord.allocate(m)
    finally:
        logging.getLogger("memlord").removeHandler(handler)
    monkeypatch.delenv("DEBUG")
    assert state["reentered"] > 0
    assert sum(t.startswith("[allocate]") for t in state["text"]) == 5 + state["reentered"]
    s = lord.stats()["cpu"]
    assert s["allocated_total"] == 5 * 80 + state["reentered"] * 8
    assert s["allocs"] == 5 * 2 + state["reentered"]
