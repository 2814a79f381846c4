"""python -m memlord run writes its reports once, where asked, with the program's end in
them (real processes): only the process that started the run writes; relative paths are
those of the directory run started in; non-daemon threads are waited for; a wrong output
is refused before the script runs; the final snapshot sees the script's globals, and
nothing is blamed on runpy (repros r32, r33, r34, r37)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from memlord.report import load


def _run(cwd, script_text, *options, name="s.py"):
    (cwd / name).write_text(textwrap.dedent(script_text))
    return subprocess.run(
        [sys.executable, "-m", "memlord", "run", "--interval", "0", *options, name],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _wrote(stderr):
    return [line for line in stderr.splitlines() if line.startswith("memlord: wrote")]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_writes_nothing(tmp_path):
    """A forked child that ends after its parent writes no report over the parent's.
    (capture_output waits for the child too: it holds the pipes until it exits.) (repro r32)"""
    r = _run(
        tmp_path,
        """
        import os, sys, time, torch
        big = torch.zeros(1 << 20)
        pid = os.fork()
        if pid == 0:
            child_only = torch.zeros(1 << 10)
            time.sleep(0.5)      # the child ends after the parent
            sys.exit(0)
        print(os.getpid(), flush=True)
        """,
        "--json",
        "report.json",
    )
    assert r.returncode == 0, r.stderr
    assert _wrote(r.stderr) == ["memlord: wrote report.json"]
    doc = load(tmp_path / "report.json")
    assert doc.metadata["pid"] == int(r.stdout.split()[-1])
    assert doc.counters["cpu"]["allocated"] == 4 << 20


def test_relative_outputs_are_where_run_started(tmp_path):
    """Relative outputs land where run started, whatever os.chdir the script makes
    (repro r33)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _run(
        tmp_path,
        f"""
        import os, torch
        x = torch.zeros(1000)
        os.chdir({str(elsewhere)!r})
        """,
        "--json",
        "out.json",
        "--trace",
        "sub/out.trace.json",
    )
    assert r.returncode == 0, r.stderr
    assert _wrote(r.stderr) == ["memlord: wrote out.json", "memlord: wrote sub/out.trace.json"]
    assert (tmp_path / "out.json").is_file() and (tmp_path / "sub" / "out.trace.json").is_file()
    assert list(elsewhere.iterdir()) == []


def test_the_default_profile_is_where_run_started(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = _run(tmp_path, f"import os, torch\nx = torch.zeros(10)\nos.chdir({str(elsewhere)!r})\n")
    assert r.returncode == 0, r.stderr
    (path,) = tmp_path.glob("memory_profile_*.json")
    assert _wrote(r.stderr) == [f"memlord: wrote {path.name}"]
    assert list(elsewhere.iterdir()) == []


def test_non_daemon_threads_are_waited_for(tmp_path):
    """The report waits for the script's non-daemon threads: it holds all 20 allocations,
    not only those made before the main body returned (repro r34)."""
    r = _run(
        tmp_path,
        """
        import threading, time, torch
        keep = []
        def work():
            for i in range(20):
                keep.append(torch.zeros(1 << 16)); time.sleep(0.02)
        threading.Thread(target=work).start()     # non-daemon
        """,
        "--json",
        "t.json",
    )
    assert r.returncode == 0, r.stderr
    doc = load(tmp_path / "t.json")
    ev = doc.events
    sites = ev.decode("site")
    kinds = ev.decode("kind")
    worker = [i for i in range(len(ev)) if kinds[i] == "alloc" and sites[i] == "s.py:6"]
    assert len(worker) == 20
    assert doc.counters["cpu"]["allocated"] == 20 * (4 << 16)


def test_exit_handlers_of_the_script_run_before_the_report(tmp_path):
    """As atexit sees the program: the script's own exit handlers have run."""
    r = _run(
        tmp_path,
        """
        import atexit, torch
        keep = []
        atexit.register(lambda: keep.append(torch.zeros(1 << 12)))
        """,
        "--json",
        "p.json",
    )
    assert r.returncode == 0, r.stderr
    assert load(tmp_path / "p.json").counters["cpu"]["allocated"] == 4 << 12


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ("--json", "out.txt"),
        ("--trace", "out.json"),
        ("--html", "out.htm1"),
    ],
)
def test_a_wrong_output_name_is_refused_before_the_script_runs(tmp_path, option, name):
    """A wrong output name is one line and exit status 2 before the script runs, not a
    traceback after it ran (repro r37)."""
    r = _run(tmp_path, "print('script ran')\n", option, name)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"memlord: {option} {name}: "), r.stderr
    assert "must end in" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.py"]


