"""A call site inside library code (site-packages, the standard library) carries the user's
own line too: hotspots, snapshots, events and reports show ``user.py:12 via lib.py:110``,
and the memory_viz pickle lists the frames with their functions' names.

The library is a real module written to a temporary ``site-packages`` folder."""

import inspect
import pickle
import sys

import pytest
import torch

from memlord import MemLord, _core

LIB = """\
def make(torch, n):
    return torch.zeros(n)


def middle(torch, n, depth):
    if depth:
        return middle(torch, n, depth - 1)
    return make(torch, n)


def convert(lord, t):
    lord.allocate(t)
"""


@pytest.fixture
def fakelib(tmp_path):
    root = tmp_path / "venv" / "lib" / "python3" / "site-packages"
    (root / "fakelib").mkdir(parents=True)
    (root / "fakelib" / "__init__.py").write_text(LIB)
    sys.path.insert(0, str(root))
    try:
        import fakelib

        yield fakelib
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("fakelib", None)


@pytest.fixture
def hooked():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(256)
    h = lord.hook_into_python()
    try:
        yield lord
    finally:
        h.disable()


def _here():
    return inspect.currentframe().f_back.f_lineno


def test_library_site_shows_the_users_line_and_the_library_line(fakelib, hooked):
    keep = fakelib.make(torch, 1000)
    line = _here() - 1
    lib_file = fakelib.__file__
    dev, where, nbytes = hooked.top_alloc_site()
    assert nbytes == 4000
    assert where == f"tests/unit/core/test_site_stacks.py:{line} via {lib_file}:2" or where == (
        f"{__file__}:{line} via {lib_file}:2"
    )
    del keep


def test_stack_frames_and_names(fakelib, hooked):
    keep = fakelib.middle(torch, 10, 1)
    line = _here() - 1
    [site] = {int(r["site"]) for r in hooked.events() if r["bytes"] == 40 and r["kind"] == 0}
    frames, elided = _core._site_stack(site)
    assert [(f[1], f[2], f[3]) for f in frames] == [
        (2, "make", False),
        (8, "middle", False),
        (7, "middle", False),
        (line, "test_stack_frames_and_names", True),
    ]
    assert all(f[0] == fakelib.__file__ for f in frames[:3])
    assert frames[3][0] == __file__
    assert elided is False
    del keep


def test_deep_library_stack_keeps_the_innermost_frames_and_the_user(fakelib, hooked):
    keep = fakelib.middle(torch, 12, 20)
    line = _here() - 1
    [site] = {int(r["site"]) for r in hooked.events() if r["bytes"] == 48 and r["kind"] == 0}
    frames, elided = _core._site_stack(site)
    assert len(frames) == 4
    assert [f[2] for f in frames] == [
        "make",
        "middle",
        "middle",
        "test_deep_library_stack_keeps_the_innermost_frames_and_the_user",
    ]
    assert frames[-1][1] == line and frames[-1][3] is True
    assert elided is True
    del keep


def test_user_code_calling_torch_directly_keeps_one_frame(hooked):
    keep = torch.zeros(7)
    line = _here() - 1
    [site] = {int(r["site"]) for r in hooked.events() if r["bytes"] == 28 and r["kind"] == 0}
    frames, elided = _core._site_stack(site)
    assert frames == (
        (__file__, line, "test_user_code_calling_torch_directly_keeps_one_frame", True),
    )
    assert not elided
    assert hooked.event_site(site).endswith(f"test_site_stacks.py:{line}")
    del keep


def test_explicit_allocate_from_a_library(fakelib):
    lord = MemLord(auto_gc_bytes=None)
    t = torch.ones(5)
    fakelib.convert(lord, t)
    line = _here() - 1
    where = lord.top_alloc_site()[1]
    assert where.endswith(f"test_site_stacks.py:{line} via {fakelib.__file__}:12")


def test_snapshot_and_events_show_both_lines(fakelib, hooked):
    keep = fakelib.make(torch, 333)
    line = _here() - 1
    want = f"test_site_stacks.py:{line} via {fakelib.__file__}:2"
    [entry] = [e for e in hooked.snapshot()["cpu"]["top"] if e["nbytes"] == 1332]
    assert entry["site"].endswith(want)
    sites = {e["site"] for e in hooked.decode_events(hooked.events()) if e["bytes"] == 1332}
    assert len(sites) == 1 and sites.pop().endswith(want)
    del keep


def test_pickle_frames_have_function_names(fakelib, hooked, tmp_path):
    keep = fakelib.middle(torch, 77, 0)
    line = _here() - 1
    path = tmp_path / "m.pickle"
    hooked.export(path)
    snap = pickle.loads(path.read_bytes())
    allocs = [e for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]
    [ev] = [e for e in allocs if e["size"] == 308]
    names = [(f["name"], f["line"]) for f in ev["frames"]]
    assert names == [("make", 2), ("middle", 8), ("test_pickle_frames_have_function_names", line)]
    assert ev["frames"][0]["filename"] == fakelib.__file__
    # every frame the pickle names has a function name
    assert all(f["name"] != "?" for e in allocs for f in e["frames"])
    # the JSON profile keeps them: its pickle is the same
    jpath = tmp_path / "m.json"
    hooked.export(jpath)
    from memlord import report

    doc = report.load(jpath)
    from memlord.report._pickle import to_snapshot

    again = to_snapshot(doc)
    allocs2 = [e for trace in again["device_traces"] for e in trace if e["action"] == "alloc"]
    [ev2] = [e for e in allocs2 if e["size"] == 308]
    assert ev2["frames"] == ev["frames"]
    del keep


def test_stdlib_frames_are_library_code(hooked):
    import functools

    zeros = functools.singledispatch(torch.zeros)  # a Python wrapper in functools.py
    keep = zeros(9)
    line = _here() - 1
    [site] = {
        e["site"]
        for e in hooked.decode_events(hooked.events())
        if e["bytes"] == 36 and e["kind"] == "alloc"
    }
    user, lib = site.split(" via ")
    assert user.endswith(f"test_site_stacks.py:{line}")
    assert lib.startswith(functools.__file__ + ":")
    del keep


def test_old_pickle_site_text_without_frames_table():
    from memlord.report._pickle import _frames

    assert _frames("a.py:3") == [{"filename": "a.py", "line": 3, "name": "?"}]
    assert _frames("u.py:1 via lib.py:9") == [
        {"filename": "lib.py", "line": 9, "name": "?"},
        {"filename": "u.py", "line": 1, "name": "?"},
    ]
