"""Every CUDA driver failure on the fake driver: a deferred move whose event cannot be made is
credited at once, an event that cannot be queried or waited for counts as done, a capacity
that cannot be read is unknown; nothing leaks (every event goes back to the pool), nothing
raises into the caller, every context pushed is popped."""

from __future__ import annotations

import ctypes

import pytest
import torch
from conftest import fake_cuda
from fakecuda_driver import (
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_OUT_OF_MEMORY,
    GIB,
    stat,
)

from memlord import MemLord, _core

pytestmark = pytest.mark.fakecuda


@pytest.fixture
def hooks(fake_torch_hooks):
    return fake_torch_hooks


def _no_leak(fake):
    info = _core._hooks_info()
    assert info["pending"] == 0
    assert info["events_pooled"] == info["events_created"]
    assert fake.ctx_depth() == 0


# Entry points a deferred move calls before its event is recorded: any one failing, the free
# is credited at once.  cuCtxGetCurrent failing only costs the push it would have saved.
RECORD_PATH = [
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuEventCreate",
    "cuEventRecord",
]


@pytest.mark.parametrize("entry", RECORD_PATH)
def test_record_failure_credits_at_once(lord, hooks, fakecuda, entry):
    fakecuda.fail(entry, CUDA_ERROR_LAUNCH_FAILED)
    y = fake_cuda(1024).to("cpu", non_blocking=True)
    assert y.device == torch.device("cpu")
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 4096
    assert fakecuda.events_incomplete() == 0
    _no_leak(fakecuda)


@pytest.mark.parametrize("entry", RECORD_PATH)
def test_transient_record_failure_then_deferred_again(lord, hooks, fakecuda, entry):
    """One failed call, then the next move is deferred as usual (the driver stays loaded)."""
    fakecuda.fail(entry, CUDA_ERROR_OUT_OF_MEMORY, times=1)
    x = fake_cuda(256)
    x.to("cpu", non_blocking=True)
    assert hooks.pending() == 0
    x.to("cpu", non_blocking=True)
    assert hooks.pending() == 1024
    torch.cuda.synchronize()
    assert stat(lord, "cuda:0", "freed_total") == 2048
    _no_leak(fakecuda)


def test_get_current_failure_pushes_instead(lord, hooks, fakecuda):
    fakecuda.set_current(0)
    fakecuda.fail("cuCtxGetCurrent", CUDA_ERROR_INVALID_CONTEXT)
    fake_cuda(256).to("cpu", non_blocking=True)
    assert hooks.pending() == 1024
    assert fakecuda.calls("cuCtxPushCurrent_v2") == fakecuda.calls("cuCtxPopCurrent_v2") >= 1
    torch.cuda.synchronize()
    assert hooks.pending() == 0
    _no_leak(fakecuda)
    fakecuda.set_current(None)


def test_query_failure_counts_as_done(lord, hooks, fakecuda):
    """An event that cannot be queried is never waited on forever: its free is credited."""
    fake_cuda(256).to("cpu", non_blocking=True)
    fakecuda.fail("cuEventQuery", CUDA_ERROR_LAUNCH_FAILED)
    hooks.poll()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 1024
    _no_leak(fakecuda)


def test_query_failure_at_the_next_conversion(lord, hooks, fakecuda):
    fake_cuda(256).to("cpu", non_blocking=True)
    fakecuda.fail("cuEventQuery", CUDA_ERROR_LAUNCH_FAILED, times=1)
    torch.empty(2).half()
    assert hooks.pending() == 0
    _no_leak(fakecuda)


def test_query_push_failure_counts_as_done(lord, hooks, fakecuda):
    fake_cuda(256).to("cpu", non_blocking=True)
    fakecuda.fail("cuCtxPushCurrent_v2", CUDA_ERROR_INVALID_CONTEXT)
    hooks.poll()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 1024
    _no_leak(fakecuda)


@pytest.mark.parametrize("stream", ["side", "legacy"])
def test_wait_failure_at_disable_still_credits(lord, fake_torch_cuda, fakecuda, stream):
    """On a side stream the move's event cannot be waited for; on the legacy default stream
    the event recorded for the wait cannot."""
    if stream == "legacy":
        fake_torch_cuda.legacy_default()
    h = lord.hook_into_torch()
    fake_cuda(256).to("cpu", non_blocking=True)
    fakecuda.fail("cuEventSynchronize", CUDA_ERROR_LAUNCH_FAILED)
    h.disable()
    assert h.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 1024
    _no_leak(fakecuda)


def test_wait_failure_at_the_queue_cap(lord, hooks, fakecuda):
    fakecuda.fail("cuEventSynchronize", CUDA_ERROR_LAUNCH_FAILED)
    x = fake_cuda(64)
    n = 8192 + 5
    for _ in range(n):
        x.to("cpu", non_blocking=True)
    assert _core._hooks_info()["pending"] <= 8192
    fakecuda.heal()
    torch.cuda.synchronize()
    assert stat(lord, "cuda:0", "freed_total") == n * 256
    _no_leak(fakecuda)


