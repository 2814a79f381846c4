"""Several processes on one host (issue 31, items 1 to 3 and 5): real publishers in fresh
interpreters, read by ``python -m memlord top --once --json`` in another; a ``kill -9``
publisher gone from the next read; the pressure protocol between processes.

The references: each child prints the bytes of the tensors it made (torch's own
``nbytes``), and the kernel's ``MemAvailable`` says whether memory came back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import memlord
from memlord import MemLord, _publish

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(memlord.__file__)))
TIMEOUT_S = 60


@pytest.fixture
def rtdir(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    monkeypatch.setenv("MEMLORD_RUNTIME_DIR", str(d))
    return d


def _env(rtdir, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["MEMLORD_RUNTIME_DIR"] = str(rtdir)
    for k in ("DEBUG", "MEMLORD_PUBLISH", "MEMLORD_COOPERATE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _spawn(rtdir, code, **extra):
    """A child that prints one JSON line when ready, then waits for stdin to close."""
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(rtdir, **extra),
    )
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(p.stderr.read())
    return p, json.loads(line)


def _finish(p):
    if p.poll() is None:
        p.stdin.close()
        try:
            p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.stdout.read(), p.stderr.read()


PUBLISHER = """
    import json, sys, torch, memlord
    lord = memlord.MemLord()
    lord.hook_into_python()
    handle = lord.publish({name!r}, cooperate={coop})
    held = [torch.ones({n}, dtype=torch.uint8)]
    scratch = torch.empty(2 * {n}, dtype=torch.uint8)  # the peak: held + scratch
    peak = sum(t.nbytes for t in held) + scratch.nbytes
    del scratch
    released = []
    def drop(device, nbytes):
        released.append((device, nbytes))
        held.clear()
    lord.on_pressure(drop)
    with lord.region({region!r}):
        print(json.dumps({{"pid": __import__("os").getpid(),
                           "nbytes": sum(t.nbytes for t in held), "peak": peak}}),
              flush=True)
        for line in sys.stdin:  # wait; the pending call runs between these bytecodes
            pass
    print(json.dumps({{"released": released, "held": sum(t.nbytes for t in held)}}), flush=True)
