"""memlord.profiler: the memory profiler's API on real tensors, its one snapshot thread,
and the JSON written at stop, at exit and on SIGTERM / SIGINT (real subprocesses)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from support.ledger import torch_memory

import memlord.profiler as profiler
from memlord import MemLord, _core
from memlord.profiler import (
    MemoryTracker,
    get_memory_tracker,
    initialize_memory_tracker,
    memory_checkpoint,
    stop_memory_tracker,
)
from memlord.report import load, memory_series
from memlord.report._source import LedgerSource

NAME = re.compile(r"memory_profile_\d{8}_\d{6}_\d+_\d+\.json")


def _profiler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "memlord-profiler"]


@pytest.fixture(autouse=True)
def _no_global_tracker():
    stop_memory_tracker()
    yield
    stop_memory_tracker()


def test_disabled_tracker_does_nothing(tmp_path):
    tracker = get_memory_tracker()
    assert not tracker.enabled and not tracker.running
    with tracker.track_operation("x"):
        torch.zeros(10)
    assert memory_checkpoint("nothing") is None
    tracker = initialize_memory_tracker(output_dir=tmp_path, enabled=False, interval=0.01)
    with tracker.track_operation("x"):
        torch.zeros(10)
    with tracker.track_pytorch_ops():
        torch.zeros(10) + 1
    assert _profiler_threads() == []
    assert stop_memory_tracker() is None
    assert list(tmp_path.iterdir()) == []


def test_operations_nested_with_exact_deltas(tmp_path):
    initialize_memory_tracker(output_dir=tmp_path, interval=None)
    tracker = get_memory_tracker()
    keep = []
    with tracker.track_operation("outer"):
        keep.append(torch.zeros(1000))  # 4000 bytes
        with tracker.track_operation("inner"):
            keep.append(torch.zeros(250, dtype=torch.float64))  # 2000 bytes
            scratch = torch.zeros(500)  # 2000 bytes, freed inside outer
        del scratch
    for _ in range(2):
        with tracker.track_operation("inner"):
            pass
    path = stop_memory_tracker()
    assert path is not None and NAME.fullmatch(path.name) and path.parent == tmp_path
    data = json.loads(path.read_text())
    outer, inner = data["operation_allocations"]["outer"], data["operation_allocations"]["inner"]
    assert len(outer) == 1 and len(inner) == 3
    ops = {(s["name"], s["depth"]): s for s in data["memlord"]["operations"]}
    o, i = ops[("outer", 0)], ops[("inner", 1)]
    assert o["delta"] == {"cpu": 6000} and o["tensor_delta"] == 2
    assert o["post_total"] - o["pre_total"] == 6000
    assert i["delta"] == {"cpu": 4000} and i["tensor_delta"] == 2
    assert i["pre_total"] == o["pre_total"] + 4000
    assert o["start_ns"] <= i["start_ns"] <= i["end_ns"] <= o["end_ns"]
    summary = data["operation_summary"]
    assert summary["outer"]["invocation_count"] == 1 and summary["inner"]["invocation_count"] == 3
    assert summary["inner"]["max_memory_delta_mb"] == round(4000 / 2**20, 4)
    # the stop snapshot sees the two kept tensors among the largest
    last = data["snapshots"][-1]
    assert last["checkpoint_name"] == "stop"
    shapes = [t["shape"] for t in last["device_breakdown"]["cpu"]["tensors"]]
    assert [1000] in shapes and [250] in shapes
    assert load(path).operation_summary() == summary
    del keep


def test_operations_are_lord_regions_and_events_come_from_the_ring(tmp_path):
    """Each track_operation call is a region of the tracker's lord: its per-device delta
    and peak count its own thread only (exact, however busy other threads are), it shows
    in lord.regions() and not twice in the document; the document's events are the
    ring's records, with the operations as their regions."""
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=None)
    lord = tracker.source.lord
    assert lord.events_capacity == profiler.EVENTS
    keep, theirs = [], []
    ready, go = threading.Event(), threading.Event()

    def other_thread():
        ready.set()
        go.wait()
        theirs.append(torch.zeros(10_000))  # 40000 bytes, inside "outer" in time only

    worker = threading.Thread(target=other_thread)
    worker.start()
    ready.wait()
    with tracker.track_operation("outer"):
        keep.append(torch.zeros(1000))  # 4000 bytes
        go.set()
        worker.join()
        with tracker.track_operation("inner"):
            scratch = torch.zeros(2000)  # 8000 bytes, freed inside "outer"
        del scratch
    with lord.region("user region"):
        keep.append(torch.zeros(10))
    assert set(lord.regions()) == {"outer", "inner", "user region"}
    stop_memory_tracker()
    doc = tracker.profile()
    ops = {s.name: s for s in doc.operations}
    outer, inner = ops["outer"], ops["inner"]
    assert outer.delta == {"cpu": 4000} and outer.peak == {"cpu": outer.pre_total + 12000}
    assert outer.tensor_delta == 1 and outer.memory_delta == 44000  # the totals see both
    # peak: the device's bytes when the region first touched it, plus its own highest net
    assert inner.delta == {"cpu": 8000} and inner.peak == {"cpu": outer.pre_total + 52000}
    assert outer.start_ns < inner.start_ns <= inner.end_ns < outer.end_ns
    assert (outer.depth, inner.depth) == (0, 1)
    assert [s.name for s in doc.regions] == ["user region"]  # the operations not again
    # the events are the ring's: sites in this file, regions named by the operations
    ev = doc.events
    assert doc.metadata["events_capacity"] == profiler.EVENTS
    assert ev.decode("kind").count("alloc") == 4 and ev.decode("kind").count("free") == 1
    rows = list(zip(ev.decode("kind"), ev["bytes"].tolist(), ev.decode("region"), strict=True))
    assert ("alloc", 4000, "outer") in rows and ("alloc", 8000, "inner") in rows
    assert ("free", 8000, "outer") in rows and ("alloc", 40000, None) in rows
    assert all(site.startswith("tests/unit/python/test_profiler.py:") for site in ev.sites)
    # the tracker counts op outputs: its thread's factories are seen as operators ("op"),
    # the other thread's (no dispatch mode there) by the factory wrappers
    assert set(ev.decode("source")) == {"op", "factory", "death"}
    final = lord.stats()["cpu"]
    series = memory_series(doc)["cpu"]
    assert series.source == "events" and int(series.allocated[-1]) == final["allocated"]
    assert int(series.allocated.max()) == final["peak_allocated"]
    # the ring's memory is given back at stop; the profile keeps what it held
    assert lord.events_capacity == 0 and tracker.profile().events == ev
    del keep


