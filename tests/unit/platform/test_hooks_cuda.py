"""Torch move hooks on a real GPU: device moves and deferred (non_blocking) frees behind CUDA
events.

Every test is marked `cuda` (two-GPU tests `cuda2`) and the module skips itself without a GPU,
so it is safe to run on its own.  The GPU is kept busy with ``torch.cuda._sleep`` queued on the
stream before a non_blocking copy, so the copy (and the event memlord records after it) cannot
complete until the sleep ends: that is how "still pending" is observed deterministically.
"""

from __future__ import annotations

import gc
import os
import re
import sys

import pytest
import torch
from torch import nn

from memlord import MemLord, _core

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("tensor_abi"),  # both ways of reading tensor metadata
]

CPU = torch.device("cpu")
# ~50-100 ms of GPU time on current parts: far longer than the Python between the copy and
# the assertions, far shorter than a test timeout.
SLEEP_CYCLES = int(2e8)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _stat(lord, dev, key):
    return lord.stats().get(dev, {}).get(key, 0)


def _real_sync():
    """torch.cuda.synchronize without the hook: the events complete, nothing is credited."""
    sync = torch.cuda.synchronize
    getattr(sync, "__wrapped__", sync)()


def _busy(device=None):
    """Queue a long kernel on the current stream of `device` (default: the current one)."""
    if device is None:
        torch.cuda._sleep(SLEEP_CYCLES)
    else:
        with torch.cuda.device(device):
            torch.cuda._sleep(SLEEP_CYCLES)


def _warm_pinned(device="cuda:0", numel=1024):
    """One non_blocking D2H first, so the pinned host allocator has a block cached and the
    timed copy does not call cudaHostAlloc while the stream is busy."""
    x = torch.empty(numel, device=device)
    x.to("cpu", non_blocking=True)
    _real_sync()


@pytest.fixture(autouse=True)
def _clean_device():
    assert not _core._hooks_info()["installed"], "a previous test left hooks installed"
    _warm_pinned()
    yield
    _real_sync()
    leaked = _core._hooks_info()["installed"]
    for obj in gc.get_objects():
        if type(obj).__name__ == "TorchHooks" and obj.enabled:
            obj.disable()
    assert not leaked, "test left hooks installed"


@pytest.fixture
def lord():
    return MemLord(auto_gc_bytes=None)


@pytest.fixture
def hooks(lord):
    h = lord.hook_into_torch()
    yield h
    h.disable()


# --------------------------------------------------------------------------- immediate moves


def test_blocking_cuda_to_cpu_frees_at_once(lord, hooks):
    x = torch.empty(1024, device="cuda:0")
    _busy()
    y = x.to("cpu")  # blocking: returns after the copy
    assert y.device == CPU
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 4096
    assert _stat(lord, "cpu", "allocated_total") == 4096
    assert _core._hooks_info()["pending"] == 0


@pytest.mark.parametrize("call", ["cuda", "to", "to-nb", "cuda-nb"])
def test_cpu_to_cuda_allocates_on_gpu_and_frees_cpu_at_once(lord, hooks, call):
    t = torch.empty(256)
    if call == "cuda":
        out = t.cuda()
    elif call == "to":
        out = t.to("cuda:0")
    elif call == "to-nb":
        out = t.to("cuda:0", non_blocking=True)
    else:
        out = t.cuda(0, True)
    assert out.is_cuda
    assert _stat(lord, "cuda:0", "allocated_total") == 1024
    assert _stat(lord, "cpu", "freed_total") == 1024  # the source is not on CUDA: no event
    assert hooks.pending() == 0


def test_cuda_noop_and_same_device_cast(lord, hooks):
    x = torch.empty(256, device="cuda:0")
    assert x.cuda() is x and x.to("cuda:0") is x and x.to("cuda") is x
    assert lord.stats() == {}
    x.to(torch.float16, non_blocking=True)
    assert _stat(lord, "cuda:0", "allocated_total") == 512
    assert _stat(lord, "cuda:0", "freed_total") == 0
    assert hooks.pending() == 0


