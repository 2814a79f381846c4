"""A warm interpreter for the tests that run Python code in a new process.

``warm.run(args, ...)`` takes what ``subprocess.run`` takes (the subset the tests use)
and returns a ``subprocess.CompletedProcess``. When ``args`` is ``[sys.executable,
*options, "-c", code, *argv]`` or ``[sys.executable, *options, script, *argv]``, the code
runs in a child forked from a *zygote*: a Python started once per test process (lazily,
at the first such call) with the same interpreter, options and environment, that has
imported memlord (so numpy and torch) and nothing else, created no lord, started no
thread. Importing torch under ASan takes seconds; a fork takes milliseconds.

The child is a real process that ends as a fresh one does: its code runs in a fresh
``__main__``, SystemExit reaches the top of the interpreter, then atexit handlers, the
joins of non-daemon threads, module teardown and the exit status are CPython's own
(``returncode`` is negative for a death by signal). Its stdin, stdout and stderr are the
caller's (files here, not pipes: both are non-terminals, so Python buffers them alike).

What cannot differ between a child and a fresh process decides which zygote serves a
call: one per (interpreter options, environment less the variables read only while the
program runs, ``LAZY_ENV``, and those read at memlord's import into a state the child
sets again exactly, ``SWITCHED_ENV``). Anything else falls back to ``subprocess.run``
itself: ``-m``, an option not in ``OPTIONS``, a working directory or script folder that
would shadow an imported module on ``sys.path``, a zygote that failed to start, more than
``MAX_ZYGOTES`` live keys, a call from a forked test process. ``warm.stats`` counts both.

Differences a test could see: the modules the zygote imported are already in
``sys.modules``; numpy's OpenBLAS thread pool is stopped by the fork (it starts again at
the next BLAS call); the hash seed is the zygote's; an uncaught KeyboardInterrupt exits
with 1, not by SIGINT; stdin is /dev/null unless ``input`` is given.

A zygote whose environment has ``MEMLORD_WARM_SELFTEST`` (any value) imports nothing: the
warm interpreter's own tests of its life cycle (tests/tools/test_warm_interpreter.py)
start a dozen zygotes, in a tenth of a second each instead of torch's import.

Not for a test whose contract is about the interpreter's start: import-time behaviour,
how a variable is read at import (test_tensorabi.py's MEMLORD_TENSOR_ABI test), ``python
-m memlord``, the CLI's entry points, torchrun. Those keep ``subprocess.run``.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SERVER = Path(__file__).with_name("_zygote.py")

#: variables read only while the program runs (memlord's DEBUG log, its colors, pytest's
#: test name, and the CUDA driver's two, which memlord's core reads with getenv() when it
#: first loads a driver, never at import): they may differ between the zygote and the
#: child. Every other variable is part of the zygote's key.
LAZY_ENV = frozenset(
    {"DEBUG", "NO_COLOR", "FORCE_COLOR", "PYTEST_CURRENT_TEST"}
    | {"MEMLORD_CUDA_DRIVER", "MEMLORD_DISABLE_CUDA"}
)
#: variables read once, when memlord is imported, into a state its core can set again
#: exactly: the child sets it from the value it is given (MEMLORD_TENSOR_ABI: the import
#: does ``on = valid and value != "0"``, ``_core._tensor_abi(on)`` does ``on and valid``)
SWITCHED_ENV = frozenset({"MEMLORD_TENSOR_ABI"})
#: interpreter options a zygote can be started with (with their argument where they take one)
OPTIONS = {"-X": True, "-W": True, "-P": False, "-B": False, "-u": False, "-E": False,
           "-s": False, "-I": False, "-O": False, "-b": False}  # fmt: skip
MAX_ZYGOTES = 8
#: a zygote unused this long ends (its memory back); the next call starts a new one
IDLE_S = 600
START_TIMEOUT_S = 600
#: how long a zygote may take to fork a request's child before it counts as stuck
HELLO_S = 120

stats = {"warm": 0, "fallback": 0}
#: MEMLORD_TEST_WARM=0: every call a real process (to compare, or to rule the zygote out)
_ENABLED = os.environ.get("MEMLORD_TEST_WARM", "1") != "0"

_zygotes: dict[tuple, _Zygote | None] = {}


class _Zygote:
    def __init__(self, options: tuple[str, ...], env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="memlord-warm-")
        self.path = os.path.join(self.dir, "s")
        self.out = tempfile.TemporaryFile(dir=self.dir)
        self.err = tempfile.TemporaryFile(dir=self.dir)
        self.proc = subprocess.Popen(
            [sys.executable, *options, "-c", _SERVER.read_text(), self.path, str(IDLE_S)],
            stdin=subprocess.PIPE,
            stdout=self.out,
            stderr=self.err,
            env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = self._read(self.err)[-2000:]
                self.close()
                raise RuntimeError(f"zygote did not start: {why}")
            time.sleep(0.02)
        hello = self.request(b"hello", [])
        if hello.get("threads") != [1, 1]:
            self.close()
            raise RuntimeError(f"zygote has more than one thread: {hello}")
        self.pid = hello["pid"]
        self.modules = frozenset(hello["modules"])
        self.preamble_out = self._read(self.out)
        self.preamble_err = self._read(self.err)

    @staticmethod
    def _read(f) -> str:
        f.seek(0)
        return f.read().decode("utf-8", "surrogateescape")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def connect(self, msg: bytes, fds: list[int]) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [msg], fds)
        except OSError:
            conn.close()
            raise
        return conn

    def request(self, msg: bytes, fds: list[int]) -> dict:
        with self.connect(msg, fds) as conn:
            conn.settimeout(60)
            return json.loads(conn.recv(1 << 20))

    def close(self, timeout: float = 120) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"q")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        self.err.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


_owner = os.getpid()


def shutdown() -> None:
    """End every zygote (at the test process's exit: under tools/asan_run.py their
    sanitizer reports must be written before it reads them)."""
    if os.getpid() != _owner:
        return
    for key, z in list(_zygotes.items()):
        if z is not None:
            z.close()
        del _zygotes[key]


atexit.register(shutdown)


def _parse(args) -> tuple[tuple[str, ...], dict] | None:
    """(options, {"code"|"script", "argv"}) for a command a zygote can run, else None."""
    args = [os.fspath(a) for a in args]
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    i, options = 1, []
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-c", "-"):
        opt, rest = args[i][:2], args[i][2:]
        if opt not in OPTIONS or (rest and not OPTIONS[opt]):
            return None
        if OPTIONS[opt] and not rest:
            if i + 1 >= len(args):
                return None
            options += [opt, args[i + 1]]
            i += 2
        else:
            options.append(args[i])
            i += 1
    if i >= len(args) or args[i] == "-":
        return None
    if args[i] == "-c":
        if i + 1 >= len(args):
            return None
        return tuple(options), {"code": args[i + 1], "script": None, "argv": ["-c", *args[i + 2 :]]}
    return tuple(options), {"code": None, "script": args[i], "argv": args[i:]}


def _safe_path(options: tuple[str, ...], env: dict[str, str]) -> bool:
    if sys.version_info < (3, 11):
        return False
    isolated = "-I" in options
    return "-P" in options or isolated or (bool(env.get("PYTHONSAFEPATH")) and "-E" not in options)


def _shadows(folder: str, modules: frozenset[str]) -> bool:
    """Whether a module the zygote imported could be found in ``folder`` instead."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(name.partition(".")[0] in modules for name in names)


