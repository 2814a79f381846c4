"""tests/support/crash.py: a child that dies by a signal leaves a core file, and the test
gets every thread's native stack from it (what faulthandler cannot print)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import under_asan
from support.crash import enable_core_dump, native_stacks

CRASH = (
    "import ctypes, threading\n"
    # a thread that waits for ever (input() returned at once when stdin was at its end,
    # and the thread could be gone before the crash: one thread in the core)
    "threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    "ctypes.string_at(0)\n"
)


# Under ASan the child inherits AddressSanitizer, which reports a crash with its own
# stacks (tools/asan_run.py prints them), and its core holds the whole shadow memory:
# gdb cannot read it in minutes. The helper is Python: the py environments run this.
@pytest.mark.skipif(under_asan(), reason="ASan reports crashes itself; the py runs test this")
def test_a_segfault_gives_each_threads_native_stack(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", enable_core_dump(tmp_path) + CRASH],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == -11, r.stderr
    text = native_stacks(r.returncode, tmp_path)
    if shutil.which("gdb") is None:
        assert "gdb is not installed" in text
    else:
        # the crashing call is named, and both threads are listed
        assert "string_at" in text or "memmove" in text or "memcpy" in text, text
        assert text.count("\nThread ") >= 2, text
    assert not list(tmp_path.glob("core*"))  # read once, then removed


def test_a_clean_exit_says_nothing(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", enable_core_dump(tmp_path) + "print(1)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == "1\n"
    assert native_stacks(r.returncode, tmp_path) == ""
