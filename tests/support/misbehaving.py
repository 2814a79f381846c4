"""``load()``: the ``misbehaving`` extension (misbehaving.c beside this file), compiled with
the system C compiler for the running interpreter into a temporary folder, cached by a hash
of the source, the interpreter and the flags (built atomically: concurrent pytest workers
share it), and imported."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).resolve().parent / "misbehaving.c"


def _compiler() -> str:
    for name in (os.environ.get("MEMLORD_FAKECUDA_CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C compiler (cc, gcc, clang) to build the misbehaving extension")


def load() -> ModuleType:
    include = sysconfig.get_paths()["include"]
    # built plainly: the sanitizer flags of the environment (CFLAGS, LDFLAGS) are not read
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{include}"]
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([sys.version, sys.executable, *flags]).encode()
    ).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"memlord-misbehaving-{key}"
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    lib = folder / f"misbehaving{suffix}"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        cmd = [_compiler(), *flags, "-o", tmp, str(SOURCE)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"cannot build the misbehaving extension: {cmd}\n{done.stderr}")
        os.replace(tmp, lib)
    spec = importlib.util.spec_from_file_location("misbehaving", lib)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
