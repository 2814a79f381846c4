"""memlord's Python locks that code run from a finalizer or a signal handler can take
again on the same thread are re-entrant: a finalizer (run by a garbage collection that
any allocation can start) that calls ``ModuleTracker.disable()`` while its thread
registers its spans, or ``memory_checkpoint()`` while the thread makes the disabled
profiler, does not hang its thread. A trace function stands in for the finalizer, at the
line where it could run, so the tests are deterministic."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from support.tracing import line_of, run_at
from torch import nn

from memlord import MemLord, profiler
from memlord._regions import ModuleSpans

HANG_S = 20  # far beyond the milliseconds the call takes: only a deadlock reaches it


def _run_at(fn: Callable[..., Any], needle: str, action: Callable[[], None]) -> Callable[..., Any]:
    """A trace function that runs action once, at fn's line holding needle."""
    return run_at(*line_of(fn, needle), action)


def _in_thread(body: Callable[[], None]) -> list[BaseException]:
    """Run body on a new daemon thread under the caller's checks: the errors it raised,
    and a failure if it is still running after HANG_S."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
        finally:
            sys.settrace(None)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(HANG_S)
    assert not th.is_alive(), "the thread deadlocked on a lock it already holds"
    return errors


def test_tracker_disabled_by_a_finalizer_while_its_thread_registers_does_not_hang():
    lord = MemLord()
    model = nn.Linear(4, 4)
    tracker = lord.track_modules(model)
    tracer = _run_at(ModuleSpans._push, "self._stacks.add", tracker.disable)

    def body() -> None:
        sys.settrace(tracer)
        model(torch.randn(2, 4))

    assert _in_thread(body) == []
    assert tracer.fired == [True]  # type: ignore[attr-defined]
    assert not tracker.enabled


def test_memory_checkpoint_from_a_finalizer_while_the_disabled_profiler_is_made():
    previous = profiler._tracker
    profiler._tracker = None
    seen: list[object] = []
    tracer = _run_at(
        profiler.get_memory_tracker,
        "MemoryTracker(enabled=False)",
        lambda: seen.append(profiler.memory_checkpoint("in a finalizer")),
    )

    def body() -> None:
        sys.settrace(tracer)
        tracker = profiler.get_memory_tracker()
        assert not tracker.enabled
        assert profiler.get_memory_tracker() is tracker

    try:
        assert _in_thread(body) == []
    finally:
        profiler._tracker = previous
    assert seen == [None]  # no tracker runs: memory_checkpoint() says so