def test_pop_failure_raises_nothing(lord, hooks, fakecuda):
    """A pop the driver refuses leaves the context pushed (memlord cannot undo that); the
    move is still accounted and nothing raises."""
    fakecuda.fail("cuCtxPopCurrent_v2", CUDA_ERROR_INVALID_CONTEXT, times=1)
    fake_cuda(256).to("cpu", non_blocking=True)
    assert hooks.pending() == 1024
    assert fakecuda.ctx_depth() == 1
    ctx = ctypes.c_void_p()
    assert fakecuda.lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)) == 0  # the test undoes it
    torch.cuda.synchronize()
    _no_leak(fakecuda)


# ---- capacity ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry", ["cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent_v2", "cuMemGetInfo_v2"]
)
def test_device_memory_failure_is_unknown(lord, fakecuda, entry):
    fakecuda.fail(entry, CUDA_ERROR_LAUNCH_FAILED)
    assert lord.device_memory("cuda:0") == (None, None, None)
    assert fakecuda.ctx_depth() == 0


@pytest.mark.parametrize("entry", ["cuDeviceGetCount", "cuDeviceGet", "cuDeviceTotalMem_v2"])
def test_auto_without_a_total_is_none(fakecuda, entry):
    fakecuda.fail(entry, CUDA_ERROR_LAUNCH_FAILED)
    assert MemLord("auto").auto_gc_bytes is None


def test_auto_skips_a_device_that_fails(fakecuda):
    fakecuda.set_devices(2)
    fakecuda.set_memory(0, 4 * GIB, GIB)
    fakecuda.set_memory(1, 8 * GIB, GIB)
    fakecuda.fail("cuDeviceTotalMem_v2", CUDA_ERROR_LAUNCH_FAILED, times=1)  # cuda:0's read
    assert MemLord("auto").auto_gc_bytes == 8 * GIB // 3


def test_band_read_failure_falls_back_to_the_lowest_band(fakecuda):
    fakecuda.set_primary_active(0, True)
    fakecuda.set_memory(0, 16 * GIB, GIB)  # 93.75 % used, if it could be read
    fakecuda.fail("cuMemGetInfo_v2", CUDA_ERROR_LAUNCH_FAILED)

    def band(n):
        return {"metric": "allocated", "threshold": {"bytes": n}}

    lord = MemLord(auto_gc_strategy={(0, 50): band(100), (50, 101): band(10_000)})
    lord.allocate(fake_cuda(100, dtype=torch.uint8))
    assert stat(lord, "cuda:0", "gc_runs") == 1  # unknown capacity: the lowest band
    assert fakecuda.ctx_depth() == 0


def test_primary_state_failure_reads_unknown_for_bands(fakecuda):
    fakecuda.fail("cuDevicePrimaryCtxGetState", CUDA_ERROR_LAUNCH_FAILED)
    lord = MemLord(auto_gc_strategy={(50, 101): {"metric": "allocated", "threshold": {"bytes": 1}}})
    lord.allocate(fake_cuda(100, dtype=torch.uint8))
    assert stat(lord, "cuda:0", "gc_runs") == 1  # lowest band, bytes
    assert fakecuda.retains(0) == 0  # a GC decision never creates a context


# ---- the legacy default stream (a free waits on the stream until it is busy at a poll) ----


@pytest.fixture
def legacy(fake_torch_cuda):
    fake_torch_cuda.legacy_default()
    return fake_torch_cuda


def test_stream_query_failure_counts_as_done(lord, legacy, hooks, fakecuda):
    fake_cuda(256).to("cpu", non_blocking=True)
    assert hooks.pending() == 1024
    fakecuda.fail("cuStreamQuery", CUDA_ERROR_LAUNCH_FAILED)
    hooks.poll()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 1024
    assert fakecuda.calls("cuEventRecord") == 0
    _no_leak(fakecuda)


@pytest.mark.parametrize("entry", ["cuEventCreate", "cuEventRecord"])
def test_no_event_for_a_busy_stream_credits_at_that_poll(lord, legacy, hooks, fakecuda, entry):
    """The stream is busy and no event can be recorded to wait on: the free is credited at
    that poll, as a move whose event cannot be made is at the move."""
    fakecuda.fail(entry, CUDA_ERROR_OUT_OF_MEMORY)
    x = fake_cuda(256)
    x.to("cpu", non_blocking=True)
    x.to("cpu", non_blocking=True)  # its poll finds the first busy, and no event
    assert hooks.pending() == 1024  # the second waits
    assert stat(lord, "cuda:0", "freed_total") == 1024
    hooks.poll()
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 2048
    _no_leak(fakecuda)


def test_context_failure_at_the_move_credits_at_once(lord, legacy, hooks, fakecuda):
    """The device's context cannot be retained: nothing could ask its stream later."""
    fakecuda.fail("cuDevicePrimaryCtxRetain", CUDA_ERROR_LAUNCH_FAILED)
    fake_cuda(256).to("cpu", non_blocking=True)
    assert hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 1024
    _no_leak(fakecuda)
