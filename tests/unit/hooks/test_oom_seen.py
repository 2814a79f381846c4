"""Out-of-memory errors leaving memlord's hooks (issue 28, items 1 and 4): real OOMs from
torch's CPU allocator (a request larger than any machine, refused at once), through
each hooked path, counted once per OOM in every hooked lord (``stats()[dev]["ooms"]``,
``memory_stats()["num_ooms"]``, an ``oom`` event in the ring, one INFO record), with
the error reaching the caller exactly as torch raised it.

The outside reference for the failed request is the allocator's own message ("you
tried to allocate N bytes"), and for the error the same call made without memlord.
"""

from __future__ import annotations

import gc
import logging
import re
import sys
import threading
import traceback

import pytest
import torch
from support.recursion import frame_depth

import memlord
from memlord import MemLord

HUGE = 1 << 50  # elements: 4 PiB of float32, more than any machine has


def _requested(error: BaseException) -> int:
    m = re.search(r"tried to allocate (\d+) bytes", str(error))
    assert m, str(error)
    return int(m.group(1))


def _factory():
    return torch.empty(HUGE)


def _conversion():
    return torch.zeros(1).expand(1 << 46).double()  # a dense copy: 512 TiB


def _operator():
    a = torch.zeros(3).expand(1 << 44, 3)
    return a @ torch.zeros(3, 4)  # aten.mm's output: 1 << 46 floats


def _raised(fn):
    try:
        fn()
    except RuntimeError as e:
        return e
    raise AssertionError("no OOM")


def _frames(error):
    return [(f.name, f.lineno) for f in traceback.extract_tb(error.__traceback__)]


def _ooms(lord, dev="cpu"):
    return lord.stats().get(dev, {}).get("ooms", 0)


# hooks: what each path needs; the conversion is a torch hook, the operator needs ops=True
PATHS = [
    ("factory", _factory, lambda lord: lord.hook_into_python()),
    ("convert", _conversion, lambda lord: lord.hook_into_torch()),
    ("op", _operator, lambda lord: lord.hook_into_python(ops=True)),
]


@pytest.mark.parametrize(("source", "fn", "hook"), PATHS, ids=[p[0] for p in PATHS])
def test_each_path_counts_once_and_the_error_is_torchs(source, fn, hook):
    bare = _raised(fn)  # no memlord hook: torch's own error
    lord = MemLord()
    lord.record_events(64)
    handle = hook(lord)
    try:
        got = _raised(fn)
    finally:
        handle.disable()
    assert type(got) is type(bare)
    assert str(got) == str(bare)
    assert _frames(got) == _frames(bare)  # the same traceback: nothing of memlord's
    assert _ooms(lord) == 1
    assert lord.memory_stats("cpu")["num_ooms"] == 1
    (ev,) = [e for e in lord.decode_events(lord.events()) if e["kind"] == "oom"]
    assert ev["bytes"] == _requested(bare)  # the allocator's own figure
    assert ev["source"] == source
    assert ev["device"] == "cpu"
    assert ev["count"] == 1
    # the call site: the line of fn that failed, as torch's traceback tells it
    assert ev["site"].endswith(f"test_oom_seen.py:{_frames(bare)[-1][1]}")
    assert lord.allocated("cpu")[0] >= 0


def test_nested_hooks_count_one_oom():
    """torch.empty's factory hook runs the operator through the dispatch mode: both see
    the error; the outermost reports it, once."""
    lord = MemLord()
    lord.record_events(64)
    with lord.hook_into_python(ops=True), lord.hook_into_torch():
        for _ in range(3):
            _raised(_factory)
    assert _ooms(lord) == 3
    kinds = [e["source"] for e in lord.decode_events(lord.events()) if e["kind"] == "oom"]
    assert kinds == ["factory"] * 3


def test_every_hooked_lord_counts_it():
    a, b, idle = MemLord(), MemLord(), MemLord()
    with a.hook_into_python(), b.hook_into_torch():
        _raised(_factory)  # a python hook: b is hooked too (into torch), and counts it
    assert (_ooms(a), _ooms(b), _ooms(idle)) == (1, 1, 0)


