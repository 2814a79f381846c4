"""pytest plugin loaded by tools/asan_run.py: refuse to run unless the memlord._core
that the tests import is the sanitizer build and the ASan runtime is loaded.

Without this, a stale unsanitized build (an in-place one in the source tree, say)
could pass the sanitizer run while checking nothing.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_LINE = pytest.StashKey[str]()


def _loaded_libraries() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def _check() -> str:
    core = importlib.import_module("memlord._core")
    path = Path(core.__file__).resolve()
    if ROOT / "memlord" in path.parents:
        raise pytest.UsageError(
            f"memlord._core comes from the source tree ({path}), not from the sanitizer "
            "build installed by tools/install.py --sanitize"
        )
    if b"libasan.so" not in path.read_bytes():
        raise pytest.UsageError(
            f"{path} is not linked against libasan: build with MEMLORD_SANITIZE=1"
        )
    if "libasan.so" not in _loaded_libraries():
        raise pytest.UsageError("the ASan runtime is not loaded: run through tools/asan_run.py")
    return f"memlord._core: {path} (ASan+UBSan build, runtime preloaded)"


def pytest_sessionstart(session):
    session.config.stash[_LINE] = _check()


def pytest_report_header(config):
    return config.stash.get(_LINE, None)
