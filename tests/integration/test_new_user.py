"""What a new user runs and reads before they trust memlord.

* `import memlord` where no C extension is built says exactly what to run;
* `python -m memlord --version`;
* the types users annotate with are exported, and a strategy kept in an annotated variable
  passes mypy (a wrong one does not);
* the project metadata builds without setuptools' deprecation warnings;
* upstream MemLord habits (`MemLord(strategy)`, `auto_gc_strategy=...`) and a readable DEBUG
  log through `logging`.

The README's two commands, run verbatim from a fresh clone, are in test_readme.py.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from conftest import fake_cuda

import memlord
from memlord import MemLord

PACKAGE = Path(memlord.__file__).resolve().parent  # the memlord under test
REPO = Path(__file__).resolve().parents[2]  # this checkout (for pyproject.toml)
TIMEOUT_S = 180


def run(args, *, cwd, env_extra=None, drop=("DEBUG", "NO_COLOR", "FORCE_COLOR")):
    """Run this interpreter in cwd, with cwd first on sys.path as for any user (no
    PYTHONSAFEPATH): the point is which memlord folder a user's Python finds."""
    env = dict(os.environ)
    for k in ("PYTHONSAFEPATH", "PYTHONPATH", *drop):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# `python -P`: never the source tree of the working directory first (CPython 3.11 and later;
# 3.10 has no such option, and these tests' working directories hold no memlord anyway)
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

# An editable install of memlord (`pip install -e .`) adds a finder after the path-based
# one that would serve its own built _core to any memlord package: drop it, so the copy
# in the working directory is seen as a user without that install sees it.
UNBUILT = (
    "import sys; sys.meta_path[:] = "
    "[f for f in sys.meta_path if not getattr(f, '__module__', '').startswith('__editable__')]\n"
)


def copy_package_without_core(dest: Path) -> Path:
    """memlord's Python files, without any compiled _core, in dest/memlord."""
    pkg = dest / "memlord"
    pkg.mkdir(parents=True)
    for f in PACKAGE.iterdir():
        if f.is_file() and f.suffix in (".py", ".pyi", ".typed"):
            shutil.copy(f, pkg / f.name)
    return pkg


def make_checkout(root: Path) -> Path:
    """A source-checkout layout: memlord/ without a build, pyproject.toml, setup.py, src/."""
    pkg = copy_package_without_core(root)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "setup.py", root / "setup.py")
    (root / "src").mkdir()
    return pkg


# ----------------------------------------------------------------- import without a build


