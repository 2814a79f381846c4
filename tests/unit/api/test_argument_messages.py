"""Argument checks at the edges of the API: each wrong input is a TypeError or ValueError
(a MemoryError for a ring the machine cannot hold) whose message names the argument, and
nothing changes; a bound hook refuses what torch's own method refuses, with its message
(repro r39).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memlord
from memlord import EVENT_DTYPE, MemLord


@pytest.fixture
def lord():
    lord = MemLord()
    lord.record_events(16)
    with lord.region("step"):
        lord.allocate(torch.empty(4))
    yield lord
    lord.record_events(0)


def _state(lord):
    return (
        lord.events_capacity,
        lord.events().tobytes(),
        lord.events_dropped,
        lord._region_names(),
        lord.stats(),
    )


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda L: L.categories("bogus"), ValueError, ["'device'", "bogus"]),
        (lambda L: L.categories(1.5), TypeError, ["'device'", "float"]),
        (lambda L: L.hook_into_python(ops="yes"), TypeError, ["'ops'", "bool", "str"]),
        (lambda L: L.event_kind(-1), ValueError, ["event_kind", "'code'", "-1"]),
        (
            lambda L: L.event_kind(len(memlord.EVENT_KINDS)),
            ValueError,
            ["event_kind", "'code'", f"between 0 and {len(memlord.EVENT_KINDS) - 1}"],
        ),
        (lambda L: L.event_kind(1.0), TypeError, ["event_kind", "'code'", "float"]),
        (lambda L: L.event_kind(True), TypeError, ["event_kind", "'code'", "bool"]),
        (lambda L: L.event_source(False), TypeError, ["event_source", "'code'", "bool"]),
        (lambda L: L.event_source(-1), ValueError, ["event_source", "'code'", "-1"]),
        (
            lambda L: L.event_source(len(memlord.EVENT_SOURCES)),
            ValueError,
            ["event_source", "'code'", str(len(memlord.EVENT_SOURCES))],
        ),
        (lambda L: L.event_region(-1), ValueError, ["event_region", "'code'", "-1"]),
        (lambda L: L.event_region(2), ValueError, ["event_region", "'code'", "2"]),
        (lambda L: L.event_device(-1), ValueError, ["event_device", "'code'", "-1"]),
        (lambda L: L.event_device(99), ValueError, ["event_device", "'code'", "99"]),
        (lambda L: L.event_device(1), ValueError, ["event_device", "'code'"]),  # "cpu:0"
        (lambda L: L.event_device(2**32), ValueError, ["event_device", "'code'"]),
        (lambda L: L.event_device(63 << 8), ValueError, ["event_device", "'code'"]),
        (lambda L: L.event_site(-1), ValueError, ["event_site", "'code'", "-1"]),
        (lambda L: L.event_site(2**32), ValueError, ["event_site", "'code'"]),
        (
            lambda L: L.events(clear=np.bool_(True)),
            TypeError,
            ["events()", "'clear'", "numpy.bool"],
        ),
        (lambda L: L.snapshot(top=np.int64(3)), TypeError, ["'top'", "numpy.int64"]),
        (
            lambda L: L.decode_events([1, 2]),
            TypeError,
            ["decode_events", "'events'", "EVENT_DTYPE", "list"],
        ),
        (
            lambda L: L.decode_events(np.zeros(3)),
            TypeError,
            ["decode_events", "'events'", "float64"],
        ),
        (lambda L: memlord.fit_memory(L), TypeError, ["fit_memory()", "'step'"]),
        (lambda L: memlord.fit_memory(print, (8,)), ValueError, ["'batch_sizes'", "at least 2"]),
        (lambda L: memlord.fit_memory(print, (2, 2)), ValueError, ["'batch_sizes'", "twice"]),
        (lambda L: memlord.fit_memory(print, (0, 1)), ValueError, ["'batch_sizes'", "positive"]),
        (lambda L: memlord.find_batch_size(print, 0), ValueError, ["'start'", ">= 2"]),
        (lambda L: memlord.LifetimeAnalyzer(L, steps=0), ValueError, ["'steps'", ">= 1"]),
        (lambda L: memlord.LifetimeAnalyzer(L, modules=3), TypeError, ["'modules'", "int"]),
    ],
)
def test_bad_argument_is_named_and_changes_nothing(lord, call, exc, words):
    before = _state(lord)
    with pytest.raises(exc) as info:
        call(lord)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert _state(lord) == before


def test_decoders_still_decode_the_real_codes(lord):
    rec = lord.events()
    assert len(rec) == 1
    assert lord.event_kind(int(rec["kind"][0])) == "alloc"
    assert lord.event_source(int(rec["source"][0])) == "explicit"
    assert lord.event_device(int(rec["device"][0])) == "cpu"
    assert lord.event_region(int(rec["region"][0])) == "step"
    kinds = [lord.event_kind(i) for i in range(len(memlord.EVENT_KINDS))]
    assert kinds == list(memlord.EVENT_KINDS)
    assert lord.decode_events(rec)[0]["region"] == "step"


def test_decode_events_refuses_records_with_codes_out_of_range(lord):
    rec = lord.events().copy()
    bad = rec.copy()
    bad["kind"][0] = 200
    with pytest.raises(ValueError, match=r"decode_events\(\): argument 'events': record 0"):
        lord.decode_events(bad)
    bad = rec.copy()
    bad["device"][0] = 99
    with pytest.raises(ValueError, match=r"record 0 has device 99"):
        lord.decode_events(bad)


def test_snapshot_top_beyond_any_count_means_all():
    lord = MemLord()
    with lord.hook_into_python():
        keep = [torch.empty(n + 1) for n in range(3)]
        for top in (2**63, 2**64, 10**30):
            snap = lord.snapshot(top=top)
            assert len(snap["cpu"]["top"]) == snap["cpu"]["count"] >= 3
        assert len(lord.snapshot(top=2**63, include_untracked=True)["cpu"]["top"]) >= 3
    del keep


def test_export_top_beyond_any_count(tmp_path):
    lord = MemLord()
    with lord.hook_into_python():
        keep = torch.empty(10)
        assert lord.export(tmp_path / "p.json", top=2**63) == "json"
    del keep


def test_record_events_beyond_memory_says_so_and_keeps_the_ring(lord):
    before = _state(lord)
    with pytest.raises(MemoryError) as info:
        lord.record_events(10**12)
    assert "record_events()" in str(info.value) and "'capacity'" in str(info.value)
    assert _state(lord) == before


def test_record_events_allocation_failure_has_a_message(lord):
    """Below the physical-memory check, a failed allocation in C (2**56 records, 2**62
    bytes: more than any 64-bit address space maps, overcommit or not) still names the
    argument and keeps the ring."""
    before = _state(lord)
    with pytest.raises(MemoryError, match=r"record_events\(\): argument 'capacity'"):
        lord._record_events(2**56)
    assert _state(lord) == before


def test_bound_hook_refuses_what_torch_refuses():
    """torch.Tensor.to.__get__(3, int) raises torch's TypeError; under the hooks too, with
    the same message, while binding to tensors (and subclasses) works as before."""
    with pytest.raises(TypeError) as bare:
        torch.Tensor.to.__get__(3, int)
    lord = MemLord()
    with lord.hook_into_torch():
        assert type(torch.Tensor.__dict__["to"]).__name__ == "Hook"
        with pytest.raises(TypeError) as hooked:
            torch.Tensor.to.__get__(3, int)
        assert str(hooked.value) == str(bare.value)
        with pytest.raises(TypeError) as hooked:
            torch.Tensor.half.__get__("x", str)
        assert "doesn't apply to a 'str' object" in str(hooked.value)
        t = torch.empty(2)
        p = torch.nn.Parameter(torch.empty(2))
        assert torch.Tensor.to.__get__(t, torch.Tensor)(torch.float64).dtype == torch.float64
        assert torch.Tensor.to.__get__(p, type(p))(torch.float64).dtype == torch.float64
        assert torch.Tensor.to.__get__(None, torch.Tensor) is torch.Tensor.to
        # Module.to is a Python function: it binds to anything, hooked or not
        assert torch.nn.Module.to.__get__(3, int).__self__ == 3


def test_event_dtype_is_what_events_returns(lord):
    assert lord.events().dtype == EVENT_DTYPE
