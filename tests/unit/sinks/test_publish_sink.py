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


def test_a_second_publish_keeps_cooperate_unless_it_says_it():
    """Renaming a cooperating record does not stop it serving requests: a second call
    changes ``cooperate`` only when it passes it."""
    lord = MemLord()
    pub = lord.publish("one", cooperate=True)
    try:
        assert lord.publish("two") is pub
        assert (pub.cooperate, _record(pub)["cooperate"], _record(pub)["name"]) == (
            True,
            True,
            "two",
        )
        lord.publish(cooperate=False)
        assert (pub.cooperate, _record(pub)["cooperate"], _record(pub)["name"]) == (
            False,
            False,
            "two",
        )
    finally:
        pub.disable()
    fresh = lord.publish()  # a new record: not cooperating unless asked
    try:
        assert (fresh.cooperate, _record(fresh)["cooperate"]) == (False, False)
    finally:
        fresh.disable()


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


def test_a_read_never_takes_the_counter_from_the_copy(monkeypatch):
    """The reader's first try reads the record with one pread between two reads of the
    sequence counter. The kernel copies with string instructions, whose loads may be done
    in any order: a copy can hold fields from before a write and the counter from after
    it. Such a copy (the live bytes of state A, the rest of state B, made here from two
    real records) must be refused. The reader once took the counter from the copy and
    returned it (CI: categories 3,072 bytes, live 2,048; about one read in 500,000 under a
    busy writer)."""
    lord = MemLord()
    with lord.publish("unit") as pub:
        lord.allocate(torch.empty(1024, dtype=torch.uint8))
        with open(pub.path, "rb") as f:
            state_a = f.read()
        lord.allocate(torch.empty(1024, dtype=torch.uint8))
        with open(pub.path, "rb") as f:
            state_b = f.read()
        live = _publish.LAYOUT["devs"] + _publish.LAYOUT["dev.live"]  # the cpu's slot
        assert _cpu(_publish.decode(state_a))["live"] == 1024
        assert _cpu(_publish.decode(state_b))["live"] == 2048
        torn = state_b[:live] + state_a[live : live + 8] + state_b[live + 8 :]
        assert _cpu(_publish.decode(torn))["live"] == 1024  # against categories of 2,048

        real_pread = os.pread
        copied = []

        def pread(fd, n, offset):
            """The file as it was (A) until the torn whole-record copy, then as it is (B)."""
            if n == _publish.SIZE and offset == 0 and not copied:
                copied.append(1)
                return torn
            if not copied:
                return state_a[offset : offset + n]
            return real_pread(fd, n, offset)

        monkeypatch.setattr(os, "pread", pread)
        rec = _publish.read_record(pub.path)
        monkeypatch.setattr(os, "pread", real_pread)
        assert copied  # the torn copy was offered
        d = _cpu(rec)
        assert sum(d["categories"].values()) == d["live"] == 2048


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    pid = int(p.stdout)
    assert _publish.proc_start(pid) is None
    return pid


def test_a_half_made_record_left_by_a_dead_process_never_blocks_publishing(rtdir, monkeypatch):
    """A publisher killed between creating its temporary record and renaming it leaves
    `.<pid>-<n>.tmp`. A later process given the same pid (pids are reused) must still
    publish: its own temporary name may be that very file."""
    import itertools

    n = next(_publish._serial)
    monkeypatch.setattr(_publish, "_serial", itertools.count(n))
    rtdir.mkdir(mode=0o700)
    stale = rtdir / f".{os.getpid()}-{n}.tmp"
    stale.write_bytes(b"half made")
    lord = MemLord()
    with lord.publish("after a crash") as pub:
        assert _publish.read_record(pub.path)["name"] == "after a crash"


def test_readers_remove_half_made_records_of_dead_processes(rtdir):
    """What a killed publisher left half made is removed by the next reader, as its whole
    record would be; a live process's is left alone."""
    rtdir.mkdir(mode=0o700)
    dead = rtdir / f".{_dead_pid()}-1.tmp"
    dead.write_bytes(b"half made")
    live = rtdir / f".{os.getpid()}-999999.tmp"
    live.write_bytes(b"being made")
    assert _publish.read_all(rtdir) == []
    assert not dead.exists()
    assert live.exists()
    assert _publish.read_all(rtdir, clean=False) == [] and live.exists()


@pytest.mark.parametrize("left", ["record", "unreadable"])
def test_a_reader_never_removes_the_record_of_a_process_given_the_dead_ones_pid(
    rtdir, monkeypatch, left
):
    """A reader finds a record of a dead process (a whole one, or one it cannot read) and
    removes it; a process given that pid (pids are reused) publishes under the same name.
    If that happens between the reader's judgement and its removal, the live record must
    stay: the reader removes only the file it judged."""
    lord = MemLord()
    with lord.publish("live") as pub:
        mine = pub.path.read_bytes()
        dead = _dead_pid()
        if left == "record":  # the dead process's whole record: its pid in the record
            py = _publish.LAYOUT["py"]
            stale = bytearray(mine)
            stale[py : py + 8] = dead.to_bytes(8, "little", signed=True)
            assert _publish.decode(bytes(stale))["pid"] == dead
        else:
            stale = bytearray(b"torn")
        path = rtdir / f"{dead}-1.rec"
        path.write_bytes(stale)
        real = _publish.proc_start
        reborn = []

        def proc_start(pid):
            # the reader asks whether the pid runs; at that moment the pid's new owner
            # renames its own record into place (the bytes of this process's live one)
            start = real(pid)
            if pid == dead and not reborn:
                tmp = rtdir / f".{dead}-1.tmp"
                tmp.write_bytes(mine)
                os.rename(tmp, path)
                reborn.append(os.stat(path).st_ino)
            return start

        monkeypatch.setattr(_publish, "proc_start", proc_start)
        listed = _publish.read_all(rtdir)
        assert reborn, "the reader never asked about the dead pid"
        assert path.exists() and path.read_bytes() == mine
        assert os.stat(path).st_ino == reborn[0]
        assert [r["name"] for r in listed] == ["live"]
        assert sorted(p.name for p in rtdir.iterdir()) == sorted([path.name, pub.path.name])


def test_a_reader_never_removes_the_half_made_record_of_a_process_given_the_dead_ones_pid(
    rtdir, monkeypatch
):
    """The same for a temporary record: the dead process's `.<pid>-<n>.tmp` is judged,
    and the pid's new owner creates its own under that name before the removal (its
    rename to `.rec` would then fail and its publish() raise)."""
    rtdir.mkdir(mode=0o700)
    dead = _dead_pid()
    tmp = rtdir / f".{dead}-1.tmp"
    tmp.write_bytes(b"half made by the dead one")
    real = _publish.proc_start
    reborn = []

    def proc_start(pid):
        start = real(pid)
        if pid == dead and not reborn:
            new = rtdir / "new"
            new.write_bytes(b"being made by the new one")
            os.rename(new, tmp)
            reborn.append(os.stat(tmp).st_ino)
        return start

    monkeypatch.setattr(_publish, "proc_start", proc_start)
    assert _publish.read_all(rtdir) == []
    assert reborn and tmp.exists() and os.stat(tmp).st_ino == reborn[0]
    assert [p.name for p in rtdir.iterdir()] == [tmp.name]
