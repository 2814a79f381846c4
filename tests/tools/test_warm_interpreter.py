"""The warm interpreter (tests/support/warm.py): a child forked from the zygote behaves as
a fresh ``python -c``/``python script`` would, as far as the tests that use it can see."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import under_asan
from support import warm

PY = sys.executable
pytestmark = pytest.mark.skipif(not warm._ENABLED, reason="MEMLORD_TEST_WARM=0: no zygote")
# The helper is Python: py runs every test here. Under ASan a zygote's start or a fresh
# process to compare with costs 7 s on CI's critical path; the asan run keeps the tests
# that fork from the zygote every converted test shares, and the converted tests
# themselves run there.
py_only = pytest.mark.skipif(under_asan(), reason="fresh processes and extra zygotes: in py")


@pytest.fixture(autouse=True)
def _in_an_empty_folder(tmp_path_factory, monkeypatch):
    """Without PYTHONSAFEPATH the working directory is on a child's sys.path: in the
    source tree (memlord/ is there) every call would fall back to a real process."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture
def room(monkeypatch):
    """Room for the zygotes a life-cycle test starts (they import nothing): zygotes other
    tests left (each ends after IDLE_S unused) must not fill MAX_ZYGOTES first, as they did
    in a shuffled run, where the call then ran in a real process and the_zygote() was None."""
    monkeypatch.setattr(warm, "MAX_ZYGOTES", warm.MAX_ZYGOTES + 8)


def the_zygote(env=None, options=()):
    env = dict(os.environ if env is None else env)
    key = (tuple(options), tuple(sorted(warm._fixed_env(env).items())))
    return warm._zygotes.get(key)


