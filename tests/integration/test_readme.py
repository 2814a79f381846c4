"""The README's two commands, copied as they are, in a fresh virtual environment from a
fresh clone.

The commands are read from README.md's "Two commands" block, so this test breaks when the
README changes in a way that no longer works. A fresh clone (`git clone` of this
repository at HEAD into a temporary folder: committed work only) gets a fresh virtual
environment (`python -m venv`, nothing in it but what venv installs), and then, in the
clone's root, with the environment's `bin/` first on PATH as after `activate`:

* the demo command runs verbatim (`pip install torch==2.13.0 && pip install -e . &&
  python -m memlord`): it downloads (or takes from pip's cache) torch and the build
  tools, builds memlord and runs the demo from the root of the clone, which is where a
  source folder without a build would shadow an installed memlord;
* `python -m pytest` then runs one test file from the clone's root, against that build;
* the test command (`pip install tox && tox`) runs verbatim up to its last word: `pip
  install tox` as written, then `tox` itself is checked rather than run. Running it here
  would run tox inside tox (this test is part of what `tox` runs) and repeat the whole
  CI, some ten minutes, inside CI. What the word `tox` does in the clone's root is
  checked instead: it is the tox just installed (`tox --version`), and it selects
  exactly the environments CI runs (`tox -l`: asan, py, py310, py312, py313, torture,
  lint); `.ci/run` runs the same
  `tox` with no arguments. The environments themselves are what CI has just run.

The fresh clone needs PyPI (pip installs torch, setuptools, numpy and tox): that test is
marked `slow` and `network`: `tox -e release` runs it, before a release; `tox` (what CI
runs) leaves it out.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 1200  # one pip install of torch on a slow, shared machine


def two_commands(readme: str) -> tuple[str, str]:
    """The demo and the test command, verbatim, from the "Two commands" section."""
    section = readme.split("\n## Two commands\n", 1)
    assert len(section) == 2, "README.md has no '## Two commands' section"
    block = re.search(r"```bash\n(.*?)```", section[1], re.S)
    assert block is not None, "the 'Two commands' section has no bash block"
    lines = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines()]
    lines = [ln for ln in lines if ln]
    assert len(lines) == 2, f"expected two commands, got {lines}"
    return lines[0], lines[1]


def test_two_commands_are_read_from_the_readme():
    demo, tests = two_commands((REPO / "README.md").read_text())
    assert demo.endswith("python -m memlord")
    assert tests.split("&&")[-1].strip() == "tox"


def user_env(venv: Path) -> dict[str, str]:
    """The environment of a user who activated venv: nothing of the test run's own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "ASAN_", "LSAN_", "UBSAN_", "MEMLORD_", "TOX_"))
        and k not in ("LD_PRELOAD", "VIRTUAL_ENV", "DEBUG", "NO_COLOR", "FORCE_COLOR")
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    return env


def sh(command: str, *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash is not None, "the README's commands are bash"
    return subprocess.run(
        [bash, "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )


def built_core(checkout: Path) -> list[Path]:
    """The compiled extensions in a checkout's memlord/ (not the committed _core.pyi)."""
    return [
        f
        for f in (checkout / "memlord").glob("_core*")
        if any(f.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES)
    ]


def test_built_core_sees_extensions_not_the_stub(tmp_path):
    """A fresh clone holds memlord/_core.pyi (the stub is committed): the test above read
    it as a build and failed in `tox -e release` on every clean clone."""
    (tmp_path / "memlord").mkdir()
    (tmp_path / "memlord" / "_core.pyi").write_text("")
    assert built_core(tmp_path) == []
    so = tmp_path / "memlord" / f"_core{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    so.write_bytes(b"")
    assert built_core(tmp_path) == [so]


@pytest.mark.slow
@pytest.mark.network
def test_readme_two_commands_in_a_fresh_venv_from_a_fresh_clone(tmp_path):
    if not (REPO / ".git").exists():
        if os.environ.get("CI"):
            pytest.fail(f"{REPO} is not a git checkout: nothing to clone")
        pytest.skip("needs a git checkout to clone")
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    subprocess.run(
        ["git", "clone", "--quiet", str(REPO), str(clone)],
        check=True,
        timeout=STEP_TIMEOUT_S,
    )
    assert not built_core(clone), "a fresh clone has no build"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=STEP_TIMEOUT_S)
    env = user_env(venv)
    demo, tests = two_commands((clone / "README.md").read_text())

    r = sh(demo, cwd=clone, env=env)
    assert r.returncode == 0, f"{demo}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert f"memlord {read_version(clone)} | torch 2.13.0" in r.stdout
    assert "top allocation site:" in r.stdout
    assert built_core(clone), "the build is beside the sources"

    # The test suite runs from the clone's root against that build.
    r = sh(
        "pip install -q pytest && python -m pytest -q -p no:cacheprovider "
        "tests/unit/core/test_format_bytes.py",
        cwd=clone,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^\d+ passed", r.stdout, re.M), r.stdout[-3000:]

    # The test command, verbatim up to its last word (see the module docstring).
    *installs, last = [part.strip() for part in tests.split("&&")]
    assert last == "tox"
    for part in installs:
        r = sh(part, cwd=clone, env=env)
        assert r.returncode == 0, f"{part}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    r = sh("command -v tox && tox --version", cwd=clone, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(venv / "bin" / "tox")
    r = sh("tox -l", cwd=clone, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["asan", "py", "py310", "py312", "py313", "torture", "lint"]
    code = [ln.split("#", 1)[0].strip() for ln in (clone / ".ci" / "run").read_text().splitlines()]
    ci = [ln for ln in code if ln.startswith('"$PYTHON" -m tox')]
    assert ci == ['"$PYTHON" -m tox'], ci  # CI runs exactly `tox`, no arguments


def read_version(clone: Path) -> str:
    match = re.search(r'^version = "([^"]+)"', (clone / "pyproject.toml").read_text(), re.M)
    assert match is not None
    return match.group(1)
