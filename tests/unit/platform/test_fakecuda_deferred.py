"""Deferred (non_blocking) CUDA frees on the fake driver: what
tests/unit/platform/test_hooks_cuda.py checks on a GPU, on every CPU run.

A ``fake_cuda`` tensor (conftest: CPU memory that reports cuda:<i>) moved to the CPU with
non_blocking=True makes memlord record a CUDA event on the fake; the event stays incomplete
until the test completes it (the stand-ins for torch.cuda.synchronize, Stream.synchronize
and Event.synchronize complete what they would wait for), so "still pending" is
deterministic.  The fixture checks after each test that every context pushed was popped
and that memlord broke no driver rule.
"""

from __future__ import annotations

import gc
import os
import re
import sys

import pytest
import torch
from conftest import fake_cuda
from fakecuda_driver import stat

from memlord import MemLord, _core

pytestmark = [pytest.mark.fakecuda, pytest.mark.usefixtures("tensor_abi")]


# Each test runs twice: with the copies on a side stream (an event recorded at each move)
# and on torch's legacy default stream (handle 0: no event while the stream is idle at the
# next poll; one event, shared, for the moves queued while it is busy).
MODE = {"legacy": False}


@pytest.fixture(params=["side", "legacy"])
def hooks(request, fake_torch_hooks, fake_torch_cuda):
    MODE["legacy"] = request.param == "legacy"
    if MODE["legacy"]:
        fake_torch_cuda.legacy_default()
    yield fake_torch_hooks
    MODE["legacy"] = False


CPU = torch.device("cpu")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _deferred_move(lord, hooks, fake, numel=1024, index=0):
    x = fake_cuda(numel, index)
    lord.reset()
    y = x.to("cpu", non_blocking=True)
    assert y.device == CPU
    n = numel * 4
    dev = f"cuda:{index}"
    assert hooks.pending() == n
    assert hooks.pending(dev) == n
    assert hooks.pending(torch.device("cuda", index)) == n
    assert hooks.pending("cuda") == n
    assert hooks.pending("cpu") == 0
    assert stat(lord, dev, "freed_total") == 0
    assert stat(lord, "cpu", "allocated_total") == n  # the destination counts at once
    assert _core._hooks_info()["pending"] == 1
    if MODE["legacy"]:  # waits on its stream: no event yet
        assert fake.events_incomplete() == 0 and fake.stream_busy(index, 0)
    else:
        assert fake.events_incomplete() == 1
    return n


def test_blocking_move_frees_at_once(lord, hooks, fakecuda):
    fake_cuda(1024).to("cpu")
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 4096
    assert fakecuda.calls("cuEventRecord") == 0


