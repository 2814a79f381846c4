"""Folding closed regions into ``lord.regions()`` is all or nothing: an exception that
arrives in the middle of a fold (a KeyboardInterrupt, a signal handler's error) loses no
closed region and counts none twice, and a ``regions()`` asked in the middle of a fold
(from a signal handler or a finalizer the fold's allocations run) answers with the last
complete fold. A trace function stands in for the signal handler, at a fixed line of the
fold, so the tests are deterministic."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from support.ledger import storage_bytes
from support.tracing import run_at

from memlord import MemLord
from memlord._regions import _Aggregate

KiB = 1024


def _fold_line() -> tuple[Any, int]:
    """The code and line of the fold that reads a closed region's device row (an item is
    then half folded: its count is in, its bytes are not)."""
    for _name, fn in inspect.getmembers(_Aggregate, inspect.isfunction):
        lines, start = inspect.getsourcelines(fn)
        for i, line in enumerate(lines):
            if "dev, net, peak_net = " in line:
                return fn.__code__, start + i
    raise AssertionError("the fold no longer reads dev, net, peak_net")


def _at_fold_line(action: Callable[[], None]) -> Callable[..., Any]:
    """A trace function that runs action once, at the fold's row line."""
    return run_at(*_fold_line(), action)


def _close_regions(lord: MemLord, n: int, keep: list[torch.Tensor]) -> None:
    for _ in range(n):
        with lord.region("step"):
            t = torch.empty(KiB, dtype=torch.uint8)
            lord.allocate(t)
            keep.append(t)


def test_an_exception_in_the_middle_of_a_fold_loses_no_closed_region():
    lord = MemLord()
    keep: list[torch.Tensor] = []
    _close_regions(lord, 10, keep)

    def interrupt() -> None:
        raise KeyboardInterrupt

    sys.settrace(_at_fold_line(interrupt))
    try:
        lord.regions()
        raise AssertionError("the interrupt did not arrive")
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    agg = lord.regions()["step"]
    assert agg["count"] == 10
    assert agg["devices"]["cpu"]["total_delta"] == storage_bytes(*keep) == 10 * KiB
    assert agg["devices"]["cpu"]["max_delta"] == KiB


def test_regions_asked_in_the_middle_of_a_fold_answers_the_last_complete_fold():
    lord = MemLord()
    keep: list[torch.Tensor] = []
    _close_regions(lord, 5, keep)
    assert lord.regions()["step"]["count"] == 5
    _close_regions(lord, 5, keep)
    inner: list[dict[str, Any]] = []
    sys.settrace(_at_fold_line(lambda: inner.append(lord.regions())))
    try:
        outer = lord.regions()
    finally:
        sys.settrace(None)
    assert inner[0]["step"]["count"] == 5
    assert inner[0]["step"]["devices"]["cpu"]["total_delta"] == storage_bytes(*keep[:5])
    assert outer["step"]["count"] == 10
    assert outer["step"]["devices"]["cpu"]["total_delta"] == storage_bytes(*keep)


def test_regions_cleared_in_the_middle_of_a_fold_keeps_the_regions_being_folded():
    """A clear asked in the middle of a fold takes what was folded before; the regions
    the fold was taking in count from then on, none lost and none twice."""
    lord = MemLord()
    keep: list[torch.Tensor] = []
    _close_regions(lord, 4, keep)
    assert lord.regions()["step"]["count"] == 4
    _close_regions(lord, 3, keep)
    inner: list[dict[str, Any]] = []
    sys.settrace(_at_fold_line(lambda: inner.append(lord.regions(clear=True))))
    try:
        outer = lord.regions()
    finally:
        sys.settrace(None)
    assert inner[0]["step"]["count"] == 4
    assert outer["step"]["count"] == 3
    assert outer["step"]["devices"]["cpu"]["total_delta"] == storage_bytes(*keep[4:])
    assert lord.regions()["step"]["count"] == 3