def test_tied_weights_moved_once(lord, hooks):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    m.cuda()
    assert m.head.weight is m.emb.weight
    assert _stat(lord, "cuda:0", "allocated_total") == 6400
    assert _stat(lord, "cpu", "freed_total") == 6400
    assert _stat(lord, "cuda:0", "allocs") == 1
    _busy()
    m.to("cpu", non_blocking=True)
    assert hooks.pending("cuda:0") == 6400
    torch.cuda.synchronize()
    assert _stat(lord, "cuda:0", "freed_total") == 6400
    assert _stat(lord, "cuda:0", "frees") == 1


# --------------------------------------------------------------------------- deferred frees


def _deferred_move(lord, hooks, numel=1024):
    """A non_blocking cuda->cpu copy queued behind a sleeping kernel; checks it is pending."""
    x = torch.empty(numel, device="cuda:0")
    lord.reset()
    _busy()
    y = x.to("cpu", non_blocking=True)
    assert y.device == CPU
    n = numel * 4
    assert hooks.pending() == n
    assert hooks.pending("cuda:0") == n
    assert hooks.pending(torch.device("cuda", 0)) == n
    assert hooks.pending("cuda") == n
    assert hooks.pending("cpu") == 0
    assert _stat(lord, "cuda:0", "freed_total") == 0
    assert _stat(lord, "cpu", "allocated_total") == n  # the destination counts at once
    assert _core._hooks_info()["pending"] == 1
    return n


def test_non_blocking_pending_until_synchronize(lord, hooks):
    n = _deferred_move(lord, hooks)
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n
    assert _stat(lord, "cuda:0", "frees") == 1
    assert _core._hooks_info()["pending"] == 0


def test_non_blocking_kwarg_and_positional_forms(lord, hooks):
    x = torch.empty(256, device="cuda:0")
    for call in (
        lambda: x.to("cpu", non_blocking=True),
        lambda: x.to("cpu", None, True),
        lambda: x.to(torch.device("cpu"), torch.float32, True, False),
        lambda: x.to(torch.empty(1), True),
    ):
        _busy()
        call()
        assert hooks.pending("cuda:0") == 1024
        torch.cuda.synchronize()
        assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 4 * 1024


def test_non_blocking_false_is_not_deferred(lord, hooks):
    x = torch.empty(256, device="cuda:0")
    x.to("cpu", non_blocking=False)
    x.to("cpu", torch.float64, False, True)  # copy=True is not non_blocking
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 2048


def test_event_synchronize_credits(lord, hooks):
    n = _deferred_move(lord, hooks)
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n


def test_stream_synchronize_credits(lord, hooks):
    n = _deferred_move(lord, hooks)
    torch.cuda.current_stream().synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n


def test_unrelated_stream_synchronize_does_not_credit(lord, hooks):
    # made first: a process's first Stream() fills torch's stream pool, which took longer
    # than the sleeping kernel on an H100 (torch 2.11, under gVisor), and the copy was done
    other = torch.cuda.Stream()
    n = _deferred_move(lord, hooks)
    other.synchronize()  # idle stream: returns at once, the copy is still queued
    assert hooks.pending() == n
    torch.cuda.synchronize()
    assert hooks.pending() == 0


def test_copy_on_side_stream(lord, hooks):
    x = torch.empty(1024, device="cuda:0")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _busy()
        x.to("cpu", non_blocking=True)
        assert hooks.pending() == 4096
        torch.cuda.current_stream().synchronize()  # s: the stream the copy was issued on
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 4096


def test_poll_credits_after_completion(lord, hooks):
    n = _deferred_move(lord, hooks)
    hooks.poll()  # the kernel is still sleeping
    assert hooks.pending() == n
    _real_sync()  # complete, but nobody has looked yet
    assert hooks.pending() == n
    hooks.poll()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n


def test_next_quiet_conversion_credits(lord, hooks):
    n = _deferred_move(lord, hooks)
    _real_sync()
    assert hooks.pending() == n
    torch.empty(4).half()  # a hooked conversion that queues nothing
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n


