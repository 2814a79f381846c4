"""``load()``: the ``misbehaving`` extension (misbehaving.c beside this file), built for the
running interpreter (support/cbuild.py) and imported."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from support import cbuild

SOURCE = Path(__file__).resolve().parent / "misbehaving.c"


def load() -> ModuleType:
    include = sysconfig.get_paths()["include"]
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-I{include}"]
    name = "misbehaving" + importlib.machinery.EXTENSION_SUFFIXES[0]
    lib = cbuild.build(SOURCE, flags, name, "memlord-misbehaving", key=sys.version)
    spec = importlib.util.spec_from_file_location("misbehaving", lib)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
