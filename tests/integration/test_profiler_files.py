"""The memory profiler's files: default names no two trackers share, in one process or
in several; paths fixed where the tracker was made, whatever the program's later
os.chdir; a forked child writes nothing over its parent's profile, and a tracker it
starts itself writes a file of its own.  Real processes where processes matter
(repros r32, r35)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memlord.profiler import MemoryTracker, initialize_memory_tracker, stop_memory_tracker
from memlord.report import load


@pytest.fixture(autouse=True)
def _no_global_tracker():
    stop_memory_tracker()
    yield
    stop_memory_tracker()


def test_trackers_started_in_one_second_have_their_own_files(tmp_path):
    """Trackers started within the same second get a file each, whether made directly or
    through initialize_memory_tracker; neither overwrites the other (repro r35)."""
    names = set()
    for _ in range(20):  # whatever the clock does, pairs of these start within a second
        tracker = MemoryTracker(tmp_path, interval=None, enabled=True)
        names.add(tracker.json_path())
    assert len(names) == 20
    initialize_memory_tracker(tmp_path / "two", interval=None, title="first run", events=0)
    initialize_memory_tracker(tmp_path / "two", interval=None, title="second run", events=0)
    stop_memory_tracker()
    files = sorted((tmp_path / "two").iterdir())
    titles = {json.loads(p.read_text())["metadata"]["title"] for p in files}
    assert titles == {"first run", "second run"}
    pid = os.getpid()
    assert all(f"_{pid}_" in p.name for p in files), files


PROCESS_SCRIPT = """
import os, sys, time
from memlord.profiler import initialize_memory_tracker, stop_memory_tracker
out, go = sys.argv[1], sys.argv[2]
initialize_memory_tracker(out, interval=None, events=0, title=str(os.getpid()))
while not os.path.exists(go):        # every process writes at the same moment
    time.sleep(0.001)
print(stop_memory_tracker(), flush=True)
"""


def test_processes_writing_at_once_have_their_own_files(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(PROCESS_SCRIPT))
    out, go = tmp_path / "out", tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(out), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    go.write_text("")
    pids = set()
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        pids.add(str(proc.pid))
    titles = {json.loads(p.read_text())["metadata"]["title"] for p in out.iterdir()}
    assert titles == pids


def test_relative_paths_are_fixed_when_the_tracker_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = MemoryTracker(
        "profiles",
        interval=None,
        exports=["p.trace.json"],
        install_handlers=False,
        events=0,
    ).start()
    (tmp_path / "elsewhere").mkdir()
    os.chdir(tmp_path / "elsewhere")  # the program moves; its reports do not
    written = tracker.stop()
    assert [p.parent for p in written] == [tmp_path / "profiles", tmp_path]
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert (tmp_path / "p.trace.json").exists()
    assert len(list((tmp_path / "profiles").iterdir())) == 1


def test_bad_paths_are_refused_when_the_tracker_is_made(tmp_path):
    with pytest.raises(ValueError, match="json_path"):
        MemoryTracker(tmp_path, json_path=tmp_path / "p.trace.json")
    with pytest.raises(ValueError, match="unknown report format"):
        MemoryTracker(tmp_path, json_path=tmp_path / "p.txt")
    with pytest.raises(ValueError, match="unknown report format"):
        MemoryTracker(tmp_path, exports=[tmp_path / "p.csv"])
    with pytest.raises(TypeError, match="exports"):
        MemoryTracker(tmp_path, exports=str(tmp_path / "p.pickle"))
    with pytest.raises(TypeError, match="exports"):
        MemoryTracker(tmp_path, exports=[3])


FORK_SCRIPT = """
import json, os, sys, time, torch
from memlord.profiler import MemoryTracker, initialize_memory_tracker, stop_memory_tracker
out = sys.argv[1]
initialize_memory_tracker(out, interval=0.05, json_path=os.path.join(out, "p.json"))
keep = torch.zeros(1 << 16)
first = os.fork()
if first == 0:
    # a tracker of the child's own writes a file of its own
    own = MemoryTracker(out, interval=None, events=0, title="child", install_handlers=False)
    own.start()
    child_only = torch.zeros(1 << 10)
    own.stop()
    time.sleep(0.3)
    sys.exit(0)                     # at exit, the inherited tracker writes nothing
second = os.fork()
if second == 0:
    time.sleep(0.3)
    assert stop_memory_tracker() is None   # stopped in the child: nothing written
    sys.exit(0)
stop_memory_tracker()
codes = [os.waitpid(c, 0)[1] for c in (first, second)]  # they end after the parent wrote
print(json.dumps({"parent": os.getpid(), "child": first, "codes": codes}), flush=True)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_writes_nothing_over_its_parents_profile(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(FORK_SCRIPT))
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    pids = json.loads(r.stdout.strip().splitlines()[-1])
    assert pids["codes"] == [0, 0], r.stderr
    doc = load(out / "p.json")
    assert doc.metadata["pid"] == pids["parent"]
    assert doc.counters["cpu"]["allocated"] == 4 << 16
    (own,) = [p for p in out.iterdir() if p.name != "p.json"]
    assert f"_{pids['child']}_" in own.name
    assert load(own).metadata["title"] == "child"
    assert load(own).metadata["pid"] == pids["child"]