def test_non_blocking_pending_until_synchronize(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    hooks.poll()
    assert hooks.pending() == n  # the event is not complete
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n
    assert stat(lord, "cuda:0", "frees") == 1
    assert _core._hooks_info()["pending"] == 0


def test_non_blocking_kwarg_and_positional_forms(lord, hooks, fakecuda):
    x = fake_cuda(256)
    for call in (
        lambda: x.to("cpu", non_blocking=True),
        lambda: x.to("cpu", None, True),
        lambda: x.to(torch.device("cpu"), torch.float32, True, False),
        lambda: x.to(device="cpu", non_blocking=True),
    ):
        call()
        assert hooks.pending("cuda:0") == 1024
        torch.cuda.synchronize()
        assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 4 * 1024


def test_non_blocking_false_is_not_deferred(lord, hooks, fakecuda):
    x = fake_cuda(256)
    x.to("cpu", non_blocking=False)
    x.to("cpu", torch.float64, False, True)  # copy=True is not non_blocking
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 2048
    assert fakecuda.calls("cuEventRecord") == 0


def test_event_synchronize_credits(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n


def test_event_recorded_before_the_move_does_not_credit(lord, hooks, fakecuda):
    ev = torch.cuda.Event()
    ev.record()
    n = _deferred_move(lord, hooks, fakecuda)
    ev.synchronize()  # waits for what came before the move only
    assert hooks.pending() == n
    torch.cuda.synchronize()
    assert hooks.pending() == 0


def test_stream_synchronize_credits(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    torch.cuda.current_stream().synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n


def test_unrelated_stream_synchronize_does_not_credit(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    torch.cuda.Stream().synchronize()
    assert hooks.pending() == n
    torch.cuda.synchronize()
    assert hooks.pending() == 0


def test_copy_on_side_stream(lord, hooks, fakecuda, fake_torch_cuda):
    x = fake_cuda(1024)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.to("cpu", non_blocking=True)
        assert hooks.pending() == 4096
        torch.cuda.Stream().synchronize()  # another stream: the copy's event is on s
        assert hooks.pending() == 4096
        torch.cuda.current_stream().synchronize()  # s
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 4096


def test_poll_credits_after_completion(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    hooks.poll()
    assert hooks.pending() == n
    fakecuda.complete()  # complete, but nobody has looked yet
    assert hooks.pending() == n
    hooks.poll()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n


def test_next_quiet_conversion_credits(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    fakecuda.complete()
    assert hooks.pending() == n
    torch.empty(4).half()  # a hooked conversion that queues nothing
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n


def test_quiet_conversion_leaves_an_incomplete_event_pending(lord, hooks, fakecuda):
    n = _deferred_move(lord, hooks, fakecuda)
    torch.empty(4).half()
    assert hooks.pending() == n
    torch.cuda.synchronize()
    assert hooks.pending() == 0


def test_disable_credits_what_was_pending(lord, fake_torch_cuda, fakecuda):
    h = lord.hook_into_torch()
    n = _deferred_move(lord, h, fakecuda)
    waits = fakecuda.calls("cuEventSynchronize")
    h.disable()  # waits for the copy
    assert fakecuda.calls("cuEventSynchronize") == waits + 1
    assert stat(lord, "cuda:0", "freed_total") == n
    assert h.pending() == 0
    info = _core._hooks_info()
    assert info["pending"] == 0 and not info["installed"]


def test_module_to_non_blocking_defers_every_buffer(lord, hooks, fakecuda):
    """Module.to(non_blocking=True) passes the flag to each tensor's move (buffers here: a
    Parameter cannot be a fake_cuda tensor)."""
    m = torch.nn.Module()
    sizes = (256, 64, 1000)
    for i, numel in enumerate(sizes):
        m.register_buffer(f"b{i}", fake_cuda(numel))
    total = sum(sizes) * 4
    lord.reset()
    m.to("cpu", non_blocking=True)
    assert all(b.device == CPU for b in m.buffers())
    assert hooks.pending("cuda:0") == total
    assert _core._hooks_info()["pending"] == len(sizes)
    # on the legacy stream, the first buffer's event is recorded at the second's poll and
    # the later ones wait on the stream
    assert fakecuda.events_incomplete() == (1 if MODE["legacy"] else len(sizes))
    assert stat(lord, "cuda:0", "freed_total") == 0
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == total
    assert stat(lord, "cuda:0", "frees") == len(sizes)


def test_module_to_blocking_frees_every_buffer_at_once(lord, hooks, fakecuda):
    m = torch.nn.Module()
    m.register_buffer("a", fake_cuda(100))
    m.register_buffer("b", fake_cuda(28))
    lord.reset()
    m.to("cpu")
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 512
    assert fakecuda.calls("cuEventRecord") == 0


def test_deferred_free_drives_auto_gc(fake_torch_cuda, fakecuda):
    lord = MemLord(auto_gc_bytes=4096)
    with lord.hook_into_torch() as h:
        fake_cuda(2048).to("cpu", non_blocking=True)  # 8 KiB
        assert h.pending() == 8192
        assert stat(lord, "cuda:0", "gc_runs") == 0
        torch.cuda.synchronize()
        assert stat(lord, "cuda:0", "gc_runs") == 1


def test_deferred_debug_line(lord, hooks, fakecuda, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    x = fake_cuda(256)
    memlog.text()
    x.to("cpu", non_blocking=True)
    out = ANSI.sub("", memlog.text())
    assert "[allocate] (hook) cpu +1 KiB" in out, out
    assert "[free]" not in out
    torch.cuda.synchronize()
    out = ANSI.sub("", memlog.text())
    assert "[free] (hook, deferred) cuda:0 -1 KiB" in out, out
    assert os.path.basename(__file__) in out  # attributed to the line that made the move


def test_two_lords_share_deferred_frees(fake_torch_cuda, fakecuda):
    a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
    ha, hb = a.hook_into_torch(), b.hook_into_torch()
    try:
        x = fake_cuda(1024)
        a.reset()
        b.reset()
        x.to("cpu", non_blocking=True)
        assert ha.pending() == hb.pending() == 4096
        ha.disable()  # waits, credits a only
        assert stat(a, "cuda:0", "freed_total") == 4096
        assert stat(b, "cuda:0", "freed_total") == 0
        assert hb.pending() == 4096  # b's share waits for b's own poll/sync
        hb.poll()
        assert hb.pending() == 0
        assert stat(b, "cuda:0", "freed_total") == 4096
        assert stat(a, "cuda:0", "freed_total") == 4096  # not credited twice
    finally:
        ha.disable()
        hb.disable()


# ---- the event pool and the queue --------------------------------------------------------


def test_event_pool_bounded_with_periodic_sync(hooks, fakecuda):
    x = fake_cuda(1024)
    for i in range(2000):
        x.to("cpu", non_blocking=True)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    info = _core._hooks_info()
    assert info["events_created"] <= 100
    assert info["events_created"] == fakecuda.events_created()
    assert info["pending"] == 0
    assert info["events_pooled"] == info["events_created"]  # every event went back
    assert hooks.pending() == 0


def test_event_pool_bounded_for_steady_stream(lord, hooks, fakecuda):
    fakecuda.set_auto_complete(True)  # the GPU keeps up: each copy is done by the next move
    x = fake_cuda(1024)
    for _ in range(2000):
        x.to("cpu", non_blocking=True)
    assert fakecuda.events_created() <= 2
    torch.cuda.synchronize()
    assert stat(lord, "cuda:0", "freed_total") == 2000 * 4096


def test_queue_hard_cap_keeps_accounting_exact(lord, hooks, fakecuda):
    x = fake_cuda(256)
    n = 8192 + 100  # past the hard cap of 8192 pending entries
    for _ in range(n):
        x.to("cpu", non_blocking=True)
    info = _core._hooks_info()
    assert info["pending"] <= 8192
    # the cap waits for the oldest (on the legacy stream, an event shared by many)
    assert fakecuda.calls("cuEventSynchronize") >= (1 if MODE["legacy"] else 100)
    assert info["events_created"] <= 8193
    assert stat(lord, "cuda:0", "freed_total") == (n - info["pending"]) * 1024
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == n * 1024
    assert stat(lord, "cuda:0", "frees") == n


def test_refcounts_unchanged_over_deferred_moves(lord, hooks, fakecuda):
    x = fake_cuda(64)
    dev = torch.device("cpu")
    for _ in range(10):
        x.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    gc.collect()
    before = (sys.getrefcount(x), sys.getrefcount(dev), sys.getrefcount(lord))
    for i in range(500):
        x.to(dev, non_blocking=True)
        if i % 50 == 0:
            hooks.poll()
    torch.cuda.synchronize()
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(dev), sys.getrefcount(lord)) == before


# ---- several devices --------------------------------------------------------------------


def test_deferred_free_on_second_device(lord, hooks, fakecuda):
    fakecuda.set_devices(2)
    fakecuda.set_current(0)  # torch runs on cuda:0
    n = _deferred_move(lord, hooks, fakecuda, index=1)
    assert hooks.pending("cuda:0") == 0
    torch.cuda.synchronize(0)
    assert hooks.pending("cuda:1") == n
    torch.cuda.synchronize(1)
    assert hooks.pending() == 0
    assert stat(lord, "cuda:1", "freed_total") == n
    assert stat(lord, "cuda:0", "freed_total") == 0
    assert fakecuda.current_device() == 0  # cuda:1's context was pushed and popped
    assert fakecuda.calls("cuCtxPushCurrent_v2") == fakecuda.calls("cuCtxPopCurrent_v2") > 0
    fakecuda.set_current(None)


def test_events_pooled_per_device(hooks, fakecuda):
    fakecuda.set_devices(2)
    for index in (0, 1):
        x = fake_cuda(256, index)
        for _ in range(20):
            x.to("cpu", non_blocking=True)
    assert hooks.pending("cuda:0") == hooks.pending("cuda:1") == 20 * 1024
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    info = _core._hooks_info()
    assert info["pending"] == 0
    assert info["events_pooled"] == info["events_created"] == fakecuda.events_created()


def test_device_beyond_the_driver_credits_at_once(lord, hooks, fakecuda):
    """A tensor on an index the driver does not have: no event, credited at once."""
    fake_cuda(256, 3).to("cpu", non_blocking=True)
    assert hooks.pending() == 0
    assert stat(lord, "cuda:3", "freed_total") == 1024
    assert fakecuda.calls("cuEventRecord") == 0


def test_threads_moving_concurrently_are_exact(lord, hooks, fakecuda):
    """Each thread pushes and pops on its own context stack (the fake checks every pop has
    its push); the ledger is exact once everything completed."""
    import threading

    nthreads, moves = 4, 200
    errors = []

    def work():
        try:
            x = fake_cuda(128)
            for i in range(moves):
                x.to("cpu", non_blocking=True)
                if i % 50 == 49:
                    hooks.poll()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == nthreads * moves * 512
    assert stat(lord, "cuda:0", "frees") == nthreads * moves
    assert fakecuda.calls("cuCtxPushCurrent_v2") == fakecuda.calls("cuCtxPopCurrent_v2")


# ---- the testing aids themselves ---------------------------------------------------------


def test_standin_source_must_be_callable(fakecuda):
    with pytest.raises(TypeError, match="argument 'source' must be callable or None"):
        _core._testing.cuda_standin(42)


def test_standin_refused_while_hooks_are_installed(hooks):
    with pytest.raises(RuntimeError, match="disable them first"):
        _core._testing.cuda_standin(None)


def test_driver_switch_refused_while_frees_wait(lord, hooks, fakecuda):
    fake_cuda(64).to("cpu", non_blocking=True)
    with pytest.raises(RuntimeError, match="waiting for CUDA events"):
        _core._testing.cuda_driver(None)
    assert _core._cuda_info()["library"] == fakecuda.path  # unchanged
    torch.cuda.synchronize()