def test_other_errors_pass_untouched_and_count_nothing():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        with pytest.raises(RuntimeError, match="negative dimension"):
            torch.empty(-1)
        with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied"):
            torch.zeros(2, 3) @ torch.zeros(2, 3)
        with pytest.raises(TypeError):
            torch.zeros(2).to("not a device", "nor this")
    assert _ooms(lord) == 0


def test_threads_each_count():
    """The hooks are process-wide: every thread's OOMs count (the dispatch mode of
    ops=True is the thread's that turned it on, docs/guide.md)."""
    lord = MemLord()
    errors = []

    def work():
        for _ in range(5):
            errors.append(_raised(_factory))
            errors.append(_raised(_conversion))

    with lord.hook_into_python(), lord.hook_into_torch():
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(errors) == 40
    assert _ooms(lord) == 40


def test_a_failing_handler_never_reaches_the_caller(monkeypatch):
    """Whatever the OOM handler does, the caller gets torch's error; the handler's own
    failure goes to sys.unraisablehook."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def broken(error, what, source):
        raise ValueError("handler bug")

    memlord._core._set_oom_handler(broken)
    try:
        lord = MemLord()
        with lord.hook_into_python():
            got = _raised(_factory)
    finally:
        memlord._core._set_oom_handler(memlord._oom._hook_error)
    assert "can't allocate memory" in str(got)
    assert got.__context__ is None  # the handler's error is not chained onto it
    assert [type(e) for e in seen] == [ValueError]


def test_resets_clear_the_count():
    lord = MemLord()
    with lord.hook_into_python():
        _raised(_factory)
        lord.reset_peak_memory_stats()
        assert _ooms(lord) == 1  # a peak reset keeps accumulated counters
        lord.reset_memory_stats()
        assert _ooms(lord) == 0
        _raised(_factory)
        lord.reset()
    assert _ooms(lord) == 0


def test_info_record(caplog):
    lord = MemLord()
    with caplog.at_level(logging.INFO, logger="memlord"), lord.hook_into_python():
        bare = _raised(_factory)
    (rec,) = [r for r in caplog.records if "[oom]" in r.getMessage()]
    assert rec.levelno == logging.INFO
    text = rec.getMessage()
    assert "out of memory on cpu" in text
    assert "torch.empty" in text
    assert memlord.format_bytes(_requested(bare)) in text
    assert "test_oom_seen.py:" in text


def test_observer_claims_the_oom_its_hook_then_leaves():
    """torch's CUDA OOM observer runs inside the allocation, before the error leaves the
    hooked call: it counts the OOM, and the hook the error then leaves does not count it
    again.  The observer is called here by a custom operator as the allocator would
    (device, requested, allocated, free), then the operator raises torch's
    OutOfMemoryError, through the real dispatch mode."""

    @torch.library.custom_op("memlord_test::oom_after_observer", mutates_args=())
    def oom_after_observer(x: torch.Tensor) -> torch.Tensor:
        memlord._oom._observer(0, 1 << 30, 5 << 30, 1 << 20)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    lord = MemLord()
    lord.record_events(16)
    with lord.hook_into_python(ops=True):
        with pytest.raises(torch.OutOfMemoryError):
            oom_after_observer(torch.zeros(2))
    assert _ooms(lord, "cuda:0") == 1
    assert _ooms(lord, "cpu") == 0
    (ev,) = [e for e in lord.decode_events(lord.events()) if e["kind"] == "oom"]
    assert (ev["source"], ev["device"], ev["bytes"]) == ("allocator", "cuda:0", 1 << 30)


def test_observer_outside_any_hook_counts_and_claims_nothing():
    lord = MemLord()
    with lord.hook_into_python():
        memlord._oom._observer(1, 4096, 0, 0)
        assert memlord._core._oom_claim() is False  # no hooked call runs here
        got = _raised(_factory)  # the next OOM is not mistaken for a claimed one
    assert "can't allocate" in str(got)
    assert (_ooms(lord, "cuda:1"), _ooms(lord)) == (1, 1)


def test_unhooked_lord_counts_nothing():
    lord = MemLord()
    _raised(_factory)
    assert lord.stats() == {}


@pytest.mark.parametrize(("source", "fn", "hook"), PATHS, ids=[p[0] for p in PATHS])
def test_references_unchanged(source, fn, hook):
    """memlord keeps no reference to the error, its traceback or the caller's code."""
    code = fn.__code__
    bare = _raised(fn)
    counts_bare = (sys.getrefcount(bare), sys.getrefcount(bare.__traceback__))
    del bare
    gc.collect()  # frames of earlier calls in cycles go now, not in the middle
    code_before = sys.getrefcount(code)
    lord = MemLord()
    with hook(lord):
        got = _raised(fn)
        counts = (sys.getrefcount(got), sys.getrefcount(got.__traceback__))
        del got
    gc.collect()
    assert counts == counts_bare
    assert sys.getrefcount(code) <= code_before  # no reference of memlord's
    assert _ooms(lord) == 1


