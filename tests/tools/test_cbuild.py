"""The C libraries the tests build (support/cbuild.py) build inside a sanitized test run
too: the asan environment runs beside py, and whichever of the two first needs the fake CUDA
driver builds it into the shared temporary folder.  Before cbuild stripped the preloaded
runtime, gcc run from an asan run inherited libasan, reported its own leaks at exit and
failed, so the asan run's fakecuda tests errored whenever py had not built the fake first."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile

import pytest
from support import cbuild


def _libasan() -> str:
    out = subprocess.run(
        [cbuild.compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(out):
        pytest.fail(f"{cbuild.compiler()} has no libasan.so ({out!r}): the sanitized run needs it")
    return out


def test_a_library_builds_with_a_sanitizer_runtime_preloaded(tmp_path, monkeypatch):
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a fresh cache
    monkeypatch.setenv("LD_PRELOAD", _libasan())
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=1")
    monkeypatch.setenv("LSAN_OPTIONS", "exitcode=23")
    lib = cbuild.build(source, ["-shared", "-fPIC"], "libanswer.so", "memlord-cbuild-test")
    assert lib.parent.parent == tmp_path
    assert ctypes.CDLL(str(lib)).answer() == 42
    # cached: the same source and flags give the same library without building again
    mtime = lib.stat().st_mtime_ns
    assert cbuild.build(source, ["-shared", "-fPIC"], "libanswer.so", "memlord-cbuild-test") == lib
    assert lib.stat().st_mtime_ns == mtime
