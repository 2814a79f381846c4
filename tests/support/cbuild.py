"""C libraries the tests build with the system compiler: the fake CUDA driver
(tests/fakecuda_driver.py) and the ``misbehaving`` extension (support/misbehaving.py).

``build(source, flags, name, prefix)`` compiles ``source`` into a temporary folder named
by ``prefix`` and a hash of the source, the flags and ``key`` (built atomically: concurrent
pytest workers share it) and returns the library's path.  Built plainly: neither the
environment's sanitizer flags (CFLAGS, LDFLAGS) nor a sanitizer runtime preloaded into a
sanitized test run reach the compiler (under ``tools/asan_run.py``, gcc would inherit
libasan, report its own leaks at exit and fail)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def compiler() -> str:
    for name in (os.environ.get("MEMLORD_FAKECUDA_CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler (cc, gcc, clang) to build a test library")


def plain_env() -> dict[str, str]:
    """The environment without a preloaded sanitizer runtime or its options."""
    return {
        k: v
        for k, v in os.environ.items()
        if k != "LD_PRELOAD" and not k.startswith(("ASAN_", "LSAN_", "UBSAN_"))
    }


def build(source: Path, flags: list[str], name: str, prefix: str, key: str = "") -> Path:
    digest = hashlib.sha256(source.read_bytes() + " ".join([key, *flags]).encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"{prefix}-{digest[:16]}"
    lib = folder / name
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    cmd = [compiler(), *flags, "-o", tmp, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=plain_env())
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"cannot build {source.name}: {cmd}\n{done.stderr}")
    os.replace(tmp, lib)
    return lib
