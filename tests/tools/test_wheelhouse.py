"""tools/wheelhouse.py, tox's installer for py310/py312/py313: the shared distributions
(the nvidia-* libraries of torch's CUDA build, installed once) are linked into an
environment so that its interpreter imports them and its metadata lists them.

The environment is a real venv (``python -m venv --without-pip``) and the shared folder
a real ``pip install --target`` layout: a package folder and its ``*.dist-info``. What
CI's py310/py312/py313 environments prove end to end (torch imports its CUDA libraries
through the links and ``pip check`` passes) needs the 2.7 GB download; this is the
linking alone, on every run.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import wheelhouse  # noqa: E402

sys.path.remove(str(TOOLS))


def make_shared(root: Path) -> Path:
    shared = root / "shared-0123456789abcdef"
    pkg = shared / "nvidia" / "fake" / "lib"
    pkg.mkdir(parents=True)
    (pkg / "libfake.so.1").write_bytes(b"\x7fELF not really")
    (shared / "nvidia" / "fake" / "__init__.py").write_text("ANSWER = 42\n")
    info = shared / "nvidia_fake-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-fake\nVersion: 1.2.3\n")
    (info / "RECORD").write_text("")
    return shared


def run_in(env: Path, code: str) -> str:
    r = subprocess.run(
        [str(env / "bin" / "python"), "-I", "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def env(tmp_path):
    path = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(path)
    return path


LINK = (
    "import sys; sys.path.insert(0, {tools!r}); import wheelhouse; "
    "from pathlib import Path; wheelhouse.link_shared(Path({shared!r}))"
)


def test_linked_distributions_import_and_are_listed(tmp_path, env):
    shared = make_shared(tmp_path)
    run_in(env, LINK.format(tools=str(TOOLS), shared=str(shared)))
    out = run_in(
        env,
        "import importlib.metadata as m, nvidia.fake as f, os; "
        "print(m.version('nvidia-fake'), f.ANSWER, "
        "os.path.realpath(os.path.dirname(f.__file__)))",
    )
    version, answer, where = out.split()
    assert (version, answer) == ("1.2.3", "42")
    assert where == str((shared / "nvidia" / "fake").resolve())


def test_linking_twice_is_harmless_and_never_overwrites_a_real_folder(tmp_path, env):
    shared = make_shared(tmp_path)
    code = LINK.format(tools=str(TOOLS), shared=str(shared))
    run_in(env, code)
    run_in(env, code)  # again: the links are there, nothing changes
    site = Path(run_in(env, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    assert (site / "nvidia").is_symlink()
    (site / "nvidia").unlink()
    (site / "nvidia").mkdir()  # an installed package of the same name
    r = subprocess.run(
        [str(env / "bin" / "python"), "-I", "-c", code], capture_output=True, text=True
    )
    assert r.returncode != 0 and "exists and is not a link" in r.stderr
    assert (site / "nvidia").is_dir() and not (site / "nvidia").is_symlink()


@pytest.mark.parametrize(
    ("name", "shared"),
    [
        ("nvidia-cublas", True),
        ("nvidia_cudnn_cu13", True),
        ("cuda-toolkit", True),
        ("cuda-bindings", False),  # built per interpreter (cp310, cp312, ...)
        ("torch", False),
        ("triton", False),
    ],
)
def test_only_interpreter_independent_distributions_are_shared(name, shared):
    assert wheelhouse.is_shared(name) is shared


def test_pip_options_and_requirements_are_told_apart():
    assert wheelhouse.split(["-U", "torch==2.13.0", "--pre", "numpy>=2.0"]) == (
        ["-U", "--pre"],
        ["torch==2.13.0", "numpy>=2.0"],
    )
