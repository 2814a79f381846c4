"""Hotspots: top_alloc_site()/top_free_site() name the user's own line, cumulative per site."""

import os
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import fake_cuda, here
from support import warm
from torch import nn

from memlord._sites import relative_path

HERE = relative_path(__file__)  # sites are shown relative to the working directory

CPU = torch.device("cpu")


def test_none_before_anything(lord):
    assert lord.top_alloc_site() is None
    assert lord.top_free_site() is None
    assert lord.top_alloc_site("cuda") is None


def test_alloc_site_is_this_line(lord):
    t = torch.empty(100)
    line = here() + 1
    lord.allocate(t)
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 400)
    assert lord.top_free_site() is None


def test_free_site_is_this_line(lord):
    t = torch.empty(100)
    lord.allocate(t)
    line = here() + 1
    lord.free(t)
    assert lord.top_free_site() == (CPU, f"{HERE}:{line}", 400)


def test_site_result_types(lord):
    lord.allocate(np.zeros(8))
    dev, site, nbytes = lord.top_alloc_site()
    assert type(dev) is torch.device and dev == CPU
    assert type(site) is str and type(nbytes) is int


def test_sites_are_cumulative_and_biggest_wins(lord):
    small, big = torch.empty(10), torch.empty(25)
    for _ in range(3):
        loop_line = here() + 1
        lord.allocate(small)
    big_line = here() + 1
    lord.allocate(big)
    # 3 x 40 = 120 from the loop line beats 100 from the single call
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{loop_line}", 120)
    big_line2 = here() + 1
    lord.allocate(big)
    assert big_line2 != big_line
    assert lord.top_alloc_site()[2] == 120
    for _ in range(2):
        big_line3 = here() + 1
        lord.allocate(big)
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{big_line3}", 200)


def test_sites_taking_turns_keep_their_own_bytes(lord):
    """Three sites taking turns in a loop (more than the site table's recent-id
    cache holds), each with its own bytes; and the births and deaths of a factory
    loop, on two lines, counted per line."""
    from memlord.report._source import lord_hotspots

    a, b, c = torch.empty(1), torch.empty(2), torch.empty(4)
    for _ in range(5):
        la = here() + 1
        lord.allocate(a)
        lb = here() + 1
        lord.allocate(b)
        lc = here() + 1
        lord.allocate(c)
    with lord.hook_into_python():
        for _ in range(3):
            born = here() + 1
            t = torch.empty(8)
            died = here() + 1
            del t
    got = {(h["kind"], h["site"]): h["bytes"] for h in lord_hotspots(lord, limit=20)}
    assert got == {
        ("alloc", f"{HERE}:{la}"): 20,
        ("alloc", f"{HERE}:{lb}"): 40,
        ("alloc", f"{HERE}:{lc}"): 80,
        ("alloc", f"{HERE}:{born}"): 96,
        ("free", f"{HERE}:{died}"): 96,
    }


def test_site_bytes_count_deduplicated_storages(lord):
    base = torch.empty(50)
    line = here() + 1
    lord.allocate([base, base[1:], base[2:]])
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 200)


def _helper_allocates(lord, obj):
    lord.allocate(obj)
    return here() - 1


def test_site_is_innermost_user_frame(lord):
    line = _helper_allocates(lord, torch.empty(4))
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 16)


def test_torch_frames_are_skipped(lord):
    m = nn.Linear(4, 4)  # no children: apply() calls lord.allocate(m) once, from torch's code
    line = here() + 1
    m.apply(lord.allocate)
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 80)


def test_torch_hook_calling_user_lambda_reports_the_lambda(lord):
    m = nn.Linear(2, 2)
    line = here() + 1
    m.register_forward_hook(lambda mod, inp, out: lord.allocate(out))
    m(torch.ones(1, 2))
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 8)


def test_site_per_device_and_device_filter(lord):
    l0 = here() + 1
    lord.allocate(fake_cuda(100, 0))
    l1 = here() + 1
    lord.allocate(fake_cuda(50, 1))
    lc = here() + 1
    lord.allocate(torch.empty(10))
    assert lord.top_alloc_site() == (torch.device("cuda", 0), f"{HERE}:{l0}", 400)
    assert lord.top_alloc_site("cuda:1") == (torch.device("cuda", 1), f"{HERE}:{l1}", 200)
    assert lord.top_alloc_site(torch.device("cuda", 1))[0] == torch.device("cuda:1")
    assert lord.top_alloc_site("cuda") == (torch.device("cuda", 0), f"{HERE}:{l0}", 400)
    assert lord.top_alloc_site("cpu") == (CPU, f"{HERE}:{lc}", 40)
    assert lord.top_alloc_site("cuda:5") is None
    assert lord.top_free_site("cuda") is None


