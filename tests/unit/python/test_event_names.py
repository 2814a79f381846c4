"""Band and event names in one place: what the C core writes equals what Python prints.

* A band in the ``[auto_gc]`` line (written in C, src/core/policy.c) reads as Python
  prints the band (``memlord._config.band_name``: ``repr`` of a float bound, ``33.3``,
  not ``33.299999999999997``).
* The kind and source names the C core puts in the DEBUG log's records equal
  ``memlord.EVENT_KINDS`` / ``EVENT_SOURCES`` at the codes the event ring stores for the
  same events, and the log labels come from ``memlord._events.SOURCE_LABELS``.
"""

from __future__ import annotations

import gc
import logging
import re
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import fake_cuda
from torch import nn

import memlord
from memlord import EVENT_KINDS, EVENT_SOURCES, MemLord, _core
from memlord._config import band_name
from memlord._events import SOURCE_LABELS


class Capacity:
    def __init__(self, total: int, used: int) -> None:
        self.total, self.used = total, used

    def __call__(self, device: str):
        return (self.total, self.used)


BAND = re.compile(r"\[auto_gc\] cuda:0 band=(\[[^)]*\)) ")


@pytest.mark.parametrize(
    "lo,hi",
    [
        (33.3, 66.7),
        (0.1, 50.0),
        (1 / 3, 2 / 3 * 100),
        (50.0, 75.0),
        (0, 50.5),
        (25, 75),
        (1e-7, 100.0),
    ],
)
def test_auto_gc_line_prints_the_band_as_python_does(memlog, lo, hi) -> None:
    strategy = {(lo, hi): {"metric": "allocated", "threshold": {"bytes": 1}}}
    lord = MemLord(auto_gc_strategy=strategy)
    used = (lo + hi) / 2
    lord.set_capacity_source(Capacity(10**9, int(10**9 * used / 100)))
    lord.allocate(fake_cuda(64, 0, dtype=torch.uint8))
    bands = [m.group(1) for m in (BAND.match(r.getMessage()) for r in memlog.records()) if m]
    want = band_name(lo, isinstance(lo, int), hi, isinstance(hi, int))
    assert bands == [want]
    # and the key reads back as the float the strategy holds
    if not isinstance(lo, int):
        assert float(want[1:].split(",")[0]) == lo


@pytest.fixture
def c_records(caplog):
    """The (kind, source) names of every record the C core hands the DEBUG log."""
    got: list[tuple[str, str]] = []

    def on_event(lord, records, subject, what):
        got.extend((r[0], r[1]) for r in records)
        memlord._log._event(lord, records, subject, what)

    caplog.set_level(logging.DEBUG, logger="memlord")
    _core._configure(**{**memlord._CONFIGURE, "log_event": on_event})
    try:
        yield got
    finally:
        _core._configure(**memlord._CONFIGURE)


def test_c_log_names_equal_python_names_for_the_ring_codes(c_records, caplog) -> None:
    lord = MemLord(auto_gc_bytes=1)
    lord.record_events(1000)
    t = torch.ones(16)
    w = torch.empty(8)  # made before the hooks: nothing counts its storage yet
    lord.allocate(t)  # explicit alloc
    lord.free(t)  # explicit free
    with lord.hook_into_torch(), lord.hook_into_python():
        x = torch.zeros(32)  # factory (a tracked storage)
        y = x.to(torch.float16)  # conversion
        p = nn.Parameter(w)  # found (alive before the hooks)
        del x, y, p, w
        gc.collect()  # deaths
        torch.zeros(1)  # a safe point: the deaths' notifications run
    lord.free(fake_cuda(4, 0))  # a free on cuda:0: auto-GC runs (kind gc, in the ring only)
    lord.reset()  # reset
    recs = lord.events()
    codes = zip(recs["kind"].tolist(), recs["source"].tolist(), strict=True)
    ring = Counter((EVENT_KINDS[k], EVENT_SOURCES[s]) for k, s in codes)
    assert ring[("gc", "policy")] >= 1  # the gc code decodes to "gc": the log has no record
    del ring[("gc", "policy")]
    assert Counter(c_records) == ring
    sources = {s for _, s in c_records}
    assert {"explicit", "factory", "convert", "death", "found", "policy"} <= sources
    assert {k for k, _ in c_records} == {"alloc", "free", "reset"}
    # every source the log names has its label, and the lines carry it
    assert set(SOURCE_LABELS) == set(EVENT_SOURCES)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[")]
    for kind, source in set(c_records):
        if kind == "reset":
            assert any(line.startswith("[reset]") for line in lines)
            continue
        tag = "[allocate]" if kind == "alloc" else "[free]"
        label = SOURCE_LABELS[source]
        assert any(line.startswith(tag + label + " ") for line in lines), (
            f"no {tag}{label} line for {kind}/{source}"
        )


@pytest.mark.fakecuda
def test_c_log_names_a_deferred_credit_as_python_does(
    c_records, lord, fake_torch_hooks, fakecuda
) -> None:
    # a non_blocking move off a (fake) CUDA device: its free is credited when the copy's
    # event completes, with source "deferred"
    lord.record_events(100)
    x = fake_cuda(256, 0)
    x.to("cpu", non_blocking=True)
    torch.cuda.synchronize()  # the stand-in completes the event; the credit is emitted
    recs = lord.events()
    codes = zip(recs["kind"].tolist(), recs["source"].tolist(), strict=True)
    ring = Counter((EVENT_KINDS[k], EVENT_SOURCES[s]) for k, s in codes)
    assert ring[("free", "deferred")] == 1
    assert Counter(c_records) == ring


def test_python_names_are_the_c_cores_for_every_code() -> None:
    # memlord's names are _core's tuples themselves (one list in src/core/event.h), and
    # every code the C core can store decodes to a distinct, non-empty name
    assert memlord.EVENT_KINDS is _core.EVENT_KINDS
    assert memlord.EVENT_SOURCES is _core.EVENT_SOURCES
    for names in (_core.EVENT_KINDS, _core.EVENT_SOURCES):
        assert isinstance(names, tuple) and names
        assert all(isinstance(n, str) and n for n in names)
        assert len(set(names)) == len(names)
    assert len(_core.SOURCE_LABELS) == len(_core.EVENT_SOURCES)
    for code, name in enumerate(_core.EVENT_SOURCES):
        label = _core.SOURCE_LABELS[code]
        assert SOURCE_LABELS[name] == (f" {label}" if label else "")
    # the labels the log has always printed, by source (what users grep for)
    assert SOURCE_LABELS == {
        "explicit": "",
        "convert": " (hook)",
        "factory": " (factory)",
        "death": " (del)",
        "deferred": " (hook, deferred)",
        "policy": "",
        "param": " (param)",
        "op": " (op)",
        "grad": " (grad)",
        "load": " (load)",
        "tensor": " (seen)",
        "allocator": " (allocator)",
        "found": " (found)",
    }


def test_the_ring_dtype_holds_every_code() -> None:
    # kind and source are one byte each in a ring record
    assert len(_core.EVENT_KINDS) <= 256 and len(_core.EVENT_SOURCES) <= 256
    assert memlord.EVENT_DTYPE["kind"] == np.dtype("u1")
    assert memlord.EVENT_DTYPE["source"] == np.dtype("u1")
