"""The event ring (lord.record_events, lord.events, events_dropped, the decoders):
records against a hand count, ring overflow, regions and threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import here

import memlord
from memlord import MemLord

KiB = 1024


def u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_not_recording_by_default():
    lord = MemLord()
    lord.allocate(u8(KiB))
    e = lord.events()
    assert e.dtype == memlord.EVENT_DTYPE and len(e) == 0
    assert lord.events_capacity == 0 and lord.events_dropped == 0


def test_events_against_a_hand_count():
    lord = MemLord()
    lord.record_events(16)
    a, b = u8(KiB), u8(3 * KiB)
    lord.allocate(a)
    line_a = here() - 1
    with lord.region("step"):
        lord.allocate((a, b))  # one call, an event per storage: 1 KiB and 3 KiB
        lord.free(a)
    lord.reset()
    e = lord.events()
    assert len(e) == 5
    assert list(e["kind"]) == [0, 0, 0, 1, 3]
    assert [lord.event_kind(k) for k in e["kind"]] == ["alloc", "alloc", "alloc", "free", "reset"]
    assert [lord.event_source(s) for s in e["source"]] == ["explicit"] * 4 + ["policy"]
    assert list(e["bytes"]) == [KiB, KiB, 3 * KiB, KiB, 0]
    assert list(e["count"]) == [1, 1, 1, 1, 0]
    ptr = [t.untyped_storage().data_ptr() for t in (a, a, b, a)]
    assert list(e["address"][:4]) == ptr
    assert [lord.event_device(d) for d in e["device"][:4]] == ["cpu"] * 4
    assert [lord.event_region(r) for r in e["region"]] == ["", "step", "step", "step", ""]
    assert lord.event_site(e["site"][0]).endswith(f"test_event_ring.py:{line_a}")
    assert (np.diff(e["t_ns"]) >= 0).all()
    assert set(e["thread"]) == {threading.get_ident()}
    assert (e["lifetime_ns"] == 0).all()
    decoded = lord.decode_events(e)
    assert decoded[1]["kind"] == "alloc" and decoded[1]["region"] == "step"
    assert decoded[1]["device"] == "cpu" and decoded[1]["bytes"] == KiB
    assert decoded[0]["site"].endswith(f"test_event_ring.py:{line_a}")


def test_hooks_record_their_source():
    lord = MemLord()
    lord.record_events(8)
    x = torch.zeros(256)
    with lord.hook_into_torch():
        x.half()
    with lord.hook_into_python():
        t = torch.ones(16, dtype=torch.uint8)
        del t
    e = lord.events()
    assert [lord.event_source(s) for s in e["source"]] == ["convert", "factory", "death"]
    assert list(e["bytes"]) == [512, 16, 16]
    assert [lord.event_kind(k) for k in e["kind"]] == ["alloc", "alloc", "free"]


def test_ring_overflow_keeps_the_newest_and_counts_the_rest():
    lord = MemLord()
    lord.record_events(5)
    for n in range(1, 13):
        lord.allocate(u8(n))
    e = lord.events()
    assert list(e["bytes"]) == [8, 9, 10, 11, 12]
    assert lord.events_dropped == 7
    assert len(lord.events(clear=True)) == 5
    assert len(lord.events()) == 0
    assert lord.events_dropped == 7  # clearing keeps the count
    lord.allocate(u8(1))
    assert list(lord.events()["bytes"]) == [1]


def test_restart_and_stop():
    lord = MemLord()
    lord.record_events(2)
    lord.allocate(u8(1))
    lord.record_events(3)  # a fresh ring
    assert len(lord.events()) == 0 and lord.events_capacity == 3
    lord.allocate(u8(2))
    lord.record_events(0)
    lord.allocate(u8(3))
    assert len(lord.events()) == 0 and lord.events_capacity == 0


def test_recording_starts_after_any_number_of_other_busy_changes():
    """A lord's sink plan is remade when any sink's busy word changed since it was
    made: a count of changes that wraps a 32-bit counter back to the plan's value
    (2**32 region opens and closes elsewhere while this lord saw no event) must not
    leave the ring unplanned."""
    from memlord import _core

    lord = MemLord()
    lord.allocate(u8(1))  # the plan is made: no ring
    lord.record_events(8)  # one busy change
    _core._testing.busy_epoch(2**32 - 1)  # and 2**32 - 1 more, with no event on this lord
    lord.allocate(u8(2))
    e = lord.events()
    assert list(e["bytes"]) == [2]


def test_events_is_a_copy():
    lord = MemLord()
    lord.record_events(4)
    lord.allocate(u8(7))
    e = lord.events()
    e["bytes"][0] = 99
    assert lord.events()["bytes"][0] == 7


def test_threads_and_their_regions():
    lord = MemLord()
    lord.record_events(1000)
    barrier = threading.Barrier(3)

    def work(i: int) -> None:
        with lord.region(f"t{i}"):
            barrier.wait()
            for _ in range(100):
                lord.allocate(u8(i + 1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    e = lord.events()
    assert len(e) == 300 and lord.events_dropped == 0
    for i in range(3):
        mine = e[e["bytes"] == i + 1]
        assert len(mine) == 100
        assert {lord.event_region(r) for r in mine["region"]} == {f"t{i}"}
        assert len(set(mine["thread"])) == 1


def test_bad_arguments_change_nothing():
    lord = MemLord()
    lord.record_events(3)
    lord.allocate(u8(1))
    with pytest.raises(TypeError, match="'capacity'"):
        lord.record_events(2.0)
    with pytest.raises(TypeError, match="'capacity'"):
        lord.record_events(True)
    with pytest.raises(ValueError, match="'capacity'"):
        lord.record_events(-1)
    with pytest.raises(TypeError, match="'clear'"):
        lord.events(clear=1)
    assert lord.events_capacity == 3 and len(lord.events()) == 1
    with pytest.raises(ValueError, match=r"event_kind\(\): argument 'code'"):
        lord.event_kind(9)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")
def test_device_codes_decode_per_device():
    from conftest import fake_cuda

    lord = MemLord()
    lord.record_events(8)
    lord.allocate((u8(3), fake_cuda(4, 1)))
    e = lord.events()
    assert sorted(lord.event_device(d) for d in e["device"]) == ["cpu", "cuda:1"]
    by_dev = {lord.event_device(d): b for d, b in zip(e["device"], e["bytes"], strict=True)}
    assert by_dev == {"cpu": 3, "cuda:1": 16}
