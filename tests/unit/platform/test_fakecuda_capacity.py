"""device_memory, "auto" and band decisions from the fake driver's capacity, and what one
deferred move costs in driver calls.

The call ceiling is the test that keeps the event path cheap without a GPU: when the
device's primary context is current already (whenever torch runs on that device), memlord
pushes and pops nothing, and a deferred move on a side stream costs one cuCtxGetCurrent
and one cuEventRecord at the move, one cuCtxGetCurrent and one cuEventQuery at its
credit; on torch's legacy default stream, when the copy is done by the next poll, nothing
at the move and one cuCtxGetCurrent and one cuStreamQuery at its credit.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import fake_cuda
from fakecuda_driver import GIB, stat

from memlord import MemLord, _core

pytestmark = pytest.mark.fakecuda


def _stat(lord, dev, key):
    return lord.stats().get(dev, {}).get(key, 0)


def band(n):
    return {"metric": "allocated", "threshold": {"bytes": n}}


# ---- device_memory -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "total,free",
    [(16 * GIB, 12 * GIB), (80 * GIB, 0), (8 * GIB, 8 * GIB), (12345678901, 1234567890)],
)
def test_device_memory_is_the_drivers(fakecuda, total, free):
    fakecuda.set_memory(0, total, free)
    got = MemLord(auto_gc_bytes=None).device_memory("cuda:0")
    assert got == (total, total - free, (total - free) * 100 / total)
    assert fakecuda.ctx_depth() == 0


def test_device_memory_per_device(fakecuda):
    fakecuda.set_devices(3)
    for i, (total, free) in enumerate([(4 * GIB, GIB), (8 * GIB, 2 * GIB), (2 * GIB, GIB)]):
        fakecuda.set_memory(i, total, free)
    lord = MemLord(auto_gc_bytes=None)
    assert lord.device_memory("cuda:1")[:2] == (8 * GIB, 6 * GIB)
    assert lord.device_memory(torch.device("cuda", 2))[:2] == (2 * GIB, GIB)
    assert lord.device_memory("cuda:0")[:2] == (4 * GIB, 3 * GIB)
    assert lord.device_memory("cuda:3") == (None, None, None)  # the driver has three
    assert _core._cuda_info()["device_count"] == 3


def test_device_memory_may_initialise_the_device(fakecuda):
    """An explicit device_memory() makes the primary context (as torch.cuda.mem_get_info
    does), once for the process."""
    assert not fakecuda.primary_active(0)
    lord = MemLord(auto_gc_bytes=None)
    lord.device_memory("cuda:0")
    MemLord(auto_gc_bytes=None).device_memory("cuda:0")
    assert fakecuda.primary_active(0) and fakecuda.retains(0) == 1


def test_no_devices(fakecuda):
    fakecuda.set_devices(0)
    assert MemLord(auto_gc_bytes=None).device_memory("cuda:0") == (None, None, None)
    assert MemLord("auto").auto_gc_bytes is None
    info = _core._cuda_info()
    assert info["driver"] is True and info["device_count"] == 0 and info["min_total"] == -1


# ---- "auto" ------------------------------------------------------------------------------


@pytest.mark.parametrize("totals", [[16 * GIB], [24 * GIB, 6 * GIB, 80 * GIB], [10**10 + 1]])
def test_auto_is_the_smallest_total_over_three(fakecuda, totals):
    fakecuda.set_devices(len(totals))
    for i, t in enumerate(totals):
        fakecuda.set_memory(i, t, t // 2)
    assert MemLord("auto").auto_gc_bytes == min(totals) // 3
    assert _core._cuda_info()["min_total"] == min(totals)


# ---- bands -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "free,fires_at",
    [(12 * GIB, 100), (6 * GIB, 200), (GIB, 300)],  # 25 %, 62.5 %, 93.75 % used
)
def test_band_from_the_drivers_capacity(fakecuda, free, fires_at):
    fakecuda.set_memory(0, 16 * GIB, free)
    fakecuda.set_primary_active(0, True)
    lord = MemLord(auto_gc_strategy={(0, 50): band(100), (50, 75): band(200), (75, 101): band(300)})
    lord.allocate(fake_cuda(fires_at - 1, dtype=torch.uint8))
    assert _stat(lord, "cuda:0", "gc_runs") == 0
    lord.allocate(fake_cuda(1, dtype=torch.uint8))
    assert _stat(lord, "cuda:0", "gc_runs") == 1


def test_band_decision_never_creates_a_context(fakecuda):
    """Nobody initialised cuda:0: the capacity is unknown for a GC decision (the lowest band,
    on bytes) and no context is made; device_memory() would make one."""
    fakecuda.set_memory(0, 16 * GIB, GIB)  # 93.75 %, were it read
    lord = MemLord(auto_gc_strategy={(0, 50): band(100), (75, 101): band(10_000)})
    lord.allocate(fake_cuda(100, dtype=torch.uint8))
    assert _stat(lord, "cuda:0", "gc_runs") == 1
    assert fakecuda.retains(0) == 0 and not fakecuda.primary_active(0)
    assert fakecuda.calls("cuMemGetInfo_v2") == 0
    assert lord.device_memory("cuda:0")[1] == 15 * GIB
    assert fakecuda.retains(0) == 1


def test_band_percent_threshold_uses_the_drivers_total(fakecuda):
    fakecuda.set_memory(0, 1000, 1000)
    fakecuda.set_primary_active(0, True)
    lord = MemLord(
        auto_gc_strategy={(0, 101): {"metric": "allocated", "threshold": {"percent": 10.0}}}
    )
    lord.allocate(fake_cuda(99, dtype=torch.uint8))
    assert _stat(lord, "cuda:0", "gc_runs") == 0
    lord.allocate(fake_cuda(1, dtype=torch.uint8))  # 100 bytes = 10 % of 1000
    assert _stat(lord, "cuda:0", "gc_runs") == 1


# ---- the event path's cost --------------------------------------------------------------


def _one_deferred_move(fake, hooks, x):
    fake.clear_calls()
    x.to("cpu", non_blocking=True)
    at_move = fake.counts()
    fake.complete()
    fake.clear_calls()
    hooks.poll()
    at_credit = fake.counts()
    assert hooks.pending() == 0
    return at_move, at_credit


@pytest.fixture
def hooks(fake_torch_cuda):
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_torch()
    yield h
    h.disable()


def test_deferred_move_calls_when_the_context_is_current(fakecuda, hooks):
    fakecuda.set_current(0)  # torch runs on cuda:0
    x = fake_cuda(256)
    _one_deferred_move(fakecuda, hooks, x)  # the first loads the driver, makes the event
    at_move, at_credit = _one_deferred_move(fakecuda, hooks, x)
    assert at_move == {"cuCtxGetCurrent": 1, "cuEventRecord": 1}
    assert at_credit == {"cuCtxGetCurrent": 1, "cuEventQuery": 1}
    assert sum(at_move.values()) + sum(at_credit.values()) <= 4  # the ceiling
    fakecuda.set_current(None)


def test_deferred_move_calls_when_no_context_is_current(fakecuda, hooks):
    """On a thread where no context is current, the primary one is pushed and popped around
    each call: balanced, and still bounded."""
    x = fake_cuda(256)
    _one_deferred_move(fakecuda, hooks, x)
    at_move, at_credit = _one_deferred_move(fakecuda, hooks, x)
    for counts in (at_move, at_credit):
        assert counts["cuCtxPushCurrent_v2"] == counts["cuCtxPopCurrent_v2"] == 1
    assert sum(at_move.values()) + sum(at_credit.values()) <= 8
    assert fakecuda.ctx_depth() == 0


def test_another_devices_context_current_is_pushed_over(fakecuda, hooks):
    """cuda:1's context current, a move from cuda:0: cuda:0's is pushed, then popped."""
    fakecuda.set_devices(2)
    fakecuda.set_current(1)
    x = fake_cuda(256, 0)
    at_move, _ = _one_deferred_move(fakecuda, hooks, x)
    assert at_move["cuCtxPushCurrent_v2"] == at_move["cuCtxPopCurrent_v2"] == 1
    assert fakecuda.current_device() == 1
    assert fakecuda.misuse() == 0
    fakecuda.set_current(None)


def _a_thousand_moves(fake, hooks, each=None):
    """1,000 moves on cuda:0 with its context current and every copy done at once, after a
    first one that loads the driver; the fake's calls counted from the second."""
    fake.set_current(0)
    fake.set_auto_complete(True)
    x = fake_cuda(64)
    x.to("cpu", non_blocking=True)
    hooks.poll()
    fake.clear_calls()
    for _ in range(1000):
        x.to("cpu", non_blocking=True)
        if each is not None:
            each()
    hooks.poll()