@py_only
def test_exit_status_streams_argv_env_and_working_directory(tmp_path):
    code = textwrap.dedent(
        """\
        import os, sys
        print(sys.argv, os.getcwd(), os.environ.get("DEBUG"), os.environ.get("NO_COLOR"))
        print("to stderr", file=sys.stderr)
        sys.exit(int(sys.argv[2]))
        """
    )
    env = dict(os.environ, DEBUG="1")
    env.pop("NO_COLOR", None)
    before = warm.stats["warm"]
    r = warm.run([PY, "-c", code, "x", "7"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert warm.stats["warm"] == before + 1  # served by a zygote, not a real process
    assert r.returncode == 7
    assert r.stdout == f"['-c', 'x', '7'] {tmp_path} 1 None\n"
    assert r.stderr == "to stderr\n"
    assert r.args == [PY, "-c", code, "x", "7"]
    # a string exit status is printed and gives 1, as in any interpreter
    r = warm.run([PY, "-c", "import sys; sys.exit('bad')"], capture_output=True, text=True)
    assert (r.returncode, r.stdout, r.stderr) == (1, "", "bad\n")
    # stdin from input=, stderr into stdout
    r = warm.run(
        [PY, "-c", "import sys; print(sys.stdin.read().upper()); print('e', file=sys.stderr)"],
        input="abc",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert r.stdout in ("ABC\ne\n", "e\nABC\n") and r.stderr is None


@py_only
def test_a_script_runs_as_main_with_its_file_and_folder(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(__name__, __file__, sys.argv[1:])\n")
    r = warm.run([PY, str(script), "a"], capture_output=True, text=True, check=True)
    assert r.stdout == f"__main__ {script} ['a']\n"


@py_only
def test_an_uncaught_exception_prints_the_callers_traceback_only():
    r = warm.run([PY, "-c", "def f():\n    raise ValueError('boom')\nf()"], capture_output=True)
    fresh = subprocess.run(
        [PY, "-c", "def f():\n    raise ValueError('boom')\nf()"], capture_output=True
    )
    assert (r.returncode, r.stdout, r.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert r.returncode == 1 and b"ValueError: boom" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGABRT])
def test_a_death_by_signal_gives_the_negative_signal_number(sig):
    r = warm.run([PY, "-c", f"import os; os.kill(os.getpid(), {int(sig)})"], capture_output=True)
    assert r.returncode == -sig


@py_only
def test_the_child_ends_through_interpreter_finalization():
    """atexit handlers run, non-daemon threads are joined, module globals are torn down
    (a finalizer prints) with memlord's hooks on, line for line as in a fresh process."""
    code = textwrap.dedent(
        """\
        import atexit, threading, time, torch
        from memlord import MemLord
        lord = MemLord()
        hooks = lord.hook_into_torch()
        kept = torch.empty(100)
        class Last:
            def __del__(self):
                print("finalized", lord.allocated("cpu")[0], flush=True)
        last = Last()
        atexit.register(lambda: print("atexit", flush=True))
        def late():
            time.sleep(0.3)
            print("thread done", flush=True)
        threading.Thread(target=late).start()
        print("main done", flush=True)
        """
    )
    r = warm.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fresh = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert r.stdout.splitlines()[:3] == ["main done", "thread done", "atexit"]
    assert r.stdout.splitlines()[3].startswith("finalized ")


def test_the_zygote_is_one_thread_and_never_the_child():
    r = warm.run([PY, "-c", "import os; print(os.getpid(), os.getppid())"], capture_output=True)
    z = the_zygote()
    assert z is not None and z.alive()
    child, parent = map(int, r.stdout.split())
    assert len({child, parent, z.pid, os.getpid()}) == 4, (child, parent, z.pid, os.getpid())
    hello = z.request(b"hello", [])
    assert hello["threads"] == [1, 1]  # threading's count and /proc/self/task
    assert {"torch", "numpy", "memlord"} <= set(hello["modules"])
    # what a fresh process would not have: no lord, no hooks, no thread pool started
    code = (
        "import os, sys, torch, memlord, gc\n"
        "print(len(os.listdir('/proc/self/task')), torch.is_grad_enabled(),\n"
        "      sum(type(o).__name__ == 'MemLord' for o in gc.get_objects()))"
    )
    r = warm.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["1", "True", "0"]


def test_a_timeout_kills_the_child_and_raises_with_its_output():
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        warm.run([PY, "-c", code], capture_output=True, timeout=2)
    assert time.monotonic() - t0 < 30
    pid = int(e.value.stdout.split()[0])
    for _ in range(100):  # killed, reaped by its supervisor
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the timed-out child {pid} still runs")


@py_only
def test_interpreter_options_and_import_time_variables_get_a_zygote_of_their_own(room):
    # zygotes that import nothing (MEMLORD_WARM_SELFTEST): what serves a call is the point
    before = dict(warm.stats)
    base = dict(os.environ, MEMLORD_WARM_SELFTEST="options")
    code = "import sys; print(sys.flags.warn_default_encoding)"
    r = warm.run([PY, "-X", "warn_default_encoding", "-c", code], env=base,
                 capture_output=True, text=True, check=True)  # fmt: skip
    assert r.stdout == "1\n"
    r = warm.run([PY, "-c", code], env=base, capture_output=True, text=True)
    assert r.stdout == "0\n"
    with_option = the_zygote(base, ("-X", "warn_default_encoding"))
    assert with_option is not None and with_option is not the_zygote(base)
    # read at startup: another zygote
    env = dict(base, PYTHONOPTIMIZE="1")
    r = warm.run([PY, "-c", "import sys; print(sys.flags.optimize)"], env=env,
                 capture_output=True, text=True, check=True)  # fmt: skip
    assert r.stdout == "1\n"
    assert the_zygote(env) is not None and the_zygote(env) is not the_zygote(base)
    for z in (the_zygote(env), with_option, the_zygote(base)):
        z.close()  # (their memory back: no other test uses them)
    assert warm.stats["fallback"] == before["fallback"]


@py_only
@pytest.mark.parametrize("value", [None, "0", "1"])
def test_the_tensor_abi_variable_is_set_in_the_child_as_memlords_import_does(value):
    """MEMLORD_TENSOR_ABI is read when memlord is imported; the child sets the same state."""
    code = "from memlord import _core; print(_core._tensor_abi())"
    env = {k: v for k, v in os.environ.items() if k != "MEMLORD_TENSOR_ABI"}
    if value is not None:
        env["MEMLORD_TENSOR_ABI"] = value
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True, check=True)
    fresh = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert r.stdout == fresh.stdout
    assert ("'enabled': False" in r.stdout) == (value == "0")


@py_only
def test_what_a_zygote_cannot_serve_runs_in_a_real_process(tmp_path):
    before = dict(warm.stats)
    r = warm.run([PY, "-m", "platform"], capture_output=True, text=True, check=True)
    assert r.stdout.strip()
    # a working directory with its own "torch" would shadow the zygote's (no -P)
    (tmp_path / "torch.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    r = warm.run([PY, "-c", "print(1)"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.stdout == "1\n"
    assert warm.stats["fallback"] == before["fallback"] + 2
    assert warm.stats["warm"] == before["warm"]


@py_only
def test_a_zygote_that_dies_is_replaced_and_one_that_cannot_start_falls_back(monkeypatch, room):
    env = dict(os.environ, MEMLORD_WARM_SELFTEST="crash")
    code = "print('ran')"
    assert warm.run([PY, "-c", code], env=env, capture_output=True, text=True).stdout == "ran\n"
    z = the_zygote(env)
    z.proc.kill()
    z.proc.wait()
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert r.stdout == "ran\n"
    assert the_zygote(env) is not None and the_zygote(env) is not z and the_zygote(env).alive()
    the_zygote(env).close()

    # a zygote that exits at start: the call runs in a real process, and so do the next
    monkeypatch.setattr(warm, "_SERVER", warm._SERVER.with_name("__init__.py"))
    env = dict(os.environ, MEMLORD_WARM_SELFTEST="no start")
    before = warm.stats["fallback"]
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert r.stdout == "ran\n" and warm.stats["fallback"] == before + 1
    assert the_zygote(env) is None
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert r.stdout == "ran\n" and warm.stats["fallback"] == before + 2


def test_a_crash_while_the_interpreter_finalizes_is_seen():
    """What the exit tests rely on: the child's module teardown runs (a global's finalizer
    that aborts gives -SIGABRT), after its output is flushed."""
    code = (
        "import os\n"
        "class Bomb:\n"
        "    def __del__(self):\n"
        "        os.write(1, b'tearing down\\n'); os.abort()\n"
        "bomb = Bomb()\n"
        "print('main done')\n"
    )
    r = warm.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGABRT
    assert r.stdout == "main done\ntearing down\n"


@py_only
def test_an_idle_zygote_ends_and_the_next_call_starts_another(monkeypatch, room):
    monkeypatch.setattr(warm, "IDLE_S", 1)
    env = dict(os.environ, MEMLORD_WARM_SELFTEST="idle")
    code = "import os; print(os.getppid())"
    assert warm.run([PY, "-c", code], env=env, capture_output=True).returncode == 0
    first = the_zygote(env)
    first.proc.wait(60)  # it ends by itself
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip()
    second = the_zygote(env)
    assert second is not first and second.alive()
    second.close()


@py_only
def test_a_stuck_zygote_is_killed_and_the_call_runs_in_a_real_process(monkeypatch, room):
    env = dict(os.environ, MEMLORD_WARM_SELFTEST="stuck")
    code = "print('ran')"
    assert warm.run([PY, "-c", code], env=env, capture_output=True, text=True).stdout == "ran\n"
    z = the_zygote(env)
    os.kill(z.pid, signal.SIGSTOP)  # accepts no more connections: they wait in its backlog
    monkeypatch.setattr(warm, "HELLO_S", 1)
    before = warm.stats["fallback"]
    r = warm.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout == "ran\n" and warm.stats["fallback"] == before + 1
    z.proc.wait(30)  # killed
    assert not z.alive()
