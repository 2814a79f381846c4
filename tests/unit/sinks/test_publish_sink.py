"""The publish sink (issue 31, item 1) in one process: the record another process reads
follows the ledger event by event (the ledger's own stats() is the reference: the sink
copies, never computes), Python's fields go through the same sequence counter, and the
record is released when the lord dies or detaches.  The cross-process behaviour is in
tests/integration/test_publish_top.py."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

import memlord
from memlord import MemLord, _publish


@pytest.fixture(autouse=True)
def rtdir(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    monkeypatch.setenv("MEMLORD_RUNTIME_DIR", str(d))
    return d


def _record(pub):
    rec = _publish.read_record(pub.path)
    assert rec is not None
    return rec


def _cpu(rec):
    (d,) = [d for d in rec["devices"] if d["device"] == "cpu"]
    return d


def test_the_record_follows_the_ledger():
    lord = MemLord()
    with lord.publish("unit") as pub:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(24, dtype=torch.uint8)
        with lord.hook_into_python():
            c = torch.empty(3000, dtype=torch.uint8)
            lord.allocate((a, b))
            lord.free(a)
            pub._heartbeat()
            rec = _record(pub)
            s = lord.stats()["cpu"]
            assert (_cpu(rec)["live"], _cpu(rec)["peak"]) == (s["allocated"], s["peak_allocated"])
            assert _cpu(rec)["categories"] == {k: v for k, v in s["categories"].items() if v}
            assert rec["name"] == "unit" and rec["pid"] == os.getpid()
            del c
            gc.collect()
            assert _cpu(_record(pub))["live"] == lord.stats()["cpu"]["allocated"] == 24
            lord.reset()
            assert _cpu(_record(pub))["live"] == 0
    assert not pub.path.exists()
    assert not pub.enabled


def test_a_second_publish_updates_the_same_record():
    lord = MemLord()
    p1 = lord.publish("one")
    p2 = lord.publish("two", cooperate=True)
    try:
        assert p1 is p2
        rec = _record(p1)
        assert (rec["name"], rec["cooperate"]) == ("two", True)
    finally:
        p1.disable()
        p1.disable()  # idempotent


def test_counts_before_publishing_are_in_the_record():
    lord = MemLord()
    lord.allocate(torch.empty(512, dtype=torch.uint8))
    with lord.publish() as pub:
        assert _cpu(_record(pub))["live"] == 512


def test_python_writes_are_bounded_to_pythons_part():
    lord = MemLord()
    with lord.publish():
        lay = memlord._core._publish_layout()
        with pytest.raises(ValueError, match="not Python's"):
            lord._publish_write(lay["seq"], b"\0" * 8)  # the counter is the sink's
        with pytest.raises(ValueError, match="not Python's"):
            lord._publish_write(lay["devs"] + lay["dev.live"], b"\0" * 8)
        with pytest.raises(ValueError, match="not Python's"):
            lord._publish_write(lay["size"] - 4, b"\0" * 8)  # past the end
        lord._publish_write(lay["py"] + lay["py_size"] - 8, b"\0" * 8)  # Python's
    with pytest.raises(RuntimeError, match="not publishing"):
        lord._publish_write(lay["py"], b"\0")


def test_a_buffer_too_small_is_refused():
    lord = MemLord()
    with pytest.raises(ValueError, match="hold"):
        lord._publish_attach(bytearray(64))
    with pytest.raises(BufferError, match="not writable"):
        lord._publish_attach(b"read-only bytes are not writable" * 100)


def test_the_lord_dying_releases_the_mapping_and_the_record(rtdir):
    lord = MemLord()
    pub = lord.publish()
    path = pub.path
    lord.allocate(torch.empty(100, dtype=torch.uint8))
    del lord
    gc.collect()
    # the sink let go of its buffer; the heartbeat thread sees the lord gone and
    # removes the record
    pub._thread.join(timeout=5)
    assert not pub.enabled
    assert not path.exists()
    with pytest.raises(ValueError):
        pub._mm[:1]  # closed


def test_detached_record_is_not_written():
    lord = MemLord()
    mm = mmap.mmap(-1, memlord._core._publish_layout()["size"])
    lord._publish_attach(mm)
    lord.allocate(torch.empty(8, dtype=torch.uint8))
    lord._publish_attach(None)
    before = mm[:]
    lord.allocate(torch.empty(8, dtype=torch.uint8))
    assert mm[:] == before
    mm.close()  # no longer exported