def test_operations_carry_their_categories_as_regions_do(tmp_path):
    """An operation's per-device split by category (what the report's "Modules and
    regions by category" table and the JSON's ``operations[].categories`` show): the
    region's, as for ``lord.region``; a ``run --modules`` module span is an operation.
    It was left out: every operation had ``categories == {}``. The reference is the
    tensors' own storage bytes."""
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=None)
    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    with tracker.track_operation("step"):
        out = model(x)
        out.sum().backward()
    stop_memory_tracker()
    (op,) = [s for s in tracker.profile().operations if s.name == "step"]
    cats = op.categories["cpu"]
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
    assert cats["gradient"]["delta"] == grads
    assert cats["activation"]["delta"] == out.untyped_storage().nbytes()
    assert sum(c["delta"] for c in cats.values()) == op.delta["cpu"]
    assert sum(c["at_peak"] for c in cats.values()) == op.peak["cpu"] - op.pre_total


def test_event_ring_capacity_option(tmp_path):
    tracker = MemoryTracker(tmp_path, interval=None, json_path=False, events=0).start()
    torch.zeros(10)
    tracker.stop()
    assert len(tracker.profile().events) == 0
    with pytest.raises(ValueError, match="events"):
        MemoryTracker(tmp_path, events=-1)
    # a lord that already records keeps its own ring
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(3)
    tracker = MemoryTracker(
        tmp_path, interval=None, json_path=False, source=LedgerSource(lord)
    ).start()
    keep = [torch.zeros(i + 1) for i in range(5)]
    tracker.stop()
    assert lord.events_capacity == 3 and lord.events_dropped == 2
    doc = tracker.profile()
    assert doc.events["bytes"].tolist() == [12, 16, 20]
    assert int(memory_series(doc)["cpu"].allocated[-1]) == 60
    del keep