def test_disable_credits_what_was_pending(lord):
    h = lord.hook_into_torch()
    n = _deferred_move(lord, h)
    h.disable()  # waits for the copy
    assert _stat(lord, "cuda:0", "freed_total") == n
    assert h.pending() == 0
    info = _core._hooks_info()
    assert info["pending"] == 0 and not info["installed"]


def test_module_to_non_blocking_defers_every_parameter(lord, hooks):
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32)).cuda()
    params = list(m.parameters())
    total = sum(p.nbytes for p in params)
    lord.reset()
    _busy()
    m.to("cpu", non_blocking=True)
    assert all(p.device == CPU for p in params)
    assert hooks.pending("cuda:0") == total
    assert _core._hooks_info()["pending"] == len(params)
    assert _stat(lord, "cuda:0", "freed_total") == 0
    assert _stat(lord, "cpu", "allocated_total") == total
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == total
    assert _stat(lord, "cuda:0", "frees") == len(params)


def test_module_to_blocking_frees_every_parameter_at_once(lord, hooks):
    m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)).cuda()
    total = sum(p.nbytes for p in m.parameters())
    lord.reset()
    m.to("cpu")
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == total


def test_deferred_free_drives_auto_gc():
    lord = MemLord(auto_gc_bytes=4096)
    with lord.hook_into_torch() as h:
        x = torch.empty(2048, device="cuda:0")  # 8 KiB
        dev_before = torch.cuda.current_device()
        _busy()
        x.to("cpu", non_blocking=True)
        assert h.pending() == 8192
        assert _stat(lord, "cuda:0", "gc_runs") == 0
        torch.cuda.synchronize()
        assert _stat(lord, "cuda:0", "gc_runs") == 1
        assert torch.cuda.current_device() == dev_before