def _fixed_env(env: dict[str, str]) -> dict[str, str]:
    """The variables a zygote must have been started with (its key, less the options)."""
    return {k: v for k, v in env.items() if k not in LAZY_ENV and k not in SWITCHED_ENV}


def _zygote(key: tuple, options: tuple[str, ...], env: dict[str, str]) -> _Zygote | None:
    z = _zygotes.get(key, False)
    if z is None:
        return None  # failed before: real processes for this key
    if z is not False and z.alive():
        return z
    if z is False and sum(1 for v in _zygotes.values() if v and v.alive()) >= MAX_ZYGOTES:
        return None
    try:
        z = _Zygote(options, env)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"support.warm: falling back to real processes: {e}", file=sys.stderr)
        z = None
    _zygotes[key] = z
    return z


def _stream_fd(spec, default_fd: int, files: list):
    """(fd to send, temp file to read back or None) for a subprocess-style stream spec."""
    if spec == subprocess.PIPE:
        f = tempfile.TemporaryFile()
        files.append(f)
        return f.fileno(), f
    if spec == subprocess.DEVNULL:
        f = open(os.devnull, "r+b")  # noqa: SIM115
        files.append(f)
        return f.fileno(), None
    if spec is None:
        return default_fd, None
    if isinstance(spec, int):
        return spec, None
    return spec.fileno(), None


def _decode(data: bytes, text: bool, encoding, errors):
    if not (text or encoding or errors):
        return data
    s = data.decode(encoding or locale.getpreferredencoding(False), errors or "strict")
    return s.replace("\r\n", "\n").replace("\r", "\n")