def test_a_thousand_moves_stay_within_the_ceiling(fakecuda, hooks):
    _a_thousand_moves(fakecuda, hooks)
    assert hooks.pending() == 0
    assert fakecuda.calls() <= 4 * 1000
    assert fakecuda.calls("cuCtxPushCurrent_v2") == 0
    assert fakecuda.calls("cuEventCreate") <= 1
    assert _core._hooks_info()["events_recorded"] == 1001  # one per move on a side stream
    fakecuda.set_current(None)


# ---- the legacy default stream: a free waits on the stream, an event only when it is busy --


@pytest.fixture
def legacy(fake_torch_cuda):
    """torch's default stream as on a GPU: the legacy one, handle 0."""
    fake_torch_cuda.legacy_default()
    return fake_torch_cuda


@pytest.fixture
def lord_hooks(fake_torch_hooks):
    """The torch hooks of conftest's `lord`."""
    return fake_torch_hooks


def test_deferred_move_on_the_default_stream_costs_one_query(fakecuda, legacy, hooks):
    """A copy on the default stream that is done by the next poll costs no event: one
    cuCtxGetCurrent and one cuStreamQuery in all, against four with an event per move."""
    fakecuda.set_current(0)
    x = fake_cuda(256)
    _one_deferred_move(fakecuda, hooks, x)  # the first loads the driver, retains the context
    at_move, at_credit = _one_deferred_move(fakecuda, hooks, x)
    assert at_move == {}
    assert at_credit == {"cuCtxGetCurrent": 1, "cuStreamQuery": 1}
    assert fakecuda.events_created() == 0
    fakecuda.set_current(None)


