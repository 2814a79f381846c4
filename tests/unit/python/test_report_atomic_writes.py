"""Every report is written whole or not at all, by one helper (report._util.atomic_write):
each writer has a temporary file of its own, so concurrent writers of one path, and a
signal handler that writes while a write it interrupted waits, never spoil each other; a
write that fails leaves the file it would have replaced as it was (repro r36)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from support.synthetic import synthetic_profile

from memlord import MemLord
from memlord.report import export, load

HAVE_PLOTLY = True
try:
    import plotly  # noqa: F401
except ImportError:  # pragma: no cover - tox installs the report extra
    HAVE_PLOTLY = False

SUFFIXES = [".json", ".trace.json", ".pickle"] + ([".html"] if HAVE_PLOTLY else [])


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_concurrent_exports_to_one_path_all_succeed(tmp_path, suffix):
    doc = synthetic_profile(3000, steps=2)
    path = tmp_path / f"p{suffix}"
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def exporter() -> None:
        start.wait()
        for _ in range(6 if suffix == ".html" else 15):
            try:
                export(doc, path)
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    threads = [threading.Thread(target=exporter) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left behind
    if suffix == ".json":
        assert len(load(path).events) == len(doc.events)


def test_lord_export_from_two_threads(tmp_path):
    """lord.export(path) from two threads, 20 times each, as the repro does (repro r36)."""
    lord = MemLord()
    lord.record_events(10_000)
    keep = []
    with lord.hook_into_python():  # lifetime tracking: export reads the lord's registry
        for i in range(500):
            with lord.region(f"r{i % 50}"):
                keep.append(torch.empty(10))
        path = tmp_path / "p.json"
        errors: list[BaseException] = []

        def exporter() -> None:
            for _ in range(20):
                try:
                    lord.export(path)
                except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                    errors.append(exc)

        threads = [threading.Thread(target=exporter) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert os.listdir(tmp_path) == ["p.json"]
    assert load(path).metadata


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    from memlord.report._util import atomic_write

    path = tmp_path / "p.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_write(path) as f:
            f.write("new, half")
            raise RuntimeError("mid-write")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["p.json"]
    with atomic_write(path, binary=True) as f:
        f.write(b"\x00new")
    assert path.read_bytes() == b"\x00new"
    assert os.listdir(tmp_path) == ["p.json"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_write_into_a_missing_folder_names_the_file_asked_for(tmp_path, suffix):
    # as open() would: FileNotFoundError, naming the path given (it named the hidden
    # temporary file beside it, a name the caller never wrote)
    path = tmp_path / "missing" / f"p{suffix}"
    with pytest.raises(FileNotFoundError) as info:
        export(synthetic_profile(10, steps=1), path)
    assert info.value.filename == str(path)
    with pytest.raises(FileNotFoundError) as info:
        MemLord().export(str(path))
    assert info.value.filename == str(path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_long_name_the_file_system_takes_is_written(tmp_path, suffix):
    """The temporary name is short enough in bytes: a name of 80 three-byte characters
    (240 bytes, under the file system's 255) is written, as open() would write it."""
    path = tmp_path / ("\u8a18" * 80 + suffix)
    with open(path, "w") as f:  # the file system takes the name
        f.write("x")
    path.unlink()
    export(synthetic_profile(50, steps=1), path)
    assert path.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_written_files_follow_the_umask(tmp_path):
    """The temporary file is made as open() would make the file (not mkstemp's 0600)."""
    from memlord.report._util import atomic_write

    path = tmp_path / "p.json"
    with atomic_write(path) as f:
        f.write("{}")
    old = os.umask(0)
    os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~old


def _open_writes(path, text):
    """The reference: what Python's open() does with the same path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX symlinks and modes")
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_write_through_a_symlink_updates_its_target_as_open_does(tmp_path, suffix):
    """A report written to a symbolic link goes to the link's target (relative, through a
    chain of links, or dangling), atomically; the link stays a link, as with open()."""
    doc = synthetic_profile(200, steps=1)
    for how in ("reference", "memlord"):
        root = tmp_path / how
        (root / "real").mkdir(parents=True)
        (root / "real" / f"target{suffix}").write_text("old")
        (root / f"hop{suffix}").symlink_to(f"real/target{suffix}")  # relative
        (root / f"link{suffix}").symlink_to(root / f"hop{suffix}")  # a chain
        (root / f"dangling{suffix}").symlink_to(f"real/new{suffix}")
        if how == "reference":
            _open_writes(root / f"link{suffix}", "x")
            _open_writes(root / f"dangling{suffix}", "x")
        else:
            export(doc, root / f"link{suffix}")
            export(doc, root / f"dangling{suffix}")
        for name in (f"hop{suffix}", f"link{suffix}", f"dangling{suffix}"):
            assert (root / name).is_symlink(), (how, name)
        assert sorted(os.listdir(root / "real")) == sorted([f"target{suffix}", f"new{suffix}"])
        assert sorted(os.listdir(root)) == sorted(
            ["real", f"hop{suffix}", f"link{suffix}", f"dangling{suffix}"]
        )
    target = tmp_path / "memlord" / "real" / f"target{suffix}"
    assert target.read_bytes() != b"old" and (target.parent / f"new{suffix}").stat().st_size
    if suffix == ".json":
        assert len(load(target).samples) == len(doc.samples)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664, 0o660])
def test_a_rewritten_file_keeps_its_permissions_as_with_open(tmp_path, mode):
    """Writing over an existing file keeps its mode (open() truncates, it does not reset
    the mode); the temporary file takes the mode before the data goes in."""
    doc = synthetic_profile(200, steps=1)
    ref, path = tmp_path / "ref.json", tmp_path / "p.json"
    for p in (ref, path):
        p.write_text("old")
        p.chmod(mode)
    _open_writes(ref, "x")
    export(doc, path)
    assert path.stat().st_mode & 0o7777 == ref.stat().st_mode & 0o7777 == mode
    assert load(path).metadata == load(path).metadata  # a whole file


def test_check_writable(tmp_path):
    from memlord.report._util import check_writable

    check_writable(tmp_path / "new" / "deeper" / "p.json")  # folders made, as writers do
    assert (tmp_path / "new" / "deeper").is_dir()
    assert os.listdir(tmp_path / "new" / "deeper") == []
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        check_writable(tmp_path / "file" / "p.json")  # a file where a folder should be
    with pytest.raises(OSError):
        check_writable(tmp_path / "new")  # a folder


SIGNAL_SCRIPT = """
import json, os, signal, sys, torch
from memlord.profiler import MemoryTracker
out = sys.argv[1]
got = []
# the application's own SIGTERM handler, which returns (the program goes on)
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
tracker = MemoryTracker(out, interval=None, json_path=os.path.join(out, "p.json"),
                        events=1 << 18).start()
