"""The warm interpreter's server (see support/warm.py): run as ``python [options] -c
<this file's text> SOCKET_PATH``, never imported.

It imports memlord (hence numpy and torch) as a fresh process would, checks that it is
the only thread, then waits for requests on a SOCK_SEQPACKET Unix socket. Each request
comes with four file descriptors: the child's stdin, stdout and stderr and a file holding
the request (JSON: argv, the code or script, environment, working directory, what this
server printed while importing). For each, a supervisor is forked; it forks the runner,
sends its pid, waits for it and sends its wait status. The runner returns to this file's
top level, takes the caller's descriptors as 0, 1 and 2, sets the environment, argv and
working directory, installs a fresh ``__main__`` and runs the code in it; then the
interpreter ends as any other: SystemExit reaches the top, atexit handlers, thread joins,
module teardown and the exit status are the interpreter's own.

A closed stdin (the test process ended), a ``q`` on it, or no request for IDLE_S seconds
(argv[2]) ends the server.
"""

import json
import os
import select
import socket
import sys
import warnings

_SOCKET_PATH = sys.argv[1]
_IDLE_S = float(sys.argv[2])


def _tasks():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: threading's count only
        return 1


def _threads():
    import threading

    return threading.active_count(), _tasks()


def _preload():
    if os.environ.get("MEMLORD_WARM_SELFTEST"):
        return  # the warm interpreter's own tests of its life cycle: nothing to import
    import memlord  # noqa: F401  (numpy and torch with it, as a script importing memlord)

    # numpy's OpenBLAS starts a thread pool when loaded, and stops it in its fork handler
    # (pthread_atfork), to start it again at the next BLAS call. One fork stops it here:
    # from then on this process has one thread, checked before every fork.
    # (Python 3.12+ warns of a fork with threads running: this one's child only exits)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _send(conn, obj):
    try:
        conn.send(json.dumps(obj).encode())
    except OSError:
        pass


def _supervise(conn, fds):
    """In the supervisor: fork the runner, report its pid and its wait status."""
    try:
        pidfd = None
        pid = os.fork()
        if pid == 0:
            return True
        for fd in fds:
            os.close(fd)
        _send(conn, {"pid": pid})
        if hasattr(os, "pidfd_open"):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                pidfd = None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                _send(conn, {"status": status})
                return False
            ready, _, _ = select.select(
                [conn] + ([pidfd] if pidfd is not None else []),
                [],
                [],
                0.05 if pidfd is None else None,
            )
            if conn in ready:
                try:
                    gone = conn.recv(64) == b""
                except OSError:
                    gone = True
                if gone:  # the caller gave up (or died): the runner goes too
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
                    os.waitpid(pid, 0)
                    return False
    except BaseException:  # noqa: BLE001  (never let the supervisor run the caller's code)
        return False


def _serve():
    """The server loop; returns the request in a runner, None when the server ends."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(_SOCKET_PATH + ".tmp")
    srv.listen(64)
    os.rename(_SOCKET_PATH + ".tmp", _SOCKET_PATH)  # the caller waits for this name
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        ready, _, _ = select.select([srv, 0], [], [], _IDLE_S)
        if not ready:  # idle: end (the caller sees the name gone, then the process)
            os.unlink(_SOCKET_PATH)
            srv.close()
            return None
        if 0 in ready:
            if os.read(0, 1) in (b"", b"q"):
                srv.close()
                return None
        if srv not in ready:
            continue
        conn, _ = srv.accept()
        try:
            msg, fds, _, _ = socket.recv_fds(conn, 4096, 8)
        except OSError:
            conn.close()
            continue
        threads = _threads()
        if msg == b"hello":
            mods = sorted({m.partition(".")[0] for m in sys.modules})
            _send(conn, {"pid": os.getpid(), "threads": threads, "modules": mods})
            conn.close()
            continue
        if threads != (1, 1) or len(fds) != 4:
            _send(conn, {"refused": f"threads {threads}, fds {len(fds)}"})
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                srv.close()
                os.close(0)
                if _supervise(conn, fds):
                    conn.close()
                    return fds
                os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


def _become(fds):
    """In the runner: the caller's streams, environment, argv and working directory."""
    stdin, stdout, stderr, req_fd = fds
    with os.fdopen(req_fd, "rb") as f:
        req = json.loads(f.read().decode())
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    for fd in {stdin, stdout, stderr}:
        if fd > 2:
            os.close(fd)
    if req["preamble_out"]:
        os.write(1, req["preamble_out"].encode("utf-8", "surrogateescape"))
    if req["preamble_err"]:
        os.write(2, req["preamble_err"].encode("utf-8", "surrogateescape"))
    # the same dict object (os.environ._data), which memlord's core watches for DEBUG
    os.environ.clear()
    os.environ.update(req["env"])
    abi = req["switched"]["MEMLORD_TENSOR_ABI"]  # read by memlord's import: set as it does
    if "memlord" in sys.modules:  # (not in the warm interpreter's own life-cycle tests)
        sys.modules["memlord"]._core._tensor_abi(abi != "0")
    os.chdir(req["cwd"])
    sys.argv[:] = req["argv"]
    if hasattr(sys, "orig_argv"):
        sys.orig_argv[:] = req["orig_argv"]
    if req["path0"] is not None and sys.path and sys.path[0] == "":
        sys.path[0] = req["path0"]
    return req


def _run(req):
    """Run the request's code in a fresh ``__main__``, as ``python -c``/``python script``."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    main.__dict__["__annotations__"] = {}
    if req["script"] is None:
        filename = "<string>"
        source = req["code"]
        main.__loader__ = importlib.machinery.BuiltinImporter
        import linecache

        if isinstance(source, str) and filename in linecache.cache:
            # From 3.13 `python -c` keeps its code's text in linecache for tracebacks: the
            # entry there is the server's own; a fresh process would hold the request's
            linecache.cache[filename] = (
                len(source),
                None,
                [line + "\n" for line in source.splitlines()],
                filename,
            )
    else:
        filename = req["script"]
        with open(filename, "rb") as f:
            source = f.read()
        main.__file__ = filename
        main.__cached__ = None
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", filename)
    main.__spec__ = None
    sys.modules["__main__"] = main  # the same slot as the server's: same teardown order
    try:
        code = compile(source, filename, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (what the interpreter does with it)
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        e.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        sys.excepthook(type(e), e, tb)
        raise SystemExit(1) from None


_preload()
_fds = _serve()
if _fds is not None:
    del _serve, _supervise, _preload
    _run(_become(_fds))
