"""Whole processes: a forked child counts on its own, the interpreter exits cleanly with
tracked objects alive, and `python -X dev -m memlord` runs clean.

Each case runs in a fresh interpreter so a crash, a hang or a warning at exit is seen as such.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import fake_mode_cuda
from support import warm
from support.crash import exit_child_script, native_stacks

import memlord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(memlord.__file__)))
TIMEOUT_S = 180


def run_python(code_or_args, *, env_extra=None, x_dev=False, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for k in ("DEBUG", "NO_COLOR", "PYTHONWARNINGS"):
        env.pop(k, None)
    env.update(env_extra or {})
    cmd = [sys.executable]
    if sys.version_info >= (3, 11):
        cmd += ["-P"]  # never import the source tree from the working directory
    if x_dev:
        cmd += ["-X", "dev"]
    if isinstance(code_or_args, str):
        cmd += ["-c", textwrap.dedent(code_or_args)]
    else:
        cmd += list(code_or_args)
    # `python -c` in a child of the warm interpreter (tests/support/warm.py): a real
    # process that ends through the interpreter's finalization; `-m memlord` (the demo's
    # start is part of what is tested) in a fresh one
    run = warm.run if isinstance(code_or_args, str) else subprocess.run
    return run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, cwd=cwd)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_counts_on_its_own():
    r = run_python(
        """
        import os, sys, threading, torch
        from memlord import MemLord

        lord = MemLord(auto_gc_bytes=None)
        t = torch.empty(25)  # 100 B
        lord.allocate(t)
        hooks = lord.hook_into_torch()  # the child inherits patched torch methods

        # a thread keeps the lord busy so the fork may land mid-call
        stop = threading.Event()
        def spin():
            u = torch.empty(4)
            while not stop.is_set():
                lord.allocate(u); lord.free(u); lord.allocated()
        th = threading.Thread(target=spin, daemon=True)
        th.start()

        for _ in range(5):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                before = lord.allocated("cpu")[0]
                lord.allocate(torch.empty(250))  # 1000 B in the child only
                after = lord.allocated("cpu")[0]
                t.double()  # 200 B more, counted by the inherited hooks
                after_cast = lord.allocated("cpu")[0]
                lord.free(t)
                os.write(w, f"{before} {after} {after_cast}".encode())
                os._exit(0)
            os.close(w)
            data = b""
            import select
            ready, _, _ = select.select([r], [], [], 60)
            if not ready:
                os.kill(pid, 9)
                sys.exit("child hung after fork")
            while chunk := os.read(r, 100):
                data += chunk
            os.close(r)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            before, after, after_cast = map(int, data.split())
            assert after == before + 1000, (before, after)
            assert after_cast == after + 200, (after, after_cast)
        stop.set()
        th.join()
        hooks.disable()
        # the parent never saw the children's 1000 B
        s = lord.stats()["cpu"]
        assert s["allocated"] == 100, s
        assert s["allocated_total"] % 16 == 100 % 16
        print("ok")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


EXIT_SCRIPT = """
    import gc, sys, threading, warnings
    import numpy as np, torch
    from torch import nn
    from memlord import MemLord

    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(100, device="{fake_dev}")

    lord = MemLord(auto_gc_bytes=64)
    hooks = lord.hook_into_torch()  # left on at exit
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    arr = np.zeros(1000)
    lord.allocate([model, arr, arr[3:], fake])
    lord.free(fake)

    class Holder:  # a cycle holding the lord and tracked objects, left for the final GC
        pass
    h = Holder()
    h.self, h.lord, h.model, h.arr = h, lord, model, arr
    second = MemLord()
    second.allocate(model)
    del h

    # a daemon thread still calling into the lord while the program ends, parked before
    # finalization (DAEMON_UNTIL_EXIT: CPython's own daemon-thread crash); it stops
    # allocating (the calls that print under DEBUG) before DEBUG is switched on, since any
    # daemon thread writing to stdout at shutdown can abort CPython itself
    # ("_enter_buffered_busy"), memlord or not
    t = torch.empty(10)
    quiet = False
    def step():
        if not quiet:
            lord.allocate(t); lord.free(t)
        lord.stats(); lord.allocated("cpu")
    start_daemon(step)
    import time; time.sleep(0.2)
    {tail}
"""


@pytest.mark.parametrize(
    "tail",
    [
        "pass",
        "quiet = True; time.sleep(0.2); import os; os.environ['DEBUG'] = '1'; "
        "lord.allocate(t); sys.exit(0)",
    ],
    ids=["fall-off-end", "sys-exit-with-debug-on"],
)
def test_interpreter_exit_with_tracked_objects_is_clean(tail, tmp_path):
    script = exit_child_script(tmp_path, EXIT_SCRIPT.format(tail=tail, fake_dev=fake_mode_cuda()))
    r = run_python(script, x_dev=True)
    assert r.returncode == 0, r.stderr + native_stacks(r.returncode, tmp_path)
    # DEBUG=1 logs to stderr: log lines only, nothing else
    assert all(ln.startswith(("memlord: ", "  ")) for ln in r.stderr.splitlines()), r.stderr


def test_demo_runs_clean_under_x_dev(tmp_path):
    r = run_python(["-m", "memlord"], x_dev=True, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert "Warning" not in r.stdout
    assert "cpu" in r.stdout  # the per-device table
    assert "\x1b[" not in r.stdout  # DEBUG is unset: no log lines


def test_demo_with_debug_and_no_color(tmp_path):
    r = run_python(["-m", "memlord"], env_extra={"DEBUG": "1", "NO_COLOR": "1"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "memlord: [allocate]" in r.stderr  # the log goes to stderr
    assert "\x1b[" not in r.stderr and "\x1b[" not in r.stdout