def test_one_snapshot_thread_only_while_running(tmp_path):
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=0.01)
    assert len(_profiler_threads()) == 1
    x = torch.zeros(4096)
    deadline = time.monotonic() + 5
    while len(tracker.profile().snapshots) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    memory_checkpoint("after_alloc")
    stop_memory_tracker()
    assert _profiler_threads() == []
    doc = tracker.profile()
    periodic = [s for s in doc.snapshots if s["checkpoint_name"] is None]
    assert len(periodic) >= 3
    # periodic snapshots carry totals only; checkpoints also the largest tensors
    assert all(s["device_breakdown"].get("cpu", {}).get("tensors", []) == [] for s in periodic)
    (cp,) = [s for s in doc.snapshots if s["checkpoint_name"] == "after_alloc"]
    assert cp["device_breakdown"]["cpu"]["total_bytes"] >= 4096 * 4
    assert cp["device_breakdown"]["cpu"]["tensors"][0]["nbytes"] >= 4096 * 4
    n = len(doc.snapshots)
    time.sleep(0.05)
    assert len(tracker.profile().snapshots) == n
    del x


@pytest.mark.parametrize("interval", [1e10, 1e300])
def test_a_huge_interval_is_a_thread_that_waits_not_one_that_dies(tmp_path, monkeypatch, interval):
    """Any finite positive ``interval`` is valid (``run --interval 1e10`` too): the
    snapshot thread waits (past ``threading.TIMEOUT_MAX`` it waits that long) instead of
    dying at once with OverflowError, and stops when the tracker stops."""
    died: list = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=interval)
    time.sleep(0.1)
    assert died == []
    assert len(_profiler_threads()) == 1
    assert stop_memory_tracker() is not None
    assert _profiler_threads() == []
    assert tracker.profile().metadata["interval_s"] == interval


def test_background_snapshots_never_break_tuple_building(tmp_path):
    """A scan of gc.get_objects() from the snapshot thread made tuple(generator) on the
    main thread fail with SystemError (the scan's list referred to the tuple being
    resized).  Periodic snapshots must not scan."""
    keep = [torch.zeros(4) for _ in range(500)]

    def gen(n):
        yield from range(n)

    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=0.001, json_path=False)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert tuple(gen(200))[-1] == 199
    stop_memory_tracker()
    assert len(tracker.profile().snapshots) > 10
    del keep


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_snapshot_with_a_tensor_that_has_no_sizes(tmp_path):
    """A live nested tensor (whose .shape raises) made the checkpoint's scan fail."""
    nested = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(5)])
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=None, top=100_000)
    snap = memory_checkpoint("nested")
    stop_memory_tracker()
    tensors = snap["device_breakdown"]["cpu"]["tensors"]
    assert any(t["shape"] is None for t in tensors)
    assert tracker.profile().snapshots[0] is snap
    del nested


def test_track_pytorch_ops(tmp_path):
    initialize_memory_tracker(output_dir=tmp_path, interval=None)
    tracker = get_memory_tracker()
    model = torch.nn.Linear(16, 8)
    with tracker.track_pytorch_ops():
        for _ in range(3):
            model(torch.randn(4, 16))
    path = stop_memory_tracker()
    ops = json.loads(path.read_text())["pytorch_operations"]
    linear = [o for o in ops if o["op_name"] == "aten::linear"]
    assert linear and linear[0]["count"] == 3
    assert linear[0]["input_shapes"] == [[4, 16], [8, 16], [8]]
    assert linear[0]["cpu_time_us"] > 0
    # the memory is torch.profiler's own for the same calls; the tracker's dispatch mode
    # (op outputs) is no operator of the program
    with torch.profiler.profile(profile_memory=True, record_shapes=True) as prof:
        for _ in range(3):
            model(torch.randn(4, 16))
    (ref,) = (e for e in prof.key_averages() if e.key == "aten::linear")
    assert ref.cpu_memory_usage > 0
    assert linear[0]["cpu_memory_mb"] == ref.cpu_memory_usage / 2**20
    assert "PythonDispatchMode" not in {o["op_name"] for o in ops}
    assert set(linear[0]) == {
        "op_name",
        "count",
        "cpu_time_us",
        "cuda_time_us",
        "cpu_memory_mb",
        "cuda_memory_mb",
        "input_shapes",
    }


