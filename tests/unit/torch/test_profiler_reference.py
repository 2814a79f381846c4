"""torch's profiler as the tests' outside reference (``support.ledger.torch_memory``):
what it measures must not depend on what the block happens to import first."""

from __future__ import annotations

import importlib
import py_compile
import sys
import uuid
from pathlib import Path

import torch
from support.ledger import torch_memory

MODULE = """
import torch

HELD = torch.empty({n})
"""


def test_a_module_imported_first_inside_the_reference_is_measured_and_its_code_kept(
    tmp_path: Path, monkeypatch
) -> None:
    """torch's profiler, recording Python stacks, keeps each function's name as a pointer
    into its code object without holding it, and reads it when the profile ends; the
    top-level code of a module imported for the first time in the block is freed once it
    has run. Under ASan that was a heap-use-after-free in torch's profiler
    (``Result::name``): the asan run failed whenever a reference block was the first to
    import something, and passed when an earlier test had imported it. The reference now
    keeps the code that runs in its block until the profile is read."""
    name = f"fresh_{uuid.uuid4().hex}"
    source = tmp_path / f"{name}.py"
    source.write_text(MODULE.format(n=1000))
    # as an installed module is imported: from its .pyc (the strings marshal reads are
    # the code object's own, where a compile of the source shares interned ones)
    py_compile.compile(str(source), doraise=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with torch_memory() as seen:
            module = importlib.import_module(name)
        assert isinstance(module.HELD, torch.Tensor)
        assert seen.net == 4000  # the module's tensor, still held
        assert seen.kept_code >= 1  # at least the module's own code
    finally:
        sys.modules.pop(name, None)
