"""The C sources stay layered: tools/check_includes.py finds no include cycle and no
lower layer including an upper one (docs/architecture.md, "Layout")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_includes.py"

pytestmark = pytest.mark.skipif(
    not (ROOT / "src").is_dir() or not CHECK.is_file(), reason="needs a source checkout"
)


def run_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=60
    )


def test_src_include_graph_is_layered_and_acyclic():
    r = run_check()
    assert r.returncode == 0, r.stderr
    assert "no cycle" in r.stdout


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "src"


def test_check_reports_a_cycle_inside_a_layer(tmp_path):
    src = write(
        tmp_path,
        {
            "sinks/a.h": '#include "sinks/b.h"\n',
            "sinks/a.c": '#include "sinks/a.h"\n',
            "sinks/b.h": "",
            "sinks/b.c": '#include "sinks/b.h"\n#include "sinks/a.h"\n',
        },
    )
    r = run_check("--src", str(src))
    assert r.returncode == 1
    assert "include cycle: sinks/a -> sinks/b -> sinks/a" in r.stderr


def test_check_reports_a_lower_layer_including_an_upper_one(tmp_path):
    src = write(
        tmp_path,
        {
            "api/lord.h": '#include "core/book.h"\n',
            "core/book.h": "",
            "core/emit.c": '#include "core/book.h"\n#include "api/lord.h"\n',
        },
    )
    r = run_check("--src", str(src))
    assert r.returncode == 1
    assert "src/core/emit.c:2" in r.stderr and "includes layer 'api'" in r.stderr


def test_check_reports_private_and_unqualified_includes(tmp_path):
    src = write(
        tmp_path,
        {
            "torch/tensorabi.h": "",
            "torch/sizing.h": '#include "torch/tensorabi.h"\n',
            "hooks/hooks.c": '#include "torch/tensorabi.h"\n#include "sizing.h"\n',
        },
    )
    r = run_check("--src", str(src))
    assert r.returncode == 1
    assert "src/hooks/hooks.c:1" in r.stderr and "private" in r.stderr
    assert 'src/hooks/hooks.c:2: #include "sizing.h" names no file under src/' in r.stderr