def test_track_pytorch_ops_inside_the_programs_profiler_leaves_it_alone(tmp_path, caplog):
    """Inside a torch profiler the program runs, ``track_pytorch_ops()`` records nothing
    and says so (a WARNING): the program's profiler keeps every operator it saw, the
    same as without memlord. (torch 2.13 lets a second profile start, and it took the
    session: the program's profiler came out empty.)"""

    def profiled(block):
        with torch.profiler.profile() as prof:
            torch.mm(torch.ones(3, 3), torch.ones(3, 3))
            with block():
                torch.sigmoid(torch.ones(5))
            torch.tanh(torch.ones(5))
        return {e.key for e in prof.key_averages()}

    bare = profiled(contextlib.nullcontext)
    tracker = initialize_memory_tracker(output_dir=tmp_path, interval=None)
    with caplog.at_level("WARNING", logger="memlord"):
        seen = profiled(tracker.track_pytorch_ops)
    stop_memory_tracker()
    assert {"aten::mm", "aten::sigmoid", "aten::tanh"} <= bare
    # the tracker's dispatch mode (op outputs) is the one row it adds, as any
    # TorchDispatchMode the program entered would
    assert seen - {"PythonDispatchMode"} == bare
    assert tracker.profile().pytorch_operations == []
    assert any("torch.profiler is busy" in r.getMessage() for r in caplog.records)


def test_bad_arguments_raise_and_change_nothing(tmp_path):
    initialize_memory_tracker(output_dir=tmp_path, interval=None)
    before = get_memory_tracker()
    with pytest.raises(ValueError, match="interval"):
        initialize_memory_tracker(output_dir=tmp_path, interval=0)
    with pytest.raises(TypeError, match="interval"):
        initialize_memory_tracker(output_dir=tmp_path, interval="5")
    with pytest.raises(TypeError, match="enabled"):
        initialize_memory_tracker(output_dir=tmp_path, enabled="yes")
    with pytest.raises(TypeError, match="output_dir"):
        initialize_memory_tracker(output_dir=3)
    with pytest.raises(TypeError, match="name"):
        memory_checkpoint(3)
    with pytest.raises(TypeError, match="name"):
        with before.track_operation(None):
            pass
    assert get_memory_tracker() is before and before.running
    assert before.profile().operations == []


def test_begin_and_end_refuse_what_the_profile_could_not_hold(tmp_path):
    """begin()'s kind is a string (a profile whose span has another kind is one load() and
    `memlord report` refuse) and end()'s token an int; each mistake is a TypeError naming
    the argument, and what was written loads."""
    tracker = MemoryTracker(tmp_path, True, None, json_path=tmp_path / "p.json")
    tracker.start()
    try:
        with pytest.raises(TypeError, match=r"kind must be a str, got int"):
            tracker.begin("op", kind=3)
        with pytest.raises(TypeError, match=r"token must be an int, got NoneType"):
            tracker.end(None)
        tracker.end(tracker.begin("op", kind="step"))
    finally:
        tracker.stop()
    assert [(s.name, s.kind) for s in load(tmp_path / "p.json").operations] == [("op", "step")]


def test_initialize_twice_writes_the_first(tmp_path):
    first = initialize_memory_tracker(output_dir=tmp_path / "a", interval=None)
    initialize_memory_tracker(output_dir=tmp_path / "b", interval=None)
    assert not first.running
    assert len(list((tmp_path / "a").iterdir())) == 1
    stop_memory_tracker()
    assert len(list((tmp_path / "b").iterdir())) == 1


