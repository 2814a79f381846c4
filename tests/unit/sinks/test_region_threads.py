"""Regions and threads: a region left open by a thread that ended does not count the next
thread that gets the same thread ident, and ``ModuleTracker.disable()`` closes the
regions the tracker left open on every thread, not only its own (repros r28, r29)."""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time

import pytest
import torch
from support.ledger import storage_bytes
from torch import nn

from memlord import MemLord


def _exited(th: threading.Thread) -> None:
    """Wait until th's OS thread is gone, not only joined. ``join()`` returns when
    Python's thread state is cleared, before glibc puts the thread's stack back in its
    cache; on Linux the thread's /proc/self/task entry goes after that. Then the first
    thread _thread_reusing starts takes that stack, instead of fresh ones until it is
    back (slow under ASan, whose thread exit does more)."""
    task = f"/proc/self/task/{th.native_id}"
    for _ in range(5000):
        if not os.path.exists(task):
            return
        time.sleep(0.001)


def _thread_reusing(ident: int, target) -> threading.Thread:
    """A thread that got ident and ran target (joined), or the last one tried. glibc
    gives a new thread the stack (and so the ident) its cache got last. A thread that did
    not get ident is held alive until the end, so that the next one takes the next cached
    stack: letting it end put its own stack back on top, and when another thread of the
    process had ended after the dead thread, every try got that one's ident (1 run in 5 in
    the ASan CI job)."""
    release = threading.Event()
    held = []

    def run() -> None:
        if threading.get_ident() == ident:
            target()
        else:
            release.wait()

    try:
        for _ in range(64):
            th = threading.Thread(target=run)
            th.start()
            if th.ident == ident:
                th.join()
                return th
            held.append(th)
        return th
    finally:
        release.set()
        for h in held:
            h.join()


def test_region_of_dead_thread_does_not_count_a_thread_with_the_same_ident() -> None:
    lord = MemLord()
    lord.record_events(1000)
    left_open = []

    def a() -> None:  # leaves a region open, as a suspended generator would
        r = lord.region("thread-A")
        r.__enter__()
        left_open.append(r)

    ta = threading.Thread(target=a)
    ta.start()
    ta.join()
    _exited(ta)
    made = []

    def b() -> None:
        t = torch.empty(1000, dtype=torch.uint8)
        lord.allocate(t)
        made.append(t)

    tb = _thread_reusing(ta.ident, b)
    if sys.platform.startswith("linux"):
        assert tb.ident == ta.ident  # the condition this test is about
    events = [e for e in lord.decode_events(lord.events()) if e["thread"] == tb.ident]
    assert events and events[-1]["kind"] == "alloc"
    assert events[-1]["bytes"] == made[-1].untyped_storage().nbytes()
    assert events[-1]["region"] == ""  # thread B opened no region
    r = left_open[0]
    assert r.open
    r.__exit__(None, None, None)
    assert r.stats == {}  # thread A allocated nothing


def test_lifetime_birth_region_of_a_thread_with_a_reused_ident() -> None:
    lord = MemLord()
    left_open = []

    def a() -> None:
        r = lord.region("thread-A")
        r.__enter__()
        left_open.append(r)

    ta = threading.Thread(target=a)
    ta.start()
    ta.join()
    _exited(ta)
    made = []

    def b() -> None:
        made.append(torch.ones(100))

    with lord.hook_into_python():
        tb = _thread_reusing(ta.ident, b)
        if sys.platform.startswith("linux"):
            assert tb.ident == ta.ident
        snap = lord.snapshot(top=len(made))
    entries = snap["cpu"]["top"]
    assert [e["nbytes"] for e in entries] == [t.untyped_storage().nbytes() for t in made]
    # born in the thread with thread A's ident, which opened no region
    assert [e["region"] for e in entries] == [None] * len(made)
    left_open[0].__exit__(None, None, None)
    assert left_open[0].stats == {}


def test_region_still_counts_its_own_thread() -> None:
    lord = MemLord()
    out = {}

    def work() -> None:
        with lord.region("w") as r:
            t = torch.empty(4096, dtype=torch.uint8)
            lord.allocate(t)
        out["stats"] = r.stats
        out["nbytes"] = t.untyped_storage().nbytes()

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert out["stats"]["cpu"]["delta"] == out["nbytes"] == 4096


def test_disable_closes_backward_regions_left_open_on_another_thread() -> None:
    lord = MemLord()
    lord.record_events(1000)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fail = [True]

    def bad(*_):
        if fail[0]:
            raise RuntimeError("backward failed")

    m[0].register_full_backward_hook(bad)
    jobs: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()

    def worker() -> None:  # a long-lived thread that runs the steps
        while True:
            f = jobs.get()
            if f is None:
                return
            try:
                done.put(f())
            except Exception as exc:  # noqa: BLE001 - handed back to the test
                done.put(exc)

    th = threading.Thread(target=worker)
    th.start()
    try:
        tracker = lord.track_modules(m)
        x = torch.randn(2, 4, requires_grad=True)
        jobs.put(lambda: m(x).sum().backward())
        assert isinstance(done.get(), RuntimeError)
        tracker.disable()  # from this thread
        fail[0] = False
        lord.events(clear=True)
        made = [torch.empty(1000, dtype=torch.uint8)]
        jobs.put(lambda: lord.allocate(made[0]))
        assert done.get() is None
        ev = lord.decode_events(lord.events())
        assert ev[-1]["bytes"] == made[0].untyped_storage().nbytes()
        assert ev[-1]["region"] == ""
        # the regions the failed backward left open were closed, and are counted
        names = tracker.regions()
        assert "0 (backward)" in names
        assert not tracker.enabled
    finally:
        jobs.put(None)
        th.join()