def test_import_from_an_unbuilt_checkout_says_exactly_what_to_run(tmp_path):
    """The ImportError says the C extension is not built and the exact command to build
    it, not 'cannot import name _core ... (most likely due to a circular import)'."""
    make_checkout(tmp_path)
    r = run(["-c", UNBUILT + "import memlord"], cwd=tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()
    assert any(line.startswith("ImportError: memlord's C extension is not built") for line in last)
    assert f"    cd {tmp_path} && {sys.executable} -m pip install -e ." in last
    assert "circular import" not in r.stderr  # the misleading cause is not chained


def test_python_m_memlord_from_an_unbuilt_checkout_says_what_to_run(tmp_path):
    make_checkout(tmp_path)
    main = "import runpy; runpy.run_module('memlord', run_name='__main__')"  # python -m memlord
    r = run(["-c", UNBUILT + main], cwd=tmp_path)
    assert r.returncode != 0
    assert "-m pip install -e ." in r.stderr
    assert "circular import" not in r.stderr


def test_installed_package_without_core_says_reinstall(tmp_path):
    copy_package_without_core(tmp_path)  # no pyproject.toml/setup.py: not a checkout
    r = run(["-c", UNBUILT + "import memlord"], cwd=tmp_path)
    assert r.returncode != 0
    assert f"{sys.executable} -m pip install --force-reinstall --no-deps memlord" in r.stderr


def test_a_core_built_for_another_python_is_named(tmp_path):
    pkg = make_checkout(tmp_path)
    (pkg / "_core.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")
    r = run(["-c", UNBUILT + "import memlord"], cwd=tmp_path)
    assert r.returncode != 0
    assert "only _core.cpython-39-x86_64-linux-gnu.so, built for another Python" in r.stderr


def test_a_core_that_fails_to_load_keeps_its_own_error(tmp_path):
    """A _core for this interpreter that cannot be loaded is a real error: it is not
    replaced by build advice."""
    import importlib.machinery

    pkg = make_checkout(tmp_path)
    (pkg / ("_core" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_bytes(b"not an ELF")
    r = run(["-c", UNBUILT + "import memlord"], cwd=tmp_path)
    assert r.returncode != 0
    assert "ImportError" in r.stderr
    assert "not built" not in r.stderr


# ----------------------------------------------------------------------------- --version


@pytest.mark.parametrize("old", ["2.1.2", "2.9.1+cu128"])
def test_an_older_torch_than_memlord_supports_is_named_with_what_to_install(tmp_path, old):
    """memlord crashed in lifetime tracking on torch 2.1 and fails its tests on releases
    before 2.10: on one, ``import memlord`` says which torch it found and what to install,
    before anything of memlord's runs. The child stands a real torch in for the old one
    (its version string set: no older torch can be installed where the tests run; the
    message was checked by hand on a real torch 2.9.1)."""
    from memlord._nocore import TORCH_MIN

    code = f"import torch; torch.__version__ = {old!r}; import memlord"
    r = run([*SAFE_PATH, "-c", code], cwd=tmp_path)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    want = ".".join(map(str, TORCH_MIN))
    assert last.startswith(f"ImportError: memlord needs torch {want} or newer;"), r.stderr
    assert f"this Python has torch {old} (" in last
    assert f"-m pip install 'torch>={want}'" in last
    assert "_core" not in r.stderr  # nothing of memlord's ran


@pytest.mark.parametrize("newer", ["2.10.0", "2.10.0a0+gitabc", "2.14.1+cu130", "3.0.0", "dev"])
def test_a_supported_or_unreadable_torch_version_imports(tmp_path, newer):
    code = f"import torch; torch.__version__ = {newer!r}; import memlord; print('ok')"
    r = run([*SAFE_PATH, "-c", code], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_python_m_memlord_version(tmp_path):
    r = run([*SAFE_PATH, "-m", "memlord", "--version"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"memlord {memlord.__version__}\n"
    assert memlord.__version__ == "0.1.0"
    r = run([*SAFE_PATH, "-m", "memlord", "--help"], cwd=tmp_path)
    assert "--version" in r.stdout


# ---------------------------------------------------------------------------------- types

TYPE_NAMES = {
    "AutoGCBand",
    "AutoGCMetric",
    "AutoGCStrategy",
    "AutoGCThreshold",
    "CapacitySource",
    "DeviceStats",
}


def test_annotation_types_are_exported():
    import torch

    assert TYPE_NAMES <= set(memlord.__all__)
    assert memlord.AutoGCBand.__required_keys__ == frozenset({"metric", "threshold"})
    assert memlord.AutoGCThreshold.__optional_keys__ == frozenset({"bytes", "percent"})
    assert memlord.AutoGCThreshold.__required_keys__ == frozenset()
    lord = MemLord()
    lord.allocate(torch.ones(1))
    assert memlord.DeviceStats.__required_keys__ == frozenset(lord.stats()["cpu"])


def test_the_stub_exports_what_the_package_exports():
    """__init__.pyi and __init__.py list the same public names."""
    tree = ast.parse((PACKAGE / "__init__.pyi").read_text())
    stub_all = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    )
    assert sorted(stub_all) == sorted(memlord.__all__)
    assert all(hasattr(memlord, name) for name in memlord.__all__)


def test_default_strategy_has_the_shape_of_the_exported_types():
    strategy = MemLord(auto_gc_strategy=None).auto_gc_strategy
    assert strategy
    for key, band in strategy.items():
        assert isinstance(key, tuple) and len(key) == 2
        assert set(band) == memlord.AutoGCBand.__required_keys__
        assert band["metric"] in memlord.AutoGCMetric.__args__
        assert set(band["threshold"]) <= memlord.AutoGCThreshold.__optional_keys__


MYPY_CONFIG = """\
# memlord's stubs are what is checked; torch's and numpy's own types are not
[mypy-torch.*]
follow_imports = skip
[mypy-numpy.*]
follow_imports = skip
[mypy]
strict = True
incremental = False
"""


def mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """mypy on a snippet, against the stubs of the memlord under test. They are copied to
    a folder on mypy's path: an editable install's import hook is invisible to mypy."""
    pytest.importorskip("mypy", reason="mypy is in tox's deps and the 'test' extra")
    assert (PACKAGE / "py.typed").exists() and (PACKAGE / "__init__.pyi").exists()
    copy_package_without_core(tmp_path / "typed")
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG + f"mypy_path = {tmp_path / 'typed'}\n")
    (tmp_path / "snippet.py").write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # mypy loads no memlord C
    env.pop("PYTHONMALLOC", None)
    return subprocess.run(
        [sys.executable, *SAFE_PATH, "-m", "mypy", "--config-file", "mypy.ini", "snippet.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_mypy_accepts_a_strategy_kept_in_an_annotated_variable(tmp_path):
    r = mypy(
        tmp_path,
        """
        import memlord
        from memlord import AutoGCBand, AutoGCStrategy, AutoGCThreshold, DeviceStats, MemLord

        low: AutoGCThreshold = {"percent": 60.0}
        band: AutoGCBand = {"metric": "max", "threshold": low}
        strategy: AutoGCStrategy = {
            (0, 50): band,
            (50, 101): {"metric": "freed", "threshold": {"bytes": 2 << 30, "percent": 20.0}},
        }
        lord = MemLord(auto_gc_strategy=strategy)
        lord.set_auto_gc_strategy(strategy)
        current: AutoGCStrategy | None = lord.auto_gc_strategy
        cpu: DeviceStats = lord.stats()["cpu"]
        source: memlord.CapacitySource = lambda dev: (100, 50)
        lord.set_capacity_source(source)
        """,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_rejects_a_wrong_strategy(tmp_path):
    """The check can fail: a wrong metric, a missing threshold, an unannotated dict."""
    r = mypy(
        tmp_path,
        """
        from memlord import AutoGCStrategy, MemLord

        wrong: AutoGCStrategy = {(0, 50): {"metric": "avg", "threshold": {"percent": 60.0}}}
        missing: AutoGCStrategy = {(0, 50): {"metric": "max"}}
        plain = {(0, 50): {"metric": "max", "threshold": {"percent": 60.0}}}
        MemLord(auto_gc_strategy=plain)
        """,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "snippet.py:4: error" in r.stdout  # metric "avg"
    assert "snippet.py:5: error" in r.stdout  # no threshold
    assert "snippet.py:7: error" in r.stdout  # a plain dict of dicts


# ------------------------------------------------------------------------------ metadata


def test_project_metadata_has_no_setuptools_deprecation():
    """`license` is an SPDX string (a TOML table is deprecated by setuptools, and stops
    building after 2027-02-18); reading pyproject.toml warns about nothing."""
    pytest.importorskip("setuptools", reason="in tox's deps")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    if not (REPO / "pyproject.toml").exists():
        pytest.skip("needs the source checkout's pyproject.toml")
    cwd = os.getcwd()
    os.chdir(REPO)  # license-files are resolved from the project root
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    finally:
        os.chdir(cwd)
    assert dist.metadata.license_expression == "MIT"
    assert "LICENSE" in dist.metadata.license_files


# ------------------------------------------------------- upstream habits (the Python face)

STRATEGY = {
    (0, 50): {"metric": "max", "threshold": {"percent": 60.0}},
    (50, 101): {"metric": "freed", "threshold": {"bytes": 2048}},
}


def test_a_dict_as_first_positional_argument_is_the_strategy():
    """Upstream MemLord's first positional argument is the strategy."""
    lord = MemLord(STRATEGY)
    assert lord.auto_gc_strategy == STRATEGY
    assert lord.auto_gc_bytes is None


def test_ellipsis_strategy_is_the_default_help_shows():
    """help(MemLord) shows auto_gc_strategy=...; passing it is the same as not passing it."""
    default = inspect.signature(MemLord).parameters["auto_gc_strategy"].default
    assert default is ...
    lord = MemLord(auto_gc_strategy=...)
    assert lord.auto_gc_strategy is None  # bytes mode, "auto"
    assert repr(lord) == repr(MemLord())


def test_auto_gc_line_is_an_info_record_not_printed(caplog, capsys):
    caplog.set_level(logging.INFO, logger="memlord")
    lord = MemLord(auto_gc_bytes=1000)
    t = fake_cuda(1000, 0)
    lord.allocate(t)
    lord.free(t)
    assert lord.gc_runs == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    records = [r for r in caplog.records if r.name == "memlord" and "auto_gc" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO


DEBUG_SCRIPT = """\
import torch
from memlord import MemLord

lord = MemLord(auto_gc_bytes=None)
t = torch.zeros(3, 4)
lord.allocate(t)
"""


def test_debug_log_is_one_readable_line_per_event(tmp_path):
    """DEBUG=1: one line on stderr for one allocate, with the script's path relative to
    the working directory, the tensor (shape, dtype), the bytes and the device's total;
    no escape codes when stderr is not a terminal; nothing on stdout."""
    (tmp_path / "train.py").write_text(DEBUG_SCRIPT)
    r = run([*SAFE_PATH, "train.py"], cwd=tmp_path, env_extra={"DEBUG": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert "train.py:6" in line and str(tmp_path) not in line
    assert "float32" in line and "3, 4" in line
    assert "48 B" in line
    assert "\x1b[" not in line


def test_debug_log_colors_follow_force_color_and_no_color(tmp_path):
    (tmp_path / "train.py").write_text(DEBUG_SCRIPT)
    forced = run(
        [*SAFE_PATH, "train.py"], cwd=tmp_path, env_extra={"DEBUG": "1", "FORCE_COLOR": "1"}
    )
    assert "\x1b[" in forced.stderr
    plain = run(
        [*SAFE_PATH, "train.py"],
        cwd=tmp_path,
        env_extra={"DEBUG": "1", "FORCE_COLOR": "1", "NO_COLOR": "1"},
    )
    assert plain.stderr and "\x1b[" not in plain.stderr
    assert forced.stdout == plain.stdout == ""


# ------------------------------------- docs/coming-from-memlord.md: memlord's side, checked


def band(metric="max", **threshold):
    return {"metric": metric, "threshold": threshold or {"percent": 10.0}}


@pytest.mark.parametrize(
    "strategy, error",
    [
        ({(0, 60): band(), (50, 101): band()}, ValueError),  # overlapping
        ({(0, 102): band()}, ValueError),
        ({(50, 50): band()}, ValueError),
        ({(-5, 10): band()}, ValueError),
        ({(True, 50): band()}, TypeError),
        ({(0, float("nan")): band()}, ValueError),
        ({(0, 50): {**band(), "note": 1}}, ValueError),  # extra key in a band
        ({(0, 50): band(percent=10.0, min=3)}, ValueError),  # extra key in a threshold
        ({(0, 50): band(percent=100.5)}, ValueError),
        ({(0, 50): band(percent=-1.0)}, ValueError),
        ({(0, 50): band(bytes=2e9)}, TypeError),
        ({(0, 50): band(bytes=True)}, TypeError),
        ({(0, 50): band(bytes=-1)}, ValueError),
        ({(0, 50): band(bytes=2**63)}, ValueError),
        ({"0-50": band()}, TypeError),  # a key that is not a tuple
        ({(0, 50): band(metric=1)}, TypeError),
        ({(i / 20, (i + 1) / 20): band() for i in range(1025)}, ValueError),
    ],
)
def test_strategies_memlord_rejects_unlike_upstream(strategy, error):
    lord = MemLord(auto_gc_bytes=12345)
    with pytest.raises(error, match="argument 'strategy'"):
        MemLord(auto_gc_strategy=strategy)
    with pytest.raises(error, match="argument 'strategy'"):
        lord.set_auto_gc_strategy(strategy)
    assert lord.auto_gc_bytes == 12345 and lord.auto_gc_strategy is None  # unchanged


def test_a_mapping_that_is_not_a_dict_is_rejected():
    import types

    with pytest.raises(TypeError, match="got mappingproxy"):
        MemLord(auto_gc_strategy=types.MappingProxyType({(0, 50): band()}))


def test_a_zero_threshold_fires_as_soon_as_the_metric_is_above_zero():
    lord = MemLord(auto_gc_strategy={(0, 101): band("freed", bytes=0)})
    lord.set_capacity_source(lambda dev: (1000, 100))
    t = fake_cuda(10, 0)
    lord.allocate(t)
    assert lord.gc_runs == 0  # "freed" is still 0
    lord.free(t)
    assert lord.gc_runs == 1


def test_constructor_defaults_that_differ_from_upstream():
    assert MemLord().auto_gc_strategy is None  # bytes mode, "auto"
    assert "auto" in repr(MemLord())
    off = MemLord(None)
    assert off.auto_gc_strategy is None and off.auto_gc_bytes is None  # auto-GC off
    assert MemLord(auto_gc_strategy=None).auto_gc_strategy == {
        (0, 50): {"metric": "max", "threshold": {"percent": 60.0}},
        (50, 75): {"metric": "max", "threshold": {"percent": 50.0}},
        (75, 101): {"metric": "max", "threshold": {"percent": 40.0}},
    }
    assert MemLord().track_callsite is True
    with pytest.raises(TypeError, match="track_callsite"):
        MemLord(track_callsite=1)


def test_a_gc_run_keeps_live_bytes_and_other_devices():
    """Upstream zeroes allocated and freed of every device of the type; memlord only the
    since-GC counters of the device that ran."""
    lord = MemLord(auto_gc_bytes=100)
    a, b, c = fake_cuda(100, 0), fake_cuda(100, 1), fake_cuda(25, 0)
    lord.allocate([a, b, c])
    lord.free(a)
    assert lord.gc_runs == 1
    assert lord.allocated("cuda:0")[0] == 100 and lord.freed("cuda:0")[0] == 0
    assert lord.allocated("cuda:1")[0] == 400


@pytest.mark.parametrize("module", ["memlord", "memlord.report", "memlord.profiler"])
def test_every_public_name_is_in_the_docs(module: str) -> None:
    """Each name of the module's __all__ appears, as a word, in the pages that document it
    (memlord.report's 23 helper names were in none)."""
    import importlib
    import re

    pages = {
        "memlord": ["api.md"],
        "memlord.report": ["reports.md", "oom.md"],
        "memlord.profiler": ["reports.md"],
    }[module]
    text = "".join((REPO / "docs" / p).read_text() for p in pages)
    names = importlib.import_module(module).__all__
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", text)]
    assert missing == [], f"{module}: not in docs/{', '.join(pages)}"
