"""Prove that the sanitizer run of tools/asan_run.py can fail.

Builds a tiny throwaway extension, with the flags setup.py uses for
MEMLORD_SANITIZE=1, in a temporary directory and runs it through the same
environment as the test suite (preloads, options, tools/lsan.supp):

* a heap overflow, a block lost from malloc and one lost from PyMem_Malloc in the
  extension must each leave a report and fail the process;
* so must signed overflow inside a pytest test (pytest captures file descriptor 2:
  the report must reach the log directory all the same);
* importing torch and numpy and touching them, and a block still reachable from a
  global, must leave none (the suppressions cover the third-party leaks and
  nothing of the extension's).

`tox -e asan` runs it before the test suite, so a sanitizer setup that stopped
reporting (a runtime not preloaded, an option or suppression that hides too much)
fails CI instead of passing silently.

    python tools/asan_selftest.py
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from asan_run import SITE, run_sanitized

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Stores through a volatile pointer cannot be optimised away with the block. */
static void *volatile sink;
void *asan_probe_kept;

static PyObject *leak_malloc(PyObject *self, PyObject *unused)
{
    sink = malloc(4321);
    sink = NULL;
    Py_RETURN_NONE;
}

static void *pymem_block(size_t n)
{
    sink = PyMem_Malloc(n);
    return sink;
}

static PyObject *leak_pymem(PyObject *self, PyObject *unused)
{
    (void)pymem_block(1234);
    sink = NULL;
    Py_RETURN_NONE;
}

static PyObject *keep_block(PyObject *self, PyObject *unused)
{
    asan_probe_kept = PyMem_Malloc(99); /* reachable from a global: not a leak */
    Py_RETURN_NONE;
}

static PyObject *overflow(PyObject *self, PyObject *unused)
{
    char *p = PyMem_Malloc(16);
    volatile int i = 16;
    p[i] = 1;
    PyMem_Free(p);
    Py_RETURN_NONE;
}

static PyObject *signed_overflow(PyObject *self, PyObject *arg)
{
    volatile int x = INT_MAX;
    x = x + (int)PyLong_AsLong(arg);
    return PyLong_FromLong(x);
}

static PyMethodDef methods[] = {
    {"leak_malloc", leak_malloc, METH_NOARGS, NULL},
    {"leak_pymem", leak_pymem, METH_NOARGS, NULL},
    {"keep_block", keep_block, METH_NOARGS, NULL},
    {"overflow", overflow, METH_NOARGS, NULL},
    {"signed_overflow", signed_overflow, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "asan_probe", NULL, -1, methods};

PyMODINIT_FUNC PyInit_asan_probe(void)
{
    return PyModule_Create(&def);
}
"""

# The same flags as setup.py's MEMLORD_SANITIZE=1 build.
FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=undefined",
    "-O1",
    "-g",
]

THIRD_PARTY = "import torch, numpy; torch.ones(8).sum(); numpy.ones(8).sum(); "

# pytest captures file descriptor 2 and loses it when the process aborts.
TEST_FILE = """
import asan_probe

def test_signed_overflow():
    asan_probe.signed_overflow(1)
"""

# (name, command after the interpreter, substring the report must contain or None for
# "exit 0 and no report")
CASES = [
    ("clean", ["-c", THIRD_PARTY + "import asan_probe; asan_probe.keep_block()"], None),
    ("malloc leak", ["-c", "import asan_probe; asan_probe.leak_malloc()"], "leak_malloc"),
    ("PyMem leak", ["-c", "import asan_probe; asan_probe.leak_pymem()"], "pymem_block"),
    ("heap overflow", ["-c", "import asan_probe; asan_probe.overflow()"], "heap-buffer-overflow"),
    (
        "UB under pytest",
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        "signed integer overflow",
    ),
]


def build(tmp: Path) -> None:
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    src = tmp / "asan_probe.c"
    src.write_text(SOURCE)
    (tmp / "test_probe.py").write_text(TEST_FILE)
    cmd = ["gcc", "-shared", "-fPIC", *FLAGS, f"-I{include}", str(src)]
    subprocess.run([*cmd, "-o", str(tmp / f"asan_probe{suffix}")], check=True)


def main() -> int:
    failures = []
    with tempfile.TemporaryDirectory(prefix="memlord-asan-selftest-") as tmp:
        build(Path(tmp))
        for name, args, expect in CASES:
            status, reports = run_sanitized(
                [sys.executable, *args], cwd=Path(tmp), extra_env={"PYTHONPATH": f"{SITE}:{tmp}"}
            )
            text = "\n".join(body for _, body in reports)
            if expect is None:
                ok = status == 0 and not reports
            else:
                ok = status != 0 and expect in text
            print(f"asan selftest: {name:16} exit {status:3}  reports {len(reports)}  ", end="")
            print("ok" if ok else "WRONG")
            if not ok:
                failures.append(name)
                print(text or "(no report)", file=sys.stderr)
    if failures:
        print(f"asan selftest FAILED: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
