"""Every public entry point leaves the reference counts of its caller's code object and frame
unchanged: a call site must never keep (or leak) a reference to the code that called.

Each entry point runs in a driver function generated from source (a file of its own under
the tests folder, so its frames are user code), which reads its own frame's and code
object's counts before and after many calls.  A leak of one reference per call shows as
hundreds.
"""

import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from memlord import MemLord

N = 200

DRIVER = """
import sys

def drive(env, n):
    lord, t, m, x = env["lord"], env["t"], env["m"], env["x"]
    frame = sys._getframe()
    code = frame.f_code
    for _ in range(2):  # warm: first calls fill caches
{body}
    before = (sys.getrefcount(frame), sys.getrefcount(code))
    for _ in range(n):
{body}
    after = (sys.getrefcount(frame), sys.getrefcount(code))
    return before, after
"""

# (name, setup: "" a plain lord, "python"/"torch" its hooks, "events" its event ring,
# "modules" track_modules on m; body: statements at the driver's loop level)
ENTRIES = [
    ("allocate", "", "lord.allocate(t)"),
    ("free", "", "lord.free(t)"),
    ("allocate_free", "", "lord.allocate(t); lord.free(t)"),
    ("allocate_free_module", "", "lord.allocate(m); lord.free(m)"),
    ("allocate_free_list", "", "lord.allocate([t, x]); lord.free([t, x])"),
    (
        "allocate_bad",
        "",
        "try:\n            lord.allocate([t, 'x'])\n        except TypeError:\n            pass",
    ),
    ("allocated", "", "lord.allocated(); lord.allocated('cpu')"),
    ("freed", "", "lord.freed(); lord.freed('cpu')"),
    ("stats", "", "lord.stats()"),
    ("top_sites", "", "lord.top_alloc_site(); lord.top_free_site()"),
    ("reset", "", "lord.reset()"),
    ("auto_gc", "", "lord.set_auto_gc(None); lord.auto_gc_bytes"),
    ("callsite_switch", "", "lord.set_callsite_tracking(True); lord.track_callsite"),
    ("memory_api", "", "lord.memory_allocated(); lord.memory_stats(); lord.memory_summary()"),
    ("memory_peaks", "", "lord.max_memory_allocated(); lord.reset_peak_memory_stats()"),
    ("drift", "", "lord.drift('cpu')"),
    ("region", "", "with lord.region('r'):\n            lord.allocate(t); lord.free(t)"),
    ("regions", "", "lord.regions(clear=True)"),
    (
        "profile_memory",
        "",
        "with lord.profile_memory():\n            lord.allocate(t); lord.free(t)",
    ),
    ("events", "events", "lord.allocate(t); lord.free(t); lord.events(clear=True)"),
    ("decode_events", "events", "lord.allocate(t); lord.decode_events(lord.events(clear=True))"),
    ("event_decoders", "events", "lord.event_kind(0); lord.event_site(1); lord.event_device(0)"),
    ("python_factory", "python", "torch.zeros(4)"),
    ("python_conversion", "python", "t.to(torch.float64); t.half()"),
    ("python_module_to", "python", "m.to(torch.float64); m.to(torch.float32)"),
    ("python_allocate", "python", "y = torch.ones(3); lord.allocate(y); lord.free(y)"),
    ("python_snapshot", "python", "lord.snapshot()"),
    ("python_leak_check", "python", "with lord.leak_check():\n            pass"),
    ("python_step_growth", "python", "lord.step(); lord.growth()"),
    ("torch_factory", "torch", "torch.zeros(4)"),
    ("torch_conversion", "torch", "t.to(torch.float64); t.half()"),
    ("torch_poll", "torch", "env['h'].poll(); env['h'].pending()"),
    ("track_modules", "modules", "m(torch.ones(2, 4, requires_grad=True)).sum().backward()"),
]


def _env(setup):
    lord = MemLord(auto_gc_bytes=None)
    env = {
        "lord": lord,
        "t": torch.ones(16),
        "m": nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        "x": np.zeros(8),
    }
    if setup == "python":
        env["h"] = lord.hook_into_python()
    elif setup == "torch":
        env["h"] = lord.hook_into_torch()
    elif setup == "events":
        lord.record_events(1024)
    elif setup == "modules":
        env["h"] = lord.track_modules(env["m"])
    return env


def _driver(body, tmp_name):
    lines = "\n".join("        " + ln if i == 0 else ln for i, ln in enumerate(body.split("\n")))
    src = DRIVER.format(body=lines)
    ns: dict = {"torch": torch}
    exec(compile(src, tmp_name, "exec"), ns)
    return ns["drive"]


@pytest.mark.parametrize(("name", "setup", "body"), ENTRIES, ids=[e[0] for e in ENTRIES])
def test_caller_code_and_frame_refcounts_unchanged(name, setup, body):
    env = _env(setup)
    try:
        drive = _driver(body, os.path.join(os.path.dirname(__file__), f"_driver_{name}.py"))
        slow = ("snapshot", "leak_check", "growth", "backward")
        n = 40 if any(w in body for w in slow) else N
        before, after = drive(env, n)
        assert after == before, f"{name}: (frame, code) refcounts {before} -> {after}"
        if setup == "":
            # something was recorded at the driver's line, so the sites were live
            assert "lord.allocate(t)" not in body or lord_has_site(env["lord"])
    finally:
        h = env.get("h")
        if h is not None:
            h.disable()


def lord_has_site(lord):
    return lord.top_alloc_site() is not None or lord.top_free_site() is not None


def test_export_leaves_the_callers_refcounts(tmp_path):
    env = _env("events")
    drive = _driver(
        "lord.allocate(t); lord.export(env['path']); lord.free(t)",
        os.path.join(os.path.dirname(__file__), "_driver_export.py"),
    )
    env["path"] = str(tmp_path / "p.json")
    before, after = drive(env, 10)
    assert after == before


def test_site_captured_in_a_library_leaves_both_frames(tmp_path):
    """A site in library code walks on to the user's frame: neither the library
    function's code object nor the user's frame and code gain references."""
    lib = tmp_path / "lib" / "python3" / "site-packages" / "fakelib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("def make(torch):\n    return torch.zeros(3)\n")
    sys.path.insert(0, str(lib.parent))
    try:
        import fakelib

        env = _env("python")
        env["fakelib"] = fakelib
        drive = _driver(
            "env['fakelib'].make(torch)",
            os.path.join(os.path.dirname(__file__), "_driver_lib.py"),
        )
        lib_code = fakelib.make.__code__
        lib_before = sys.getrefcount(lib_code)
        before, after = drive(env, N)
        assert after == before
        assert sys.getrefcount(lib_code) == lib_before
        env["h"].disable()
    finally:
        sys.path.remove(str(lib.parent))
        sys.modules.pop("fakelib", None)