def run(
    args,
    *,
    env=None,
    cwd=None,
    input=None,
    capture_output=False,
    stdout=None,
    stderr=None,
    text=False,
    encoding=None,
    errors=None,
    timeout=None,
    check=False,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a Python command, in a child of the warm zygote when it can."""
    kwargs = dict(env=env, cwd=cwd, input=input, capture_output=capture_output, stdout=stdout,
                  stderr=stderr, text=text, encoding=encoding, errors=errors, timeout=timeout,
                  check=check)  # fmt: skip
    parsed = _parse(args) if os.getpid() == _owner and _ENABLED else None
    env = dict(os.environ if env is None else env)
    cwd = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
    z = None
    if parsed is not None:
        options, what = parsed
        if "-P" in options and _safe_path(tuple(o for o in options if o != "-P"), env):
            options = tuple(o for o in options if o != "-P")
        fixed = _fixed_env(env)
        z = _zygote((options, tuple(sorted(fixed.items()))), options, fixed)
    path0 = None
    if z is not None and not _safe_path(options, env):
        folder = cwd
        if what["script"] is not None:
            path0 = os.path.dirname(os.path.realpath(os.path.join(cwd, what["script"])))
            folder = path0
        if _shadows(folder, z.modules):
            z = None
    if z is None:
        stats["fallback"] += 1
        return subprocess.run(args, **kwargs)
    stats["warm"] += 1
    if capture_output:
        stdout = stderr = subprocess.PIPE
    files: list = []
    try:
        if input is not None:
            f = tempfile.TemporaryFile()
            files.append(f)
            f.write(
                input.encode(encoding or locale.getpreferredencoding(False))
                if isinstance(input, str)
                else input
            )
            f.seek(0)
            in_fd = f.fileno()
        else:
            f = open(os.devnull, "rb")  # noqa: SIM115
            files.append(f)
            in_fd = f.fileno()
        out_fd, out_f = _stream_fd(stdout, 1, files)
        if stderr == subprocess.STDOUT:
            err_fd, err_f = out_fd, None
        else:
            err_fd, err_f = _stream_fd(stderr, 2, files)
        script = what["script"]
        req = {
            "code": what["code"],
            "script": os.path.join(cwd, script)
            if script is not None and not os.path.isabs(script)
            else script,
            "argv": what["argv"],
            "orig_argv": [os.fspath(a) for a in args],
            "env": env,
            "cwd": cwd,
            "path0": path0,
            "switched": {k: env.get(k) for k in SWITCHED_ENV},
            "preamble_out": z.preamble_out,
            "preamble_err": z.preamble_err,
        }
        req_f = tempfile.TemporaryFile()
        files.append(req_f)
        req_f.write(json.dumps(req).encode())
        req_f.seek(0)
        status = _execute(z, [in_fd, out_fd, err_fd, req_f.fileno()], timeout, args, out_f, err_f)
        if status is None:  # refused (a thread appeared in the zygote): a real process
            stats["warm"] -= 1
            stats["fallback"] += 1
            return subprocess.run(args, **kwargs)
        out = _decode(_read_all(out_f), text, encoding, errors) if out_f is not None else None
        err = _decode(_read_all(err_f), text, encoding, errors) if err_f is not None else None
    finally:
        for f in files:
            f.close()
    cp = subprocess.CompletedProcess(args, status, out, err)
    if check:
        cp.check_returncode()
    return cp


def _read_all(f) -> bytes:
    f.seek(0)
    return f.read()


def _ended(z: _Zygote) -> bool:
    """Whether the zygote is ending (idle for ``IDLE_S``, or crashed): waits for it a little."""
    try:
        z.proc.wait(60)
    except subprocess.TimeoutExpired:
        return False
    return True


def _execute(z: _Zygote, fds, timeout, args, out_f, err_f, retry: bool = True) -> int | None:
    """Send the request, wait for the runner; its return code (None: refused)."""

    def again():  # the zygote ended before it took the request: a new one for its key
        key = next(k for k, v in _zygotes.items() if v is z)
        del _zygotes[key]
        new = _zygote(key, key[0], dict(key[1]))
        return None if new is None else _execute(new, fds, timeout, args, out_f, err_f, False)

    try:
        conn = z.connect(b"run", fds)
    except OSError:
        if retry and _ended(z):
            return again()
        raise
    with conn:
        deadline = None if timeout is None else time.monotonic() + timeout
        pid = None
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if pid is None:  # a zygote that does not answer at once is stuck: never hang on it
                left = HELLO_S if left is None else min(left, HELLO_S)
            conn.settimeout(left)
            try:
                data = conn.recv(1 << 16)
            except TimeoutError:
                if pid is None and (deadline is None or time.monotonic() < deadline):
                    z.proc.kill()  # (the next call starts another)
                    return None  # a real process instead
                if pid is not None:  # (closing the connection would do too: the supervisor
                    try:  # kills its runner when the caller goes)
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                out = _read_all(out_f) if out_f is not None else None
                err = _read_all(err_f) if err_f is not None else None
                raise subprocess.TimeoutExpired(args, timeout, out, err) from None
            except ConnectionError:
                data = b""
            if data == b"":
                if pid is None and retry and _ended(z):
                    return again()
                raise RuntimeError("support.warm: the zygote's supervisor went away")
            msg = json.loads(data)
            if "refused" in msg:
                return None
            if "pid" in msg:
                pid = msg["pid"]
            if "status" in msg:
                return os.waitstatus_to_exitcode(msg["status"])