def test_extra_exports_and_explicit_json(tmp_path):
    tracker = MemoryTracker(
        tmp_path,
        interval=None,
        json_path=tmp_path / "p.json",
        exports=[tmp_path / "p.trace.json", tmp_path / "p.pickle"],
        install_handlers=False,
    ).start()
    with tracker.track_operation("op"):
        torch.ones(100)
    written = tracker.stop()
    assert [p.name for p in written] == ["p.json", "p.trace.json", "p.pickle"]
    assert tracker.stop() == []  # stopped once


#: SIGINT's handler before any test ran (Python's default, or SIG_IGN when the test run
#: was started as a background job): every tracker gives it back
SIGINT_AT_IMPORT = signal.getsignal(signal.SIGINT)

# ---- exit and signals, in real processes ----------------------------------------------------

SCRIPT = """
import os, signal, sys, time, torch
from memlord.profiler import initialize_memory_tracker, get_memory_tracker
mode, out = sys.argv[1], sys.argv[2]
# Python's own SIGINT handler, as a program started from a terminal has it (a parent that
# ignores SIGINT, such as a shell's background job, would leave it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
if mode == "chain":
    def previous(signum, frame):
        open(os.path.join(out, "previous_handler_ran"), "w").close()
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)
initialize_memory_tracker(output_dir=out, interval=0.05)
with get_memory_tracker().track_operation("setup"):
    keep = torch.zeros(1 << 16)
if mode == "exit":
    sys.exit(0)
print("ready", flush=True)
time.sleep(60)
"""


def _run(tmp_path, mode, sig=None):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if sig is not None:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    (path,) = [p for p in tmp_path.iterdir() if NAME.fullmatch(p.name)]
    doc = load(path)
    assert [s.name for s in doc.operations] == ["setup"]
    assert doc.operations[0].delta == {"cpu": 4 << 16}
    return proc.returncode, err, doc


def test_written_at_interpreter_exit(tmp_path):
    code, err, doc = _run(tmp_path, "exit")
    assert code == 0, err
    assert doc.snapshots[-1]["checkpoint_name"] == "exit"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_written_on_sigterm_then_default_behaviour(tmp_path):
    code, err, _ = _run(tmp_path, "default", signal.SIGTERM)
    assert code == -signal.SIGTERM, err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_written_on_sigint_then_keyboard_interrupt(tmp_path):
    code, err, _ = _run(tmp_path, "default", signal.SIGINT)
    assert "KeyboardInterrupt" in err
    assert code != 0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_chains_the_previous_handler(tmp_path):
    code, err, _ = _run(tmp_path, "chain", signal.SIGTERM)
    assert code == 7, err
    assert (tmp_path / "previous_handler_ran").exists()


def test_the_chained_signal_handler_takes_three_arguments_and_calls_nothing_else():
    """``_core._chain_signal(first, signum, frame)`` with another count of arguments is a
    TypeError and calls nothing; with three it calls ``first``, then what it returned."""
    calls = []
    with pytest.raises(TypeError, match="takes 3 arguments"):
        _core._chain_signal(lambda s, f: calls.append("first"), signal.SIGINT)
    assert calls == []

    def first(signum, frame):
        calls.append(("first", signum, frame))
        return lambda s, f: calls.append(("next", s, f))

    assert _core._chain_signal(first, 2, None) is None
    assert calls == [("first", 2, None), ("next", 2, None)]