def test_a_thousand_moves_on_the_default_stream_record_no_event(fakecuda, legacy, hooks):
    """The GPU keeps up (each copy done by the next move, as a 4 KiB copy is on an H100):
    each move asks the stream once, before its own copy is queued, and records nothing."""

    def only_the_last_waits():
        assert hooks.pending() == 256

    _a_thousand_moves(fakecuda, hooks, only_the_last_waits)
    assert hooks.pending() == 0
    assert fakecuda.calls("cuStreamQuery") == 1000
    assert fakecuda.calls() <= 2 * 1000
    assert fakecuda.calls("cuEventRecord") == fakecuda.calls("cuEventCreate") == 0
    assert _core._hooks_info()["events_recorded"] == 0  # memlord's count says the same
    fakecuda.set_current(None)


def test_moves_queued_behind_a_busy_stream_share_an_event(fakecuda, legacy, lord_hooks, lord):
    """The stream stays busy: the first poll records one event for the oldest move; the moves
    after it wait on the stream until a full poll records one more event for all of them."""
    fakecuda.set_current(0)
    x = fake_cuda(64)
    lord.reset()
    for _ in range(100):
        x.to("cpu", non_blocking=True)
    assert lord_hooks.pending() == 100 * 256
    assert fakecuda.calls("cuEventRecord") == 1  # the oldest, at the second move's poll
    lord_hooks.poll()
    assert fakecuda.calls("cuEventRecord") == 2  # one for the other 99
    assert fakecuda.events_incomplete() == 2
    assert lord_hooks.pending() == 100 * 256
    fakecuda.complete()
    lord_hooks.poll()
    assert lord_hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 100 * 256
    assert stat(lord, "cuda:0", "frees") == 100
    info = _core._hooks_info()
    assert info["events_pooled"] == info["events_created"] == 2  # each back once, shared
    fakecuda.set_current(None)


def test_an_event_completing_credits_exactly_the_moves_it_covers(
    fakecuda, legacy, lord_hooks, lord
):
    """Completing the first event's work credits the oldest move and no other."""
    x = fake_cuda(64)
    lord.reset()
    x.to("cpu", non_blocking=True)
    first = fakecuda.record_seq()  # the first copy's place on the stream
    x.to("cpu", non_blocking=True)  # its poll records the event for the first
    x.to("cpu", non_blocking=True)
    fakecuda.complete(upto=first + 1)  # the first copy and the event after it
    lord_hooks.poll()
    assert lord_hooks.pending() == 2 * 256
    assert stat(lord, "cuda:0", "freed_total") == 256
    torch.cuda.synchronize()
    assert lord_hooks.pending() == 0
    assert stat(lord, "cuda:0", "freed_total") == 3 * 256


def test_a_side_stream_still_records_an_event_at_the_move(fakecuda, legacy, hooks):
    """Only the legacy default stream lives as long as the process; any other may be an
    external stream its owner destroys, so it is never asked later: its event is recorded
    at the move."""
    x = fake_cuda(64)
    s = torch.cuda.Stream()
    fakecuda.clear_calls()
    with torch.cuda.stream(s):
        x.to("cpu", non_blocking=True)
    assert fakecuda.calls("cuEventRecord") == 1
    assert fakecuda.calls("cuStreamQuery") == 0
    torch.cuda.synchronize()
    assert hooks.pending() == 0