"""


def _publisher(rtdir, name, n, *, coop=False, region="serve", busy=False):
    code = PUBLISHER.format(name=name, coop=coop, n=n, region=region)
    if busy:  # a main thread running Python (and torch) code, not blocked in a read
        code = code.replace(
            "for line in sys.stdin:  # wait; the pending call runs between these bytecodes\n"
            "            pass",
            "import select, time\n"
            "        while not select.select([sys.stdin], [], [], 0)[0]:\n"
            "            torch.zeros(8).sum(); time.sleep(0.001)\n"
            "        sys.stdin.read()",
        )
    return _spawn(rtdir, code)


def _top(rtdir):
    """One reading, as `python -m memlord top --json` makes it (the command itself runs in
    test_top_lists_each_publisher_with_its_bytes)."""
    from memlord import _top

    return json.loads(json.dumps(_top.collect(rtdir)))


def _top_command(rtdir):
    out = subprocess.run(
        [sys.executable, "-m", "memlord", "top", "--once", "--json"],
        capture_output=True,
        text=True,
        env=_env(rtdir),
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _by_pid(doc):
    return {r["pid"]: r for r in doc["publishers"]}


def test_top_lists_each_publisher_with_its_bytes(rtdir):
    a, ia = _publisher(rtdir, "worker-a", 3 << 20, region="prefill")
    b, ib = _publisher(rtdir, "worker-b", 5 << 20, region="decode")
    try:
        time.sleep(_publish.HEARTBEAT_S * 2.5)  # names and regions come with a heartbeat
        doc = _top_command(rtdir)
        rows = _by_pid(doc)
        assert set(rows) == {ia["pid"], ib["pid"]}
        for info, name, region in ((ia, "worker-a", "prefill"), (ib, "worker-b", "decode")):
            r = rows[info["pid"]]
            (cpu,) = [d for d in r["devices"] if d["device"] == "cpu"]
            assert cpu["live"] == info["nbytes"]  # torch's own nbytes of what it holds
            assert cpu["peak"] == info["peak"]  # and of what it held at its highest
            assert sum(cpu["categories"].values()) == cpu["live"]
            assert r["name"] == name
            assert r["region"] == region
            assert r["heartbeat_age_s"] < 5
        # sorted by live bytes, largest first
        assert [r["pid"] for r in doc["publishers"]] == [ib["pid"], ia["pid"]]
        assert doc["devices"]["cpu"]["live"] == ia["nbytes"] + ib["nbytes"]
        assert doc["devices"]["cpu"]["total"] > 0
        # the table, without a terminal
        out = subprocess.run(
            [sys.executable, "-m", "memlord", "top", "--once"],
            capture_output=True,
            text=True,
            env=_env(rtdir),
            timeout=TIMEOUT_S,
        )
        assert out.returncode == 0
        assert "worker-a" in out.stdout and "worker-b" in out.stdout
        assert "5 MiB" in out.stdout and "3 MiB" in out.stdout
    finally:
        _finish(a)
        _finish(b)
    # ended cleanly: the records are gone
    assert _top(rtdir)["publishers"] == []
    assert not [p for p in os.listdir(rtdir) if p.endswith(".rec")]


def test_kill_9_publisher_disappears_and_its_record_is_removed(rtdir):
    a, ia = _publisher(rtdir, "doomed", 1 << 20)
    b, ib = _publisher(rtdir, "survivor", 1 << 20)
    try:
        assert set(_by_pid(_top(rtdir))) == {ia["pid"], ib["pid"]}
        os.kill(ia["pid"], signal.SIGKILL)
        a.wait(timeout=TIMEOUT_S)
        assert any(p.startswith(f"{ia['pid']}-") for p in os.listdir(rtdir))  # left behind
        assert set(_by_pid(_top(rtdir))) == {ib["pid"]}
        assert not any(p.startswith(f"{ia['pid']}-") for p in os.listdir(rtdir))  # cleaned
    finally:
        _finish(a)
        _finish(b)


def test_no_publisher_says_so(rtdir):
    out = subprocess.run(
        [sys.executable, "-m", "memlord", "top", "--once"],
        capture_output=True,
        text=True,
        env=_env(rtdir),
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0
    assert "no process publishes" in out.stdout


def _available():
    return _publish.free_bytes(torch.device("cpu"))


@pytest.mark.parametrize("busy", [False, True], ids=["waiting", "running"])
def test_pressure_a_cooperating_process_releases(rtdir, busy):
    big = 3 << 30
    coop, icoop = _publisher(rtdir, "coop", big, coop=True, busy=busy)
    other, iother = _publisher(rtdir, "selfish", 64 << 20, coop=False)
    try:
        lord = MemLord()
        # 256 MiB more than is free: only the 3 GiB release can give it.  What a release
        # shows in MemAvailable varies by machine: in a firecracker VM here, a 1.5 GiB
        # tensor freed showed as 0.6-0.8 GiB (and the request for 256 MiB more failed now
        # and then, when other processes took memory meanwhile), a 3 GiB one as 1.8 GiB
        want = _available() + (256 << 20)
        asked_ns = time.time_ns()
        assert lord.request_memory("cpu", want, timeout=20.0) is True
        time.sleep(_publish.HEARTBEAT_S * 2.5)
        rows = _by_pid(_top(rtdir))
        assert rows[icoop["pid"]]["served"] == 1
        assert rows[icoop["pid"]]["released_bytes"] >= icoop["nbytes"]
        # served within the poll (50 ms) plus the main thread's next bytecode while it
        # runs torch code, or the 0.25 s memlord waits for a main thread blocked in a
        # read; the bound leaves room for a loaded CI machine
        latency = (rows[icoop["pid"]]["last_release_ns"] - asked_ns) / 1e9
        assert 0 < latency < (0.5 if busy else 1.0), latency
        assert rows[iother["pid"]]["served"] == 0
        # the requester's temporary record is gone
        assert set(rows) == {icoop["pid"], iother["pid"]}
    finally:
        out_c, err_c = _finish(coop)
        out_o, _ = _finish(other)
    done_c = json.loads(out_c.strip().splitlines()[-1])
    done_o = json.loads(out_o.strip().splitlines()[-1])
    assert done_c["released"] == [["cpu", want]], err_c
    assert done_c["held"] == 0
    assert done_o["released"] == [] and done_o["held"] == iother["nbytes"]
    # How long the request waited is not asserted: it returns once the machine's free
    # memory reaches the figure asked for, which every other process moves too (CI's
    # ASan run beside it once took it 16 s to see 512 MiB more after the 1.5 GiB
    # release, which `latency` above shows was served at once); `is True` says it
    # came before the timeout.


def test_pressure_times_out(rtdir):
    p, _ = _publisher(rtdir, "coop", 1 << 20, coop=True)
    try:
        lord = MemLord()
        impossible = _publish.free_bytes(torch.device("cpu")) * 8
        t0 = time.monotonic()
        assert lord.request_memory("cpu", impossible, timeout=0.5) is False
        took = time.monotonic() - t0
    finally:
        _finish(p)
    assert 0.5 <= took < 5


def test_request_of_a_dead_requester_is_never_served(rtdir):
    """A requester killed mid-request leaves a record with a request; the next reader
    removes it, and no cooperating process serves it."""
    requester, info = _spawn(
        rtdir,
        """
        import json, os, memlord
        from memlord import _publish
        lord = memlord.MemLord()
        p = lord.publish("asker")
        p._set_request("cpu", 1 << 40, __import__("time").time_ns() + 60 * 10**9)
        print(json.dumps({"pid": os.getpid()}), flush=True)
        import sys; sys.stdin.read()
        """,
    )
    os.kill(info["pid"], signal.SIGKILL)
    requester.wait(timeout=TIMEOUT_S)
    coop, icoop = _publisher(rtdir, "coop", 1 << 20, coop=True)
    try:
        _publish._bump_pressure()
        time.sleep(0.5)
        rows = _by_pid(_top(rtdir))
        assert info["pid"] not in rows
        assert rows[icoop["pid"]]["served"] == 0
    finally:
        out, _ = _finish(coop)
    assert json.loads(out.strip().splitlines()[-1])["released"] == []


def test_readers_never_see_a_torn_record(rtdir):
    """A publisher allocating and freeing as fast as it can, read 2,000 times from here:
    every read is consistent (its categories add up to its live bytes, and live is one
    of the values the child can hold)."""
    p, info = _spawn(
        rtdir,
        """
        import json, os, sys, select, torch, memlord
        lord = memlord.MemLord(); lord.hook_into_python(); lord.publish("churn")
        print(json.dumps({"pid": os.getpid()}), flush=True)
        keep = []
        while not select.select([sys.stdin], [], [], 0)[0]:
            for _ in range(100):
                keep.append(torch.empty(1024, dtype=torch.uint8))
                if len(keep) > 3:
                    keep.clear()
        """,
    )
    try:
        (path,) = [rtdir / n for n in os.listdir(rtdir) if n.startswith(f"{info['pid']}-")]
        seen = set()
        for _ in range(2000):
            rec = _publish.read_record(path)
            assert rec is not None
            for d in rec["devices"]:
                assert sum(d["categories"].values()) == d["live"]
                seen.add(d["live"])
        assert seen <= {0, 1024, 2048, 3072, 4096}, seen
        assert len(seen) > 1  # it did change under the reader
    finally:
        _finish(p)


def test_forked_child_does_not_write_the_parents_record(rtdir):
    lord = MemLord()
    pub = lord.publish("parent")
    try:
        lord.allocate(torch.empty(1000, dtype=torch.uint8))
        pid = os.fork()
        if pid == 0:  # the child: its counts are its own
            code = 0
            try:
                lord.allocate(torch.empty(5000, dtype=torch.uint8))
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        (rec,) = _publish.read_all()
        assert rec["devices"][0]["live"] == 1000
    finally:
        pub.disable()


def test_runtime_dir_must_be_private(tmp_path, monkeypatch):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    monkeypatch.setenv("MEMLORD_RUNTIME_DIR", str(d))
    with pytest.raises(PermissionError, match="private"):
        MemLord().publish()
    assert os.listdir(d) == []


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda L: L.publish(name=3), TypeError, ["'name'", "int"]),
        (lambda L: L.publish(cooperate="yes"), TypeError, ["'cooperate'", "str"]),
        (lambda L: L.on_pressure(3), TypeError, ["'fn'", "callable"]),
        (lambda L: L.request_memory("nope", 1), ValueError, ["'device'"]),
        (lambda L: L.request_memory(3, 1), TypeError, ["'device'", "int"]),
        (lambda L: L.request_memory("cpu", -1), ValueError, ["'nbytes'", "-1"]),
        (lambda L: L.request_memory("cpu", 1.5), TypeError, ["'nbytes'", "float"]),
        # more than a record's int64 holds: was struct.error from inside the publisher
        (lambda L: L.request_memory("cpu", 2**63), ValueError, ["'nbytes'", "2**63"]),
        (lambda L: L.request_memory("cpu", 1, timeout=-1), ValueError, ["'timeout'"]),
    ],
)
def test_bad_input(rtdir, call, exc, words):
    lord = MemLord()
    with pytest.raises(exc) as info:
        call(lord)
    for w in words:
        assert w in str(info.value)
    assert _publish.publisher_of(lord) is None
    assert not rtdir.exists() or not [p for p in os.listdir(rtdir) if p.endswith(".rec")]


@pytest.mark.parametrize("interval", ["inf", "nan", "1e10", "0", "-1"])
def test_top_refuses_an_interval_it_cannot_sleep_in_one_line(rtdir, interval):
    """``top --interval S``: a value time.sleep cannot take (infinite, beyond the
    platform's time_t) is refused before the first reading, like 0, with one line on
    stderr and exit status 2, not a traceback after the first table."""
    out = subprocess.run(
        [sys.executable, "-m", "memlord", "top", "--interval", interval],
        capture_output=True,
        text=True,
        env=_env(rtdir),
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    assert out.stderr.startswith("memlord: --interval") and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.stderr


def test_request_with_a_huge_finite_timeout_waits_and_clears(rtdir):
    """``timeout`` is any finite number of seconds >= 0: a huge one waits (here until a
    signal ends the wait) rather than failing to fit the record's deadline
    (OverflowError for 1e300, struct.error for 1e10), and the temporary record is gone
    after."""

    class Stop(Exception):
        pass

    def stop(signum, frame):
        raise Stop

    lord = MemLord()
    old = signal.signal(signal.SIGALRM, stop)
    try:
        for timeout in (1e300, 1e10):
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Stop):
                lord.request_memory("cpu", 2**62, timeout=timeout)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert _publish.publisher_of(lord) is None
    assert not [p for p in os.listdir(rtdir) if p.endswith(".rec")]


@pytest.mark.parametrize(
    ("extra", "cooperate"),
    [
        ({}, False),
        ({"MEMLORD_COOPERATE": "1"}, True),
        ({"MEMLORD_PUBLISH": "1", "MEMLORD_COOPERATE": "1"}, True),
        ({"MEMLORD_PUBLISH": "1", "MEMLORD_COOPERATE": "0"}, False),
    ],
)
def test_run_publishes_cooperating_as_memlord_cooperate_says(rtdir, tmp_path, extra, cooperate):
    """``python -m memlord run`` publishes by default; ``MEMLORD_COOPERATE=1`` makes its
    record answer other processes' ``request_memory``.  run's own ``publish(name)``
    reset to ``cooperate=False`` the record ``MEMLORD_PUBLISH=1`` had made cooperating
    when the tracker turned its hooks on."""
    script = tmp_path / "coop.py"
    script.write_text(
        "import json, os\n"
        "from memlord import _publish\n"
        "(r,) = [r for r in _publish.read_all() if r['pid'] == os.getpid()]\n"
        "print(json.dumps({'cooperate': r['cooperate'], 'name': r['name']}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "memlord", "run", "--interval", "0", "--json", "p.json", "coop.py"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(rtdir, **extra),
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"cooperate": cooperate, "name": "coop.py"}


def test_a_request_names_the_cpu_as_the_ledger_does(rtdir):
    """torch has one CPU device: ``request_memory("cpu:0", ...)`` asks for the cpu, and a
    cooperating process's ``on_pressure`` callbacks get ``"cpu"``, the name its ledger,
    ``top`` and every other request use (they got ``"cpu:0"``)."""
    p, _ = _publisher(rtdir, "coop", 1 << 20, coop=True)
    try:
        impossible = _publish.free_bytes(torch.device("cpu")) * 8
        assert MemLord().request_memory("cpu:0", impossible, timeout=1.0) is False
    finally:
        out, err = _finish(p)
    assert json.loads(out.strip().splitlines()[-1])["released"] == [["cpu", impossible]], err


def test_a_request_for_a_device_this_process_lacks_is_refused_at_once(rtdir):
    """A device whose free memory this process cannot read (no CUDA here, or an index
    torch does not have) can never be seen to reach ``nbytes``: the request returned False
    only at its timeout, after publishing and waking every cooperating process for
    nothing.  It is now False at once, and nothing is written.  The reference is the
    runtime directory: no record, no pressure file."""
    if torch.cuda.is_available():
        device = f"cuda:{torch.cuda.device_count()}"  # one index past the last
    else:
        device = "cuda:0"
    assert _publish.free_bytes(torch.device(device)) is None  # torch cannot read it
    assert MemLord().request_memory(device, 1, timeout=0.2) is False
    assert not rtdir.exists() or list(rtdir.iterdir()) == []
