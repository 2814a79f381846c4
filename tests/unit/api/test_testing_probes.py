"""The probes for tests and benchmarks live in memlord._core._testing, out of the
production method table: _core offers what memlord's Python uses, and memlord's
Python never reaches into _testing (docs/architecture.md, "Layout")."""

import pathlib

import memlord
from memlord import _core

PROBES = (
    "busy_epoch",
    "capture_site",
    "capture_sites",
    "cuda_driver",
    "cuda_standin",
    "device_getter_cleared",
    "log_info",
    "pending_poll_age",
    "safe_point",
    "set_cache_type",
    "sites_info",
)


def test_probes_are_in_testing_only():
    t = _core._testing
    assert t.__name__ == "memlord._core._testing"
    assert "not API" in t.__doc__
    assert sorted(n for n in vars(t) if not n.startswith("__")) == sorted(PROBES)
    for name in PROBES:
        assert not hasattr(_core, name) and not hasattr(_core, "_" + name), name
        # bound to _core, whose module state they read
        assert getattr(t, name).__self__ is _core, name


def test_probes_read_cores_state():
    stacks, locs, raw, resolved, missed, slow = _core._testing.sites_info()
    assert min(stacks, locs, raw, resolved, missed, slow) >= 0
    epoch = _core._testing.busy_epoch(0)
    assert _core._testing.busy_epoch(0) == epoch  # adding 0 changes nothing
    assert _core._testing.safe_point() is None
    worked_out, watched = _core._testing.log_info()
    assert worked_out >= 0 and isinstance(watched, bool)


def test_memlords_python_does_not_use_testing():
    root = pathlib.Path(memlord.__file__).parent
    users = [p for p in root.rglob("*.py") if "_testing" in p.read_text(encoding="utf-8")]
    assert users == []