keep = [torch.empty(1) for _ in range(120_000)]   # 120,000 events: a long write
print("writing", flush=True)
written = tracker.write()
with open(os.path.join(out, "p.json")) as f:
    events = len(json.load(f)["memlord"]["events"]["columns"]["kind"])
print(json.dumps({"written": [os.path.basename(p) for p in written], "signals": got,
                  "events": events}), flush=True)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_during_the_profilers_write_with_a_handler_that_returns(tmp_path):
    """A real SIGTERM lands while the profiler writes its JSON (its temporary file is
    there); the profiler's handler writes the file, the application's handler returns,
    and the interrupted write goes on: it must succeed and leave one complete file (it
    failed with FileNotFoundError, its temporary file renamed by the handler's write)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SIGNAL_SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        deadline = time.monotonic() + 60
        while not any(n.endswith(".tmp") for n in os.listdir(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "no write seen"
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)  # while the temporary file exists: mid-write
        out_text, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # pragma: no cover - only when an assertion failed
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    result = json.loads(out_text.strip().splitlines()[-1])
    assert result["signals"] == [signal.SIGTERM]  # the application's handler ran
    assert result["written"] == ["p.json"], err  # the interrupted write succeeded
    assert result["events"] >= 120_000
    assert "failed" not in err, err
    assert sorted(os.listdir(out)) == ["p.json"]