def test_module_state_is_restored():
    assert profiler._tracker is None or not profiler._tracker.running
    assert signal.getsignal(signal.SIGINT) is SIGINT_AT_IMPORT


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_model_made_before_the_tracker_is_no_allocation_of_its_first_step(
    tmp_path, optimizer: str
) -> None:
    """A model and its optimizer made before the tracker starts (the usual order): the
    first training step's operation counts what the step makes (gradients, the
    optimizer's state, the temporaries), as torch.profiler records it, never the
    parameters its optimizer's step finds already there (counted from then on)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    params = list(model.parameters())
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=0.1)
    x = torch.randn(32, 64)
    initialize_memory_tracker(output_dir=tmp_path, interval=None)
    tracker = get_memory_tracker()
    with torch_memory() as theirs:
        with tracker.track_operation("step"):
            model(x).square().mean().backward()
            opt.step()
    path = stop_memory_tracker()
    assert path is not None
    net, peak = theirs.net, theirs.peak
    doc = json.loads(path.read_text())["memlord"]
    (op,) = (s for s in doc["operations"] if s["name"] == "step")
    assert op["delta"] == {"cpu": net}
    # the ledger's level rose by the parameters when the step found them (counted from
    # then on, as no allocation of the operation's): above the level at its start, its
    # peak is torch's plus those
    found = sum(p.untyped_storage().nbytes() for p in params)
    ours = op["peak"]["cpu"] - op["pre_total"] - found
    if optimizer == "sgd":
        assert ours == peak
    else:
        # AdamW's foreach kernels make 4- and 8-byte scalar tensors inside an operator
        # (its step counts, lr as a tensor) that no dispatch mode sees: alive at the peak,
        # torch's profiler counts 20 bytes of them there
        assert peak - 64 <= ours <= peak
    opt.zero_grad()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_operation_delta_and_peak_match_torch_profiler(tmp_path, backward: bool) -> None:
    """An operation around a model's step: its delta and its peak over the allocated bytes
    at its start are the net and the peak of the memory torch.profiler records for the
    same code (activations, the output, gradients), not only what factories made."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    initialize_memory_tracker(output_dir=tmp_path, interval=None)
    tracker = get_memory_tracker()
    with torch_memory() as theirs:
        with tracker.track_operation("step"):
            y = model(x)
            loss = y.square().mean()
            del y
            if backward:
                loss.backward()
    path = stop_memory_tracker()
    assert path is not None
    net, peak = theirs.net, theirs.peak
    assert net > 0 and peak > net
    spans = json.loads(path.read_text())["memlord"]["operations"]
    (op,) = (s for s in spans if s["name"] == "step")
    assert op["delta"] == {"cpu": net}
    assert op["peak"]["cpu"] - op["pre_total"] == peak
    del loss


def test_a_source_lord_with_its_own_hooks_keeps_them(tmp_path):
    """A lord given through ``source`` whose program turned hook_into_python() on (ops
    off) profiles with those hooks: the tracker starts, counts what they count (torch's
    own nbytes), and leaves them on at stop."""
    lord = MemLord()
    hooks = lord.hook_into_python()
    try:
        tracker = initialize_memory_tracker(
            output_dir=tmp_path, interval=None, json_path=False, source=LedgerSource(lord)
        )
        with tracker.track_operation("make"):
            x = torch.zeros(1000)
        stop_memory_tracker()
        (op,) = tracker.profile().operations
        assert op.delta == {"cpu": x.untyped_storage().nbytes()}
        assert hooks.enabled and not hooks.ops
    finally:
        hooks.disable()


@pytest.mark.parametrize("torch_hooks", [False, True], ids=["python", "python+torch"])
def test_a_source_lord_whose_hooks_match_the_trackers_keeps_them_on_after_stop(
    tmp_path, torch_hooks
):
    """A lord given through ``source`` whose program turned on the very hooks the tracker
    wants (``hook_into_python(ops=True)``, and ``hook_into_torch()``) gets them back
    enabled at stop: ``hook_into_*`` returns the program's own handle, which is the
    program's to disable, not the tracker's."""
    lord = MemLord()
    py = lord.hook_into_python(ops=True)
    th = lord.hook_into_torch() if torch_hooks else None
    try:
        tracker = initialize_memory_tracker(
            output_dir=tmp_path,
            interval=None,
            json_path=False,
            source=LedgerSource(lord, torch_hooks=torch_hooks),
        )
        with tracker.track_operation("make"):
            x = torch.zeros(1000) * 2  # an op output: the program's ops hooks count it
        stop_memory_tracker()
        (op,) = tracker.profile().operations
        assert op.delta["cpu"] == x.untyped_storage().nbytes()
        assert py.enabled and py.ops
        assert th is None or th.enabled
        before = lord.memory_allocated("cpu")
        y = torch.ones(500) + 1  # the program's hooks still count after the tracker (the
        # temporary ones(500) was counted and credited)
        assert lord.memory_allocated("cpu") - before == y.untyped_storage().nbytes()
    finally:
        py.disable()
        if th is not None:
            th.disable()