def test_one_call_on_two_devices_records_a_site_per_device(lord):
    line = here() + 1
    lord.allocate([fake_cuda(10, 0), torch.empty(20)])
    assert lord.top_alloc_site("cuda:0") == (torch.device("cuda:0"), f"{HERE}:{line}", 40)
    assert lord.top_alloc_site("cpu") == (CPU, f"{HERE}:{line}", 80)


def test_free_site_counts_requested_bytes_even_when_clamped(lord):
    line = here() + 1
    lord.free(torch.empty(10))
    assert lord.top_free_site() == (CPU, f"{HERE}:{line}", 40)


def test_reset_clears_sites(lord):
    t = torch.empty(3)
    lord.allocate(t)
    lord.free(t)
    lord.reset()
    assert lord.top_alloc_site() is None
    assert lord.top_free_site() is None
    line = here() + 1
    lord.allocate(t)
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 12)


def test_nothing_counted_records_no_site(lord):
    lord.allocate(torch.empty(0))
    lord.allocate(torch.empty(5, device="meta"))
    assert lord.top_alloc_site() is None


def test_user_code_in_directories_named_memlord_and_torch(tmp_path):
    # A checkout at .../memlord/... (CI clones into such a path) or a user's folder named
    # "torch" is user code, not the memlord or torch package: the site is the innermost
    # user frame, here a helper in .../torch/examples/helper.py called from
    # .../memlord/tests/train.py.
    helper_dir = tmp_path / "torch" / "examples"
    script_dir = tmp_path / "memlord" / "tests"
    helper_dir.mkdir(parents=True)
    script_dir.mkdir(parents=True)
    (helper_dir / "helper.py").write_text("def track(lord, t):\n    lord.allocate(t)\n")
    script = script_dir / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import sys, torch
            sys.path.insert(0, {str(helper_dir)!r})
            from memlord import MemLord
            import helper
            lord = MemLord(auto_gc_bytes=None)
            lord.allocate(torch.empty(4))
            print(lord.top_alloc_site()[1])
            helper.track(lord, torch.empty(400))
            print(lord.top_alloc_site()[1])
            """
        )
    )
    import memlord

    root = os.path.dirname(os.path.dirname(os.path.abspath(memlord.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.pop("DEBUG", None)
    r = warm.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    # shown relative to the working directory (tmp_path), under which both files lie
    assert r.stdout.split() == ["memlord/tests/train.py:6", "torch/examples/helper.py:2"]


# ---- how a site is read off the stack ---------------------------------------
# On CPython 3.11 to 3.13 the hooks read the interpreter's frames in place (no
# frame object is made for the caller); the layout is checked against the
# public frame API at the first capture.  _testing.capture_sites() returns the capture,
# the same through the public API only, and whether the first read in place.

import sysconfig  # noqa: E402

from memlord import _core  # noqa: E402

DIRECT_EXPECTED = (
    sys.implementation.name == "cpython"
    and (3, 11) <= sys.version_info[:2] <= (3, 13)
    and not sysconfig.get_config_var("Py_GIL_DISABLED")
)


def _line_of(site):
    code, offset = site
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line
    return None


def test_capture_in_place_agrees_with_the_public_frame_api():
    line = here() + 1
    fast, public, direct = _core._testing.capture_sites()
    assert direct is DIRECT_EXPECTED
    assert fast == public
    assert fast[0] is test_capture_in_place_agrees_with_the_public_frame_api.__code__
    assert _line_of(fast) == line


def test_capture_in_a_generator_and_a_coroutine():
    def gen():
        yield _core._testing.capture_sites()

    async def coro():
        return _core._testing.capture_sites()

    fast, public, _ = next(gen())
    assert fast == public and fast[0] is gen.__code__
    c = coro()
    try:
        c.send(None)
    except StopIteration as stop:
        fast, public, _ = stop.value
    assert fast == public and fast[0] is coro.__code__


def test_capture_skips_torch_and_memlord_frames_to_the_callers_line():
    # a function whose code says it lives in torch: an internal frame
    ns = {"_core": _core}
    exec(
        compile(
            "def inner():\n    return _core._testing.capture_sites()\n", torch.__file__, "exec"
        ),
        ns,
    )
    line = here() + 1
    fast, public, _ = ns["inner"]()
    assert fast == public
    assert fast[0] is test_capture_skips_torch_and_memlord_frames_to_the_callers_line.__code__
    assert _line_of(fast) == line


def test_capture_on_a_fresh_thread_and_deep_in_recursion():
    import threading

    out = []

    def deep(n):
        return deep(n - 1) if n else _core._testing.capture_sites()

    th = threading.Thread(target=lambda: out.append(deep(50)))
    th.start()
    th.join()
    fast, public, _ = out[0]
    assert fast == public and fast[0] is deep.__code__


def test_hooked_cast_site_same_with_the_reader_in_place(lord):
    # the site a hook records is the one the public API names
    t = torch.zeros(4)
    with lord.hook_into_torch():
        line = here() + 1
        t.half()
    assert lord.top_alloc_site() == (CPU, f"{HERE}:{line}", 8)


def test_capture_in_place_is_on_for_this_interpreter():
    # CPython 3.11, 3.12 and 3.13 each have their own frame layout: a capture on any
    # of them reads in place once the first capture checked it (the probe above runs
    # the check if nothing captured before)
    _core._testing.capture_sites()
    assert _core._testing.capture_sites()[2] is DIRECT_EXPECTED, sys.version


# The shapes a stack takes between the user's line and the hooked call: frames
# entered from C (3.12 and 3.13 put an entry frame of the C stack there), generators
# and coroutines resumed from C or from other frames, comprehensions (inlined into
# their function from 3.12 on), class bodies, exec'd code, tracing (3.12 and later
# instrument the bytecode in place).  Each must read the same in place as through
# the public API, and name the innermost frame's own code object.


def _via_sorted_key():
    out = []
    sorted([0], key=lambda _: out.append(_core._testing.capture_sites()))
    return out[0], "<lambda>"


def _via_map():
    return list(map(lambda _: _core._testing.capture_sites(), [0]))[0], "<lambda>"


def _via_comprehension():
    return [_core._testing.capture_sites() for _ in range(1)][0], (
        "_via_comprehension" if sys.version_info >= (3, 12) else "<listcomp>"
    )


def _via_nested_generators():
    def inner():
        yield _core._testing.capture_sites()

    def outer():
        yield from inner()

    return list(outer())[0], "inner"


def _via_generator_send():
    def gen():
        got = yield
        yield got, _core._testing.capture_sites()

    g = gen()
    next(g)
    return g.send(1)[1], "gen"


def _via_nested_coroutines():
    import asyncio

    async def inner():
        await asyncio.sleep(0)
        return _core._testing.capture_sites()

    async def outer():
        return await inner()

    return asyncio.run(outer()), "inner"


def _via_class_body():
    class Body:
        got = _core._testing.capture_sites()

    return Body.got, "Body"


def _via_exec():
    ns = {"_core": _core}
    exec("got = _core._testing.capture_sites()", ns)
    return ns["got"], "<module>"


def _via_property_from_c():
    class P:
        @property
        def got(self):
            return _core._testing.capture_sites()

    return P().got, "got"


def _via_torch_frame_from_c():
    # a torch-named function calling back into user code through C (map): the
    # user's lambda is the site, and the walk goes through both kinds of frame
    ns = {}
    exec(compile("def each(f, xs):\n    return list(map(f, xs))\n", torch.__file__, "exec"), ns)
    return ns["each"](lambda _: _core._testing.capture_sites(), [0])[0], "<lambda>"


def _via_c_calling_a_torch_frame():
    # the other way round: user code -> C (map) -> a torch-named function capturing:
    # the walk skips the torch frame and the entry frame C pushed below it
    ns = {"_core": _core}
    exec(
        compile(
            "def each(_):\n    return _core._testing.capture_sites()\n", torch.__file__, "exec"
        ),
        ns,
    )
    return list(map(ns["each"], [0]))[0], "_via_c_calling_a_torch_frame"


def _via_settrace():
    calls = []

    def tracer(frame, event, arg):
        calls.append(event)
        return tracer

    def traced():
        return _core._testing.capture_sites()

    sys.settrace(tracer)
    try:
        got = traced()
    finally:
        sys.settrace(None)
    assert "call" in calls
    return got, "traced"


STACK_SHAPES = [
    _via_sorted_key,
    _via_map,
    _via_comprehension,
    _via_nested_generators,
    _via_generator_send,
    _via_nested_coroutines,
    _via_class_body,
    _via_exec,
    _via_property_from_c,
    _via_torch_frame_from_c,
    _via_c_calling_a_torch_frame,
    _via_settrace,
]


@pytest.mark.parametrize("shape", STACK_SHAPES, ids=[f.__name__[5:] for f in STACK_SHAPES])
def test_capture_agrees_with_the_public_api_on_every_stack_shape(shape):
    (fast, public, direct), name = shape()
    assert direct is DIRECT_EXPECTED
    assert fast == public
    assert fast[0].co_name == name
    assert fast[1] >= 0 and _line_of(fast) is not None