def test_an_unwritable_output_is_refused_before_the_script_runs(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir.json").mkdir()
    for option, name in (
        ("--json", "afile/out.json"),  # a file where a folder should be
        ("--json", "adir.json"),  # a folder
        ("--pickle", "afile/x/out.pickle"),
    ):
        r = _run(tmp_path, "print('script ran')\n", option, name)
        assert r.returncode == 2
        assert r.stdout == ""
        lines = r.stderr.splitlines()
        assert len(lines) == 1, r.stderr
        assert lines[0].startswith(f"memlord: {option} {name}: cannot be written: "), lines


def test_the_final_snapshot_sees_the_scripts_globals(tmp_path):
    """The final snapshot is taken before the script's globals are dropped: the bytes still
    held at the end, the largest tensors, the pickle's blocks with their frames, and no
    frees blamed on `<frozen runpy>`."""
    r = _run(
        tmp_path,
        """
        import torch
        keep = [torch.empty(1024) for _ in range(4)]
        big = torch.zeros(1 << 20)
        """,
        "--json",
        "p.json",
        "--pickle",
        "p.pickle",
    )
    assert r.returncode == 0, r.stderr
    doc = load(tmp_path / "p.json")
    assert doc.counters["cpu"]["allocated"] == 4 * 4096 + (4 << 20)
    last = doc.snapshots[-1]
    assert last["checkpoint_name"] == "stop"
    shapes = [t["shape"] for t in last["device_breakdown"]["cpu"]["tensors"]]
    assert shapes[0] == [1 << 20] and shapes.count([1024]) == 4
    assert not [h for h in doc.hotspots if "runpy" in h["site"]], doc.hotspots
    assert not [h for h in doc.hotspots if h["kind"] == "free"], doc.hotspots
    with open(tmp_path / "p.pickle", "rb") as f:
        snap = pickle.load(f)
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    assert blocks and all(b["frames"] for b in blocks), blocks


def test_the_final_snapshot_sees_the_globals_of_a_script_that_raised(tmp_path):
    r = _run(
        tmp_path,
        """
        import sys, torch
        big = torch.zeros(1 << 20)
        def main():
            local = torch.zeros(1 << 10)
            raise RuntimeError("boom")
        main()
        """,
        "--json",
        "p.json",
    )
    assert r.returncode == 1
    assert "RuntimeError: boom" in r.stderr
    # as Python keeps the uncaught exception, and the frames it ended, until exit
    assert load(tmp_path / "p.json").counters["cpu"]["allocated"] == (4 << 20) + (4 << 10)


def test_the_final_snapshot_sees_the_globals_of_a_script_that_exits(tmp_path):
    """A guard: the SystemExit that ends the script is kept (with the frames it ended)
    until the report is written at exit."""
    r = _run(
        tmp_path,
        "import sys, torch\nbig = torch.zeros(1 << 20)\nsys.exit(5)\n",
        "--json",
        "p.json",
    )
    assert r.returncode == 5, r.stderr
    assert load(tmp_path / "p.json").counters["cpu"]["allocated"] == 4 << 20


def test_an_output_lost_during_the_run_is_reported(tmp_path):
    """Checked at start, its folder replaced by a file while the script ran: the error is
    logged and one line says the report was not written."""
    (tmp_path / "out").mkdir()
    r = _run(
        tmp_path,
        "import os\nos.rmdir('out')\nopen('out', 'w').close()\n",
        "--json",
        "out/p.json",
    )
    assert r.returncode == 0, r.stderr
    assert "memlord: out/p.json was not written (the error is above)" in r.stderr
    assert not _wrote(r.stderr)