def test_a_recursion_error_at_the_limit_is_not_an_oom_and_nothing_is_unraisable(monkeypatch):
    """RecursionError is a RuntimeError: left to the OOM handler at the recursion limit, the
    handler (Python) hit the same limit and was reported as unraisable ("Exception ignored
    in: _hook_error"), once per hooked call, on stderr or in pytest's unraisable hook (seen
    on CPython 3.12 with torch 2.11)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    t = torch.arange(6.0)
    lord = MemLord(auto_gc_bytes=None)

    def down(n):
        return t.half() if n == 0 else down(n - 1)

    errors = 0
    limit = sys.getrecursionlimit()
    with lord.hook_into_torch(), lord.hook_into_python(ops=True):
        sys.setrecursionlimit(frame_depth() + 100)
        try:
            for n in range(120):
                try:
                    down(n)
                except RecursionError:
                    errors += 1
        finally:
            sys.setrecursionlimit(limit)
    assert errors > 0  # the limit was reached, inside the hooked calls too
    assert seen == []
    assert _ooms(lord) == 0


def test_a_cuda_call_out_of_memory_is_counted_on_cuda_not_the_cpu():
    """A CUDA call that fails for memory outside the caching allocator (cudaMalloc in a
    library, a context, a workspace) is torch's ``AcceleratorError`` with the text
    c10's CUDA check writes, ``CUDA error: out of memory``: an OOM on CUDA. It was
    counted, logged and explained as an OOM on the cpu. The error is raised by a
    custom operator, through the real dispatch mode, as the OOM observer test does."""

    @torch.library.custom_op("memlord_test::cuda_error_oom", mutates_args=())
    def cuda_error_oom(x: torch.Tensor) -> torch.Tensor:
        raise torch.AcceleratorError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported "
            "at some other API call, so the stacktrace below might be incorrect."
        )

    lord = MemLord()
    with lord.hook_into_python(ops=True):
        with pytest.raises(torch.AcceleratorError):
            cuda_error_oom(torch.zeros(2))
    assert _ooms(lord, "cpu") == 0
    # cuda:<current device> on a GPU machine; "cuda" where torch has no CUDA to ask
    (counted,) = [d for d, st in lord.stats().items() if st["ooms"]]
    assert counted.partition(":")[0] == "cuda"
    info = memlord._oom.describe(torch.AcceleratorError("CUDA error: out of memory"))
    assert info["device"].startswith("cuda") and info["bytes"] is None


@pytest.mark.parametrize(
    ("error", "device", "nbytes"),
    [
        (
            torch.OutOfMemoryError(
                "XPU out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                "of 15.11 GiB of which 1.00 GiB is free."
            ),
            "xpu:1",
            2 << 30,
        ),
        (
            RuntimeError(
                "MPS backend out of memory (MPS allocated: 1.49 GiB, other allocations: "
                "6.01 GiB, max allowed: 8.13 GiB). Tried to allocate 9.00 MiB on private pool."
            ),
            "mps",
            9 << 20,
        ),
    ],
    ids=["xpu", "mps"],
)
def test_the_backend_named_in_the_message_is_the_device(error, device, nbytes):
    """torch.OutOfMemoryError is any caching allocator's, not CUDA's only: the message's
    backend names the device (an XPU OOM was said to be on cuda), and its request."""
    info = memlord._oom.describe(error)
    assert (info["device"], info["bytes"]) == (device, nbytes)