def test_disable_closes_backward_regions_of_a_thread_that_ended() -> None:
    """The thread whose backward failed has ended and the graph is freed: nothing but the
    tracker still knows the regions that backward left open, and ``disable()`` closes
    them (they stayed open for good: the tracker held that thread's spans weakly)."""

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("backward failed")

    class Bad(nn.Module):
        def forward(self, x):
            return Fails.apply(x)

    lord = MemLord()
    m = nn.Sequential(nn.Linear(4, 4), Bad(), nn.Linear(4, 4))
    tracker = lord.track_modules(m)
    got: list = []

    out = [m(torch.randn(2, 4, requires_grad=True)).sum()]  # the forward on this thread

    def step() -> None:  # the backward on another
        try:
            out[0].backward()
        except RuntimeError as exc:
            got.append(str(exc))  # not the exception: its traceback holds the spans

    th = threading.Thread(target=step)
    th.start()
    th.join()
    _exited(th)
    out.clear()  # the graph, and the hooks that held the thread's spans
    gc.collect()
    assert len(got) == 1
    assert "1 (backward)" not in tracker.regions()  # still open
    tracker.disable()
    names = tracker.regions()
    assert {"1 (backward)", "Sequential (backward)"} <= set(names), names


@pytest.mark.parametrize("backward", [True, False])
def test_disable_from_the_same_thread_still_closes_its_regions(backward: bool) -> None:
    lord = MemLord()
    m = nn.Sequential(nn.Linear(4, 4))
    tracker = lord.track_modules(m, backward=backward)
    hook_error = RuntimeError("stop in forward")

    def stop(*_):
        raise hook_error

    h = m[0].register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError):
        m(torch.randn(1, 4))
    h.remove()
    tracker.disable()
    lord.record_events(10)
    lord.allocate(torch.empty(8, dtype=torch.uint8))
    assert lord.decode_events(lord.events())[-1]["region"] == ""


def test_disable_while_a_forward_enters_leaves_no_region_open() -> None:
    """disable() on another thread (or in a finalizer) between a forward's entry hook and
    its span going on the thread's stack: the span it opens is closed at once, so the
    thread's later work is in no region of the tracker's. A trace function stands in for
    the other thread, at the line where the GIL can pass to it."""
    import inspect

    from memlord._regions import ModuleSpans

    lord = MemLord()
    lord.record_events(64)
    model = nn.Linear(4, 4)
    tracker = lord.track_modules(model)
    lines, start = inspect.getsourcelines(ModuleSpans._enter)
    line = start + next(i for i, text in enumerate(lines) if "self._push(stack" in text)
    code = ModuleSpans._enter.__code__
    fired: list[bool] = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(True)
            tracker.disable()
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is code else None)
    try:
        model(torch.randn(2, 4))
    finally:
        sys.settrace(None)
    assert fired == [True]
    assert tracker.regions()["Linear"]["count"] == 1
    lord.events(clear=True)
    t = torch.empty(16, dtype=torch.uint8)
    lord.allocate(t)
    ev = lord.events()
    assert len(ev) == 1
    assert lord.event_region(int(ev["region"][0])) == ""


def _pool_run(workers: int, calls: int = 48) -> tuple[dict, int, int]:
    """track_modules' figures for `calls` forward+backward calls of one model mapped by
    a thread pool of `workers` threads, the lord's CPU ledger after, and the bytes of the
    live storages it should hold (the parameters and the kept outputs), from torch."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    lord = MemLord()
    hp = lord.hook_into_python(ops=True)
    ht = lord.hook_into_torch()
    try:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        tracker = lord.track_modules(model)

        def call(_i: int) -> torch.Tensor:
            x = torch.randn(8, 16, requires_grad=True)
            out = model(x)
            out.sum().backward()
            return out.detach().clone()

        # the parameters' .grad made first, here: which of two concurrent backwards makes
        # a .grad is up to the threads' order, and the bytes are in that one's region
        outs = [call(-1)]
        with ThreadPoolExecutor(workers) as ex:
            outs += ex.map(call, range(calls))
        figures = {
            name: (
                agg["count"],
                {
                    dev: (d["total_delta"], d["max_delta"], d["max_peak_delta"])
                    for dev, d in agg["devices"].items()
                },
            )
            for name, agg in tracker.regions().items()
        }
        tracker.disable()
        model.zero_grad(set_to_none=True)
        gc.collect()
        expected = storage_bytes(*model.parameters(), *outs)
        return figures, int(lord.allocated("cpu")[0]), expected
    finally:
        hp.disable()
        ht.disable()


def test_track_modules_from_a_thread_pool_counts_each_call_as_one_thread_does() -> None:
    """The same model mapped over inputs by 6 threads at once (forward and backward in
    each): every module's regions count each call's own work, as one thread calling it
    does, and the ledger ends at the bytes of the live parameters and outputs."""
    one, ledger_one, expected_one = _pool_run(1)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns inside the hooks, often
    try:
        many, ledger_many, expected_many = _pool_run(6)
    finally:
        sys.setswitchinterval(interval)
    assert ledger_one == expected_one
    assert ledger_many == expected_many == expected_one
    assert many == one
