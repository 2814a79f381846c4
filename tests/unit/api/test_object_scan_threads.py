"""The scan of Python's objects (``snapshot(include_untracked=True)``, ``export()`` and the
profiler without lifetime tracking) never lets another thread see the references it holds,
and never reads what tensors of tracing hold (repro r31).

``gc.get_objects()`` returns a list referring to every object the cyclic GC tracks, among
them tuples another thread is still filling: ``tuple(generator)`` resizes its tuple in place,
which CPython allows only while nothing else refers to it, so that thread fails with
``SystemError`` if it runs while such a list exists. The tests stop another thread in the
middle of ``tuple(generator)``, then let it go on at the first moment the scanning thread
is back in Python from the scan's C call (a profile hook on its return): the scan must hold
no reference to the tuple by then.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings

import pytest
import torch

from memlord import MemLord, _core
from memlord.report._source import LedgerSource, _snapshot_section


def _tuple_built_around(scan) -> list[BaseException]:
    """Run scan() in this thread while another thread is half way through filling a tuple
    from a generator; the other thread resumes as soon as the scan's C call (CPython's
    gc.get_objects, or memlord's) returns to Python.  Returns the other thread's
    errors."""
    paused, resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def items():
        for i in range(40):
            if i == 10:  # the tuple (10 slots, from the length hint) is full now
                paused.set()
                resume.wait(10)
            yield i

    def builder():
        try:
            assert tuple(items()) == tuple(range(40))
        except BaseException as e:  # noqa: BLE001 - what the test reports
            errors.append(e)

    t = threading.Thread(target=builder)
    t.start()
    assert paused.wait(10)

    scanners = (gc.get_objects, _core._gc_objects_of)
    seen = []

    def on_call(frame, event, arg):
        if event == "c_return" and any(arg is f for f in scanners) and not resume.is_set():
            seen.append(arg)
            resume.set()
            time.sleep(0.05)  # let the builder run (and resize) now

    sys.setprofile(on_call)
    try:
        scan()
    finally:
        sys.setprofile(None)
        resume.set()
        t.join(10)
    assert seen, "the scan did not run"
    return errors


@pytest.fixture
def live():
    t = torch.ones(5, 17)  # a tensor made before tracking: found by the scan only
    yield t


def test_untracked_snapshot_scan_leaves_other_threads_alone(live):
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        errors = _tuple_built_around(lambda: lord.snapshot(5, include_untracked=True))
        snap = lord.snapshot(50, include_untracked=True)
    assert errors == []
    shapes = [e["shape"] for e in snap["cpu"]["top"] if not e["tracked"]]
    assert (5, 17) in shapes


def test_export_scan_without_lifetime_leaves_other_threads_alone(live, tmp_path):
    lord = MemLord(auto_gc_bytes=None)  # no lifetime tracking: export() scans objects
    errors = _tuple_built_around(lambda: lord.export(str(tmp_path / "e.json")))
    assert errors == []
    assert (tmp_path / "e.json").exists()
    errors = _tuple_built_around(lambda: LedgerSource.scan_tensors(5))
    assert errors == []


def test_scan_with_a_training_thread_raises_nothing_there():
    """The reported case: a module with a full backward hook trains in one thread while
    another snapshots with include_untracked, for a second."""
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    stop = time.monotonic() + 1.0
    errors: list[BaseException] = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)

    def training():
        m = torch.nn.Linear(4, 4)
        m.register_full_backward_hook(lambda *a: None)
        x = torch.randn(2, 4, requires_grad=True)
        while time.monotonic() < stop:
            try:
                m(x).sum().backward()
            except SystemError as e:
                errors.append(e)

    def scanner():
        while time.monotonic() < stop:
            lord.snapshot(include_untracked=True)
            LedgerSource.scan_tensors(3)

    ts = [threading.Thread(target=training), threading.Thread(target=scanner)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
    finally:
        sys.setswitchinterval(old)
        h.disable()
    assert errors == []


@pytest.fixture
def unfrozen():
    """Nothing frozen during the test: gc.get_objects() leaves out what gc.freeze() froze
    (conftest.py's heap, and whatever was alive when an earlier test froze: the tensors
    other test modules hold), which memlord's scan rightly finds.  At the end everything
    alive is frozen again, as test_scan_frozen_objects.py's fixture leaves it."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        yield
    finally:
        if frozen:
            for _ in range(100):  # all garbage first: some is freed a little per pass
                if gc.collect() == 0:
                    break
            gc.freeze()


def test_scan_finds_what_gc_finds(unfrozen):
    """The same tensors as a scan of gc.get_objects() in Python (with no other thread and
    nothing frozen, so that gc.get_objects() lists every tensor), less the tensors of
    tracing that earlier tests left alive."""
    from memlord._snapshot import _live_tensors, _tracing_types

    assert gc.get_freeze_count() == 0
    keep = [torch.zeros(3), torch.nn.Parameter(torch.ones(2))]
    gc.disable()
    try:
        skip = _tracing_types()
        ours = {id(t) for t in _live_tensors()}
        theirs = {
            id(o)
            for o in gc.get_objects()
            if issubclass(type(o), torch.Tensor) and not issubclass(type(o), skip)
        }
    finally:
        gc.enable()
    assert ours == theirs
    assert {id(t) for t in keep} <= ours


def test_scan_checks_its_arguments():
    with pytest.raises(TypeError, match="gc.get_objects"):
        _core._gc_objects_of(lambda: [], torch.Tensor, ())
    with pytest.raises(TypeError, match="types only"):
        _core._gc_objects_of(gc.get_objects, torch.Tensor, (1,))


# --------------------------------------------------------------------------- fake tensors


@pytest.fixture
def fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = [torch.empty(7, 11, 13), torch.ones(3, 3)]
    yield out


def _no_fake_warning(record) -> None:
    texts = [str(w.message) for w in record]
    assert not [t for t in texts if "FakeTensor" in t or "data pointer" in t.lower()], texts


def test_scans_skip_fake_tensors_without_reading_them(fakes):
    real = torch.ones(5, 19)
    lord = MemLord(auto_gc_bytes=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scan = LedgerSource.scan_tensors(100)
        section, origin = _snapshot_section(lord, 100)
        with lord.hook_into_python():
            snap = lord.snapshot(100, include_untracked=True)
    _no_fake_warning(record)
    assert origin == "gc scan"
    for rows in (
        [t for d in scan.values() for t in d["tensors"]],
        [t for d in section.values() for t in d["top"]],
        [t for d in snap.values() for t in d["top"]],
    ):
        shapes = [tuple(t["shape"]) for t in rows if t["shape"] is not None]
        assert (7, 11, 13) not in shapes and (3, 3) not in shapes
        assert (5, 19) in shapes
        (entry,) = [t for t in rows if t["shape"] is not None and tuple(t["shape"]) == (5, 19)]
        assert entry["nbytes"] == real.untyped_storage().nbytes()
