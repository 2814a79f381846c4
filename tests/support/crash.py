"""What a child process that died by a signal was doing: the native stack of each thread.

faulthandler prints a dead child's Python frames, but not where in C it crashed, and
nothing at all for a thread without a Python thread state (late in the interpreter's
finalization). A test whose child may crash that way starts the child's code with
``enable_core_dump(folder)`` and, when the child died by a signal, puts
``native_stacks(returncode, folder)`` in its assertion message: gdb's backtrace of every
thread, read from the core file the kernel wrote (``core_pattern`` ``core``: the
process's working folder). It says why when there is none (no gdb, no core file, a
``core_pattern`` that pipes elsewhere). Core files are removed once read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

GDB_TIMEOUT_S = 180

#: Python source for a child script that keeps a thread calling into memlord while the
#: program ends: ``start_daemon(step)`` calls ``step()`` in a loop in a daemon thread until
#: an atexit callback stops it, then parks the thread in a lock wait (the GIL released)
#: for good. CPython before 3.14 crashes at random when a daemon thread still takes turns
#: at the GIL after finalization has freed its thread state (gh-110052, reproduced there on
#: 3.9 to 3.12; 3.14 hangs such threads instead, gh-87135): 3.11's ``take_gil`` hands the
#: freed ``tstate`` to ``drop_gil`` on its way to ``PyThread_exit_thread``, which reads
#: ``tstate->interp`` when the main thread has asked for the GIL. With ``-X dev`` the freed
#: memory reads 0xDD..., and faulthandler prints no thread at all: it sees the dangling
#: state and stops. That is what CI saw twice in the exit tests, whose daemon spun through
#: finalization. Parked, the thread never asks for the GIL again.
DAEMON_UNTIL_EXIT = """
import atexit as _atexit, threading as _threading
def start_daemon(step):
    stop, parked, forever = _threading.Event(), _threading.Event(), _threading.Lock()
    forever.acquire()
    def run():
        try:
            while not stop.is_set():
                step()
        finally:
            parked.set()
        forever.acquire()
    def park():
        stop.set()
        parked.wait(30)
    _atexit.register(park)
    _threading.Thread(target=run, daemon=True).start()
"""


def enable_core_dump(folder: str | os.PathLike[str]) -> str:
    """Python lines that let the child write a core file into `folder` (its working
    folder from then on) if it dies by a signal."""
    return (
        "import os as _os, resource as _resource\n"
        "_soft, _hard = _resource.getrlimit(_resource.RLIMIT_CORE)\n"
        "_resource.setrlimit(_resource.RLIMIT_CORE, (_hard, _hard))\n"
        f"_os.chdir({os.fspath(folder)!r})\n"
        "del _os, _resource, _soft, _hard\n"
    )


def exit_child_script(folder: str | os.PathLike[str], code: str) -> str:
    """`code` (dedented) as a child script that writes a core file into `folder` if it
    dies by a signal, with ``start_daemon`` (DAEMON_UNTIL_EXIT) defined."""
    return enable_core_dump(folder) + DAEMON_UNTIL_EXIT + textwrap.dedent(code)


def native_stacks(returncode: int, folder: str | os.PathLike[str]) -> str:
    """gdb's backtrace of every thread of a child that died by a signal, from its core
    file in `folder`; '' when the child did not die by a signal."""
    if returncode >= 0:
        return ""
    cores = sorted(Path(folder).glob("core*"))
    if not cores:
        try:
            pattern = Path("/proc/sys/kernel/core_pattern").read_text().strip()
        except OSError:
            pattern = "?"
        return f"\n[no core file in {folder}; core_pattern {pattern!r}]"
    gdb = shutil.which("gdb")
    if gdb is None:
        for core in cores:
            core.unlink()
        return "\n[a core file was written, but gdb is not installed to read it]"
    out = []
    for core in cores:
        try:
            r = subprocess.run(
                [
                    gdb,
                    "-batch",
                    "-nx",
                    "-ex",
                    "set pagination off",
                    "-ex",
                    "thread apply all bt 40",
                    sys.executable,
                    str(core),
                ],
                capture_output=True,
                text=True,
                timeout=GDB_TIMEOUT_S,
            )
            text = r.stdout
        except subprocess.TimeoutExpired:
            text = f"[gdb took over {GDB_TIMEOUT_S} s]"
        finally:
            core.unlink()
        stacks = [ln for ln in text.splitlines() if ln.startswith(("#", "Thread", "Program"))]
        out.append(f"\n[native stacks from {core.name}]\n" + "\n".join(stacks))
    return "".join(out)
