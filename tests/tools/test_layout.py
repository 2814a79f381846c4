"""The C sources stay layered: tools/check_includes.py finds no include cycle and no
lower layer including an upper one (docs/architecture.md, "Layout")."""

from __future__ import annotations

import shutil
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


# ---- the link graph (tools/check_links.py): symbols, not includes ----

LINKS = ROOT / "tools" / "check_links.py"
needs_toolchain = pytest.mark.skipif(
    not LINKS.is_file() or shutil.which("nm") is None or shutil.which("gcc") is None,
    reason="needs tools/check_links.py, gcc and nm",
)


def run_links(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LINKS), *args], capture_output=True, text=True, timeout=300
    )


@needs_toolchain
def test_src_link_graph_is_layered_and_acyclic():
    r = run_links()
    assert r.returncode == 0, r.stderr
    assert "layered, no cycle" in r.stdout


@needs_toolchain
def test_check_links_reports_an_upward_call_and_a_cycle(tmp_path):
    # core/low.c calls a function api/high.c defines (up two layers), while
    # its includes name nothing above; sinks/a.c and sinks/b.c call each other.
    src = write(
        tmp_path,
        {
            "core/low.c": "int ml_high(void);\nint ml_low(void) { return ml_high() + 1; }\n",
            "api/high.c": "int ml_high(void) { return 2; }\n",
            "sinks/a.c": "int ml_b(int);\nint ml_a(int n) { return n > 0 ? ml_b(n - 1) : 0; }\n",
            "sinks/b.c": "int ml_a(int);\nint ml_b(int n) { return n > 0 ? ml_a(n - 1) : 1; }\n",
        },
    )
    assert run_check("--src", str(src)).returncode == 0  # the include check sees neither
    r = run_links("--src", str(src))
    assert r.returncode == 1
    assert "src/core/low.c (layer 'core', rank 2) uses src/api/high.c" in r.stderr
    assert "ml_high" in r.stderr
    assert "link cycle among sinks/a.c, sinks/b.c" in r.stderr
    assert "check_links: 2 findings" in r.stderr


@needs_toolchain
def test_check_links_passes_a_downward_call_and_a_registered_entry(tmp_path):
    # The pattern the seam uses: a sink calls down into core (a symbol), and
    # core reaches the sink only through a pointer the sink registers.
    src = write(
        tmp_path,
        {
            "core/seam.c": (
                "static void (*entry)(int);\n"
                "void ml_seam_register(void (*f)(int)) { entry = f; }\n"
                "void ml_seam_emit(int v) { if (entry) entry(v); }\n"
            ),
            "sinks/log.c": (
                "void ml_seam_register(void (*f)(int));\nvoid ml_seam_emit(int v);\n"
                "static void on_event(int v) { (void)v; }\n"
                "void ml_log_init(void) { ml_seam_register(on_event); ml_seam_emit(1); }\n"
            ),
        },
    )
    r = run_links("--src", str(src))
    assert r.returncode == 0, r.stderr
    assert "2 files, 1 edges, layered, no cycle" in r.stdout