def test_disable_waits_for_a_busy_default_stream(fakecuda, legacy, lord):
    h = lord.hook_into_torch()
    x = fake_cuda(64)
    lord.reset()
    x.to("cpu", non_blocking=True)
    h.disable()  # records the event the copy needs and waits for it
    assert fakecuda.calls("cuEventRecord") == fakecuda.calls("cuEventSynchronize") == 1
    assert stat(lord, "cuda:0", "freed_total") == 256
    assert h.pending() == 0


def test_second_device_default_stream_is_asked_in_its_context(fakecuda, legacy, lord_hooks, lord):
    fakecuda.set_devices(2)
    fakecuda.set_current(0)
    lord.reset()
    fake_cuda(64, 1).to("cpu", non_blocking=True)
    fakecuda.complete(dev=1)
    fakecuda.clear_calls()
    lord_hooks.poll()
    assert lord_hooks.pending() == 0
    assert fakecuda.counts() == {
        "cuCtxGetCurrent": 1,
        "cuCtxPushCurrent_v2": 1,
        "cuStreamQuery": 1,
        "cuCtxPopCurrent_v2": 1,
    }
    assert fakecuda.current_device() == 0
    assert stat(lord, "cuda:1", "freed_total") == 256
    fakecuda.set_current(None)


# ---- the age rule: a conversion's poll leaves a free queued a moment ago alone -----------


@pytest.fixture
def poll_age():
    """Set the age below which a conversion's poll leaves the oldest free alone."""
    before = _core._testing.pending_poll_age()

    def set_age(ns):
        _core._testing.pending_poll_age(ns)

    yield set_age
    _core._testing.pending_poll_age(before)


def test_the_poll_age_is_50_us_by_default():
    assert _core._testing.pending_poll_age() == 50_000


@pytest.mark.parametrize("stream", ["legacy", "side"])
def test_a_poll_leaves_a_young_free_to_later_polls(fakecuda, fake_torch_cuda, poll_age, stream):
    """Within the age, conversions ask the driver nothing (a copy just queued is not done:
    the question would cost a driver call for nothing); past it, the next one asks once and
    credits what is done."""
    if stream == "legacy":
        fake_torch_cuda.legacy_default()
    poll_age(200_000_000)  # 200 ms: no conversion below comes that late by accident
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch() as h:
        x = fake_cuda(64)
        x.to("cpu", non_blocking=True)
        fakecuda.complete()
        fakecuda.clear_calls()
        for _ in range(10):
            torch.empty(4).half()  # polls, all within the age
        assert fakecuda.calls("cuStreamQuery") == fakecuda.calls("cuEventQuery") == 0
        assert h.pending() == 256
        poll_age(1_000_000)  # 1 ms
        time.sleep(0.005)
        torch.empty(4).half()
        queries = fakecuda.calls("cuStreamQuery") + fakecuda.calls("cuEventQuery")
        assert queries == 1
        assert h.pending() == 0
        assert stat(lord, "cuda:0", "freed_total") == 256


def test_poll_and_synchronize_ask_whatever_the_age(fakecuda, fake_torch_cuda, poll_age):
    fake_torch_cuda.legacy_default()
    poll_age(10_000_000_000)  # 10 s
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch() as h:
        x = fake_cuda(64)
        x.to("cpu", non_blocking=True)
        fakecuda.complete()
        h.poll()
        assert h.pending() == 0
        x.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        assert h.pending() == 0
        x.to("cpu", non_blocking=True)
    assert h.pending() == 0  # disable() waited for the last
    assert stat(lord, "cuda:0", "freed_total") == 3 * 256


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_the_poll_age_refuses_bad_input(bad):
    before = _core._testing.pending_poll_age()
    with pytest.raises(ValueError if bad == -1 else TypeError, match="ns"):
        _core._testing.pending_poll_age(bad)
    assert _core._testing.pending_poll_age() == before


def test_a_cuda_cast_polls_before_its_kernel_is_queued(fakecuda, legacy, lord_hooks, lord):
    """A cast of a CUDA tensor queues a kernel on the default stream: polled after it, a done
    copy's free found the stream busy and recorded an event for nothing; polled before, the
    stream is idle and the free is credited with one query."""
    x = fake_cuda(64)
    lord.reset()
    x.to("cpu", non_blocking=True)
    fakecuda.complete()
    fakecuda.clear_calls()
    y = x.half()  # a cast on "cuda:0": its kernel goes on the stream
    assert y.device == x.device
    assert lord_hooks.pending() == 0
    assert fakecuda.calls("cuEventRecord") == 0
    assert fakecuda.calls("cuStreamQuery") == 1
    assert stat(lord, "cuda:0", "freed_total") == 256