def test_deferred_debug_line(lord, hooks, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    x = torch.empty(256, device="cuda:0")
    memlog.text()
    _busy()
    x.to("cpu", non_blocking=True)
    out = ANSI.sub("", memlog.text())
    assert "[allocate] (hook) cpu +1 KiB" in out, out
    assert "[free]" not in out
    torch.cuda.synchronize()
    out = ANSI.sub("", memlog.text())
    assert "[free] (hook, deferred) cuda:0 -1 KiB" in out, out
    assert os.path.basename(__file__) in out  # attributed to the line that made the move


def test_two_lords_share_deferred_frees():
    a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
    ha, hb = a.hook_into_torch(), b.hook_into_torch()
    try:
        x = torch.empty(1024, device="cuda:0")
        a.reset()
        b.reset()
        _busy()
        x.to("cpu", non_blocking=True)
        assert ha.pending() == hb.pending() == 4096
        ha.disable()  # waits, credits a only
        assert _stat(a, "cuda:0", "freed_total") == 4096
        assert _stat(b, "cuda:0", "freed_total") == 0
        assert ha.pending() == 0
        assert hb.pending() == 4096  # b's share waits for b's own poll/sync
        hb.poll()
        assert hb.pending() == 0
        assert _stat(b, "cuda:0", "freed_total") == 4096
        assert _stat(a, "cuda:0", "freed_total") == 4096  # not credited twice
    finally:
        ha.disable()
        hb.disable()


# --------------------------------------------------------------------------- the event pool


def test_event_pool_bounded_with_periodic_sync(hooks):
    created0 = _core._hooks_info()["events_created"]
    x = torch.empty(1024, device="cuda:0")  # 4 KiB
    for i in range(10_000):
        x.to("cpu", non_blocking=True)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    info = _core._hooks_info()
    assert info["events_created"] - created0 <= 100
    assert info["pending"] == 0
    assert info["events_pooled"] == info["events_created"]  # every event went back
    assert hooks.pending() == 0


def test_event_pool_bounded_for_steady_stream(lord, hooks):
    created0 = _core._hooks_info()["events_created"]
    x = torch.empty(1024, device="cuda:0")
    for _ in range(10_000):
        x.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    assert _core._hooks_info()["events_created"] - created0 <= 100
    assert _stat(lord, "cuda:0", "freed_total") == 10_000 * 4096


def test_default_stream_moves_done_by_the_next_one_record_no_event(lord, hooks):
    """torch's default stream is the legacy one: a copy on it that has run by the next move's
    poll needs no event (one stream query instead); on a side stream each move records one."""
    import time

    assert torch.cuda.current_stream().cuda_stream == 0  # what memlord's fast case relies on
    x = torch.empty(1024, device="cuda:0")
    _warm_pinned()
    torch.cuda.synchronize()
    lord.reset()
    r0 = _core._hooks_info()["events_recorded"]
    for _ in range(200):
        x.to("cpu", non_blocking=True)
        time.sleep(0.0002)  # the host's own work between copies: the 4 KiB copy runs meanwhile
    on_default = _core._hooks_info()["events_recorded"] - r0
    torch.cuda.synchronize()
    assert on_default <= 20, on_default  # a slow copy now and then may still need one
    assert _stat(lord, "cuda:0", "freed_total") == 200 * 4096
    s = torch.cuda.Stream()
    r0 = _core._hooks_info()["events_recorded"]
    with torch.cuda.stream(s):
        for _ in range(50):
            x.to("cpu", non_blocking=True)
    assert _core._hooks_info()["events_recorded"] - r0 == 50
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 250 * 4096


def test_queue_hard_cap_keeps_accounting_exact(lord, hooks):
    x = torch.empty(256, device="cuda:0")
    n = 9000  # past the hard cap of 8192 pending entries
    for _ in range(n):
        x.to("cpu", non_blocking=True)
    assert _core._hooks_info()["pending"] <= 8192
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == n * 1024
    assert _stat(lord, "cuda:0", "frees") == n


def test_refcounts_unchanged_over_deferred_moves(lord, hooks):
    x = torch.empty(64, device="cuda:0")
    dev = torch.device("cpu")
    for _ in range(10):
        x.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    before = (
        sys.getrefcount(x),
        sys.getrefcount(dev),
        sys.getrefcount(lord),
        sys.getrefcount(hooks),
    )
    for i in range(2000):
        x.to(dev, non_blocking=True)
        if i % 50 == 0:
            hooks.poll()
    torch.cuda.synchronize()
    after = (
        sys.getrefcount(x),
        sys.getrefcount(dev),
        sys.getrefcount(lord),
        sys.getrefcount(hooks),
    )
    assert after == before


# --------------------------------------------------------------------------- two GPUs


@pytest.mark.cuda2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_deferred_free_on_second_gpu(lord, hooks):
    _warm_pinned("cuda:1")
    x = torch.empty(1024, device="cuda:1")
    lord.reset()
    _busy(1)
    x.to("cpu", non_blocking=True)
    assert hooks.pending("cuda:1") == 4096
    assert hooks.pending("cuda:0") == 0
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:1", "freed_total") == 4096
    assert _stat(lord, "cuda:0", "freed_total") == 0


@pytest.mark.cuda2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_to_gpu_non_blocking(lord, hooks):
    x = torch.empty(1024, device="cuda:0")
    lord.reset()
    _busy(0)
    y = x.to("cuda:1", non_blocking=True)
    assert y.device == torch.device("cuda", 1)
    assert _stat(lord, "cuda:1", "allocated_total") == 4096
    assert hooks.pending("cuda:0") == 4096
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert hooks.pending() == 0
    assert _stat(lord, "cuda:0", "freed_total") == 4096
    assert torch.cuda.current_device() == 0


@pytest.mark.cuda2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_events_pooled_per_device(hooks):
    for dev in ("cuda:0", "cuda:1"):
        x = torch.empty(256, device=dev)
        for _ in range(50):
            x.to("cpu", non_blocking=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    info = _core._hooks_info()
    assert info["pending"] == 0
    assert info["events_pooled"] == info["events_created"]
