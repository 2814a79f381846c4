"""memlord.retry_on_oom and @memlord.oom_retry (issue 28, item 5), with real OOMs from
torch's CPU allocator.  The reference for "the failed call's frames and tensors die
before the retry" is Python's own weak references, and the contrast is the naive retry
inside the ``except`` block (torch #27600), which keeps them alive.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import memlord
from memlord import MemLord

HUGE = 1 << 50


def test_recovers_with_shrunk_arguments():
    sizes = []

    def step(n):
        sizes.append(n)
        return torch.empty(n)

    got = memlord.retry_on_oom(step, HUGE, backoff=0, shrink=lambda a, k: ((a[0] >> 30,), k))
    assert got.shape == (HUGE >> 30,)
    assert sizes == [HUGE, HUGE >> 30]


def test_the_failed_calls_tensors_die_before_the_retry():
    refs = []
    alive_at_retry = []

    def step(n):
        held = torch.ones(1 << 16)  # the failed call's own tensor
        refs.append(weakref.ref(held))
        if len(refs) > 1:
            alive_at_retry.append(refs[0]() is not None)
        return torch.empty(n) if len(refs) == 1 else held

    memlord.retry_on_oom(step, HUGE, backoff=0)
    assert alive_at_retry == [False]


def test_naive_retry_inside_except_keeps_them():
    """The contrast: retrying inside ``except`` keeps the failed call's frame (and its
    tensor) alive through the exception being handled."""
    refs = []
    alive = []

    def step(n):
        held = torch.ones(1 << 16)
        refs.append(weakref.ref(held))
        if len(refs) > 1:
            alive.append(refs[0]() is not None)
        return torch.empty(n) if len(refs) == 1 else held

    try:
        step(HUGE)
    except RuntimeError:
        gc.collect()
        step(1)
    assert alive == [True]


def test_other_errors_pass_at_once_unchanged():
    calls = []
    boom = ValueError("not memory")

    def step():
        calls.append(1)
        raise boom

    with pytest.raises(ValueError) as info:
        memlord.retry_on_oom(step, attempts=5, backoff=0)
    assert info.value is boom
    assert calls == [1]
    assert not getattr(boom, "__notes__", None)


def test_keyboard_interrupt_is_not_retried():
    calls = []

    def step():
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        memlord.retry_on_oom(step, backoff=0)
    assert calls == [1]


def test_last_error_raised_with_a_note_and_backoff(monkeypatch):
    delays = []
    monkeypatch.setattr(memlord._oom.time, "sleep", delays.append)
    retries = []

    def step():
        return torch.empty(HUGE)

    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        memlord.retry_on_oom(
            step,
            attempts=5,
            backoff=0.5,
            max_backoff=2.0,
            on_retry=lambda attempt, summary: retries.append((attempt, summary)),
        )
    assert delays == [0.5, 1.0, 2.0, 2.0]  # doubling, capped at max_backoff
    assert [a for a, _ in retries] == [1, 2, 3, 4]
    summary = retries[0][1]
    assert summary["device"] == "cpu"
    assert summary["bytes"] == HUGE * 4  # float32: the allocator's own figure
    assert summary["type"] == "RuntimeError"
    assert "can't allocate memory" in summary["message"]
    notes = info.value.__notes__
    assert notes == ["memlord: out of memory on all 5 attempts of retry_on_oom"]
    # the traceback of the last attempt reaches the failing line
    assert info.traceback[-1].name in ("step", "empty")


def test_release_credits_and_collects():
    """Between attempts memlord collects cycles: a tensor held only by a reference cycle
    made by the failed call is freed and credited to a tracking lord before the retry."""
    lord = MemLord()
    seen = []

    class Node:
        pass

    def step():
        if not seen:
            a, b = Node(), Node()
            a.other, b.other = b, a
            a.t = torch.ones(1 << 18)  # 1 MiB in a cycle
            seen.append(lord.allocated("cpu")[0])
            return torch.empty(HUGE)
        seen.append(lord.allocated("cpu")[0])
        return "done"

    gc.collect()
    gc.disable()  # only retry_on_oom collects
    try:
        with lord.hook_into_python():
            assert memlord.retry_on_oom(step, backoff=0) == "done"
    finally:
        gc.enable()
    assert seen[0] - seen[1] == 1 << 20


def test_decorator_forms(monkeypatch):
    monkeypatch.setattr(memlord._oom.time, "sleep", lambda s: None)
    sizes = []

    bare_calls = []

    @memlord.oom_retry
    def bare(n):
        bare_calls.append(n)
        return torch.empty(n if len(bare_calls) > 1 else HUGE)

    @memlord.oom_retry(attempts=2, backoff=0, shrink=lambda a, k: ((), {"n": k["n"] // 2}))
    def called(*, n):
        sizes.append(n)
        return torch.empty(HUGE if n > 4 else n)

    assert called(n=8).shape == (4,)
    assert sizes == [8, 4]
    assert bare(3).shape == (3,)  # the first call fails, the second gets n
    assert bare.__name__ == "bare"
    assert bare_calls == [3, 3]


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: memlord.retry_on_oom(3), TypeError, ["'fn'", "callable", "int"]),
        (lambda: memlord.retry_on_oom(print, attempts=0), ValueError, ["'attempts'", ">= 1"]),
        (lambda: memlord.retry_on_oom(print, attempts="3"), TypeError, ["'attempts'", "str"]),
        (lambda: memlord.retry_on_oom(print, attempts=True), TypeError, ["'attempts'", "bool"]),
        (lambda: memlord.retry_on_oom(print, backoff=-1), ValueError, ["'backoff'", "-1"]),
        (lambda: memlord.retry_on_oom(print, backoff="1"), TypeError, ["'backoff'", "str"]),
        (
            lambda: memlord.retry_on_oom(print, max_backoff=float("nan")),
            ValueError,
            ["'max_backoff'", "nan"],
        ),
        (lambda: memlord.retry_on_oom(print, on_retry=1), TypeError, ["'on_retry'", "int"]),
        (lambda: memlord.retry_on_oom(print, shrink="x"), TypeError, ["'shrink'", "str"]),
        (lambda: memlord.oom_retry(attempts=-1), ValueError, ["oom_retry", "'attempts'"]),
        (lambda: memlord.oom_retry(backoff=[]), TypeError, ["oom_retry", "'backoff'", "list"]),
        (lambda: memlord.oom_retry(3), TypeError, ["oom_retry", "'fn'", "int"]),
    ],
)
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value)


def test_bad_input_runs_nothing():
    calls = []
    with pytest.raises(ValueError):
        memlord.retry_on_oom(lambda: calls.append(1), attempts=0)
    assert calls == []


def test_refcounts_of_arguments():
    arg = object()
    before = sys.getrefcount(arg)
    memlord.retry_on_oom(lambda x: None, arg, backoff=0)
    assert sys.getrefcount(arg) == before


def test_the_note_names_no_post_mortem_of_an_earlier_oom_whose_error_had_the_same_id():
    """The post-mortems a note names are found by the failed error's id (an exception
    takes no weak reference). An earlier OOM's record on this thread, left by an error
    that has since died, must not be taken for a new error that CPython placed at the same
    address with the same message: that named another test's post-mortem in
    test_last_error_raised_with_a_note_and_backoff, now and then, after
    test_watch_oom.py."""
    from memlord import _oom

    error = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    def step():
        raise error

    # what a watched OOM leaves behind, as if its dead error had had this id
    _oom._local.last = (id(error), str(error), ["/elsewhere/memlord-oom-host-1-1.json"])
    with pytest.raises(RuntimeError) as info:
        memlord.retry_on_oom(step, attempts=1, backoff=0)
    assert info.value.__notes__ == ["memlord: out of memory on all 1 attempts of retry_on_oom"]
