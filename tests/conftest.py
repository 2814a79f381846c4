"""Shared fixtures and a pure-Python reference of the accounting contract.

The helpers here are importable from the test modules (``from conftest import ...``):
pytest's default ``prepend`` import mode puts ``tests/`` on ``sys.path``.

* ``expected_storages(obj)`` is the contract's walk written in Python: which storages one
  ``allocate``/``free`` call counts, deduplicated per call by
  (untyped storage data pointer, storage nbytes, device).
* ``fake_cuda(numel, index)`` makes a tensor in CPU memory that reports ``cuda:<index>`` (a
  ``CudaLike``), so per-index auto-GC and hook paths run on a machine without a GPU.
* ``fakecuda`` / ``fake_torch_cuda`` (fixtures, tests/fakecuda_driver.py): memlord on a fake
  CUDA driver built from tests/fakecuda/fakecuda.c, and stand-ins for torch.cuda's streams,
  for the tests marked ``fakecuda``.
* ``here()`` is the caller's current line, for call-site assertions.
* ``STRESS_SCALE`` (env ``MEMLORD_STRESS_SCALE``, default 1) scales the iteration counts of the
  long stress tests; 1 runs the full counts.
* GC torture (env ``MEMLORD_GC_TORTURE=1``, what ``tox -e torture`` sets): every test runs with
  ``gc.set_threshold(1)``, so any allocation may run the cyclic GC, and with cyclic garbage
  whose finalizers call back into memlord (reset, set_auto_gc, set_auto_gc_strategy,
  allocate, free, queries) on a second lord.  A test's own lord and the hooks' subscribers
  are left alone, so its assertions hold; what is tested is that nothing crashes, leaks or
  corrupts while memlord's C code is interrupted anywhere an allocation can happen.  (The
  same lord re-entered from a finalizer or a thread is what test_event_seam.py's repro tests do.)
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from fakecuda_driver import (  # noqa: F401 (fixtures)
    fake_torch_cuda,
    fake_torch_hooks,
    fakecuda,
    fakecuda_lib,
)
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# What importing torch, numpy, pytest, hypothesis and memlord's test support leaves on the
# heap (some 170,000 objects) is moved out of the cyclic GC's reach (gc.freeze()): a full
# gc.collect(), which the tests call thousands of times to prove a storage's death is
# credited, then costs what the test's own objects cost instead of 0.1 s. What collecting
# the test modules leaves (another 190,000 objects over the whole tree: hypothesis'
# strategies, the transparency corpus, what the modules import) is frozen the same way when
# collection ends (pytest_collection_finish, below): before, every gc.collect() of a full
# run cost 0.19 s. What a test module's tests make stays collectable while the module
# runs; what is still alive after its last test is frozen too (pytest_runtest_teardown).
# MEMLORD_TEST_GC_FREEZE=0 runs without any of it.
_GC_FREEZE = os.environ.get("MEMLORD_TEST_GC_FREEZE", "1") != "0"


def collect_all_garbage(limit: int = 100) -> int:
    """gc.collect() until a pass finds nothing unreachable (at most ``limit`` passes);
    returns the passes run.  One pass can leave garbage that only the next frees (objects
    that garbage refers to where the collector cannot see: torch's MemTracker leaves a
    model's tensors so, one module's per pass): frozen after one pass, it was never
    collected, and counted as live in every later test's scans (test_fit_memory's
    parameters after test_ops_vs_memtracker.py's models: 133,120 B more)."""
    import gc

    for n in range(1, limit + 1):
        if gc.collect() == 0:
            return n
    return limit


if _GC_FREEZE:
    import gc

    collect_all_garbage()
    gc.freeze()

STAT_KEYS = frozenset(
    {
        "allocated",
        "freed",
        "allocated_total",
        "freed_total",
        "peak_allocated",
        "allocs",
        "frees",
        "gc_runs",
        "ooms",
    }
)
ZERO_STATS = dict.fromkeys(STAT_KEYS, 0)
#: the per-category entries of a stats() entry: {category: bytes} each
CATEGORY_KEYS = frozenset({"categories", "peak_categories", "category_peaks"})


def counters(entry: dict) -> dict:
    """A stats() entry's counters (the ints), without its per-category dicts, after
    checking those: every category named, ints, the live ones adding up to ``allocated``
    and those at the peak to ``peak_allocated``."""
    import memlord._core as core

    assert set(entry) == STAT_KEYS | CATEGORY_KEYS, set(entry) ^ (STAT_KEYS | CATEGORY_KEYS)
    for key in CATEGORY_KEYS:
        assert tuple(entry[key]) == core.CATEGORIES, key
        assert all(type(v) is int and v >= 0 for v in entry[key].values()), entry[key]
    assert sum(entry["categories"].values()) == entry["allocated"], entry
    assert sum(entry["peak_categories"].values()) == entry["peak_allocated"], entry
    return {k: v for k, v in entry.items() if k in STAT_KEYS}


STRESS_SCALE = float(os.environ.get("MEMLORD_STRESS_SCALE", "1"))

FAKE_PTR_WARNING = "Accessing the data pointer of FakeTensor"


def scaled(n: int) -> int:
    """An iteration count scaled by MEMLORD_STRESS_SCALE (never below 1)."""
    return max(1, int(n * STRESS_SCALE))


def under_asan() -> bool:
    return "asan" in os.environ.get("LD_PRELOAD", "") or bool(os.environ.get("MEMLORD_SANITIZE"))


# --------------------------------------------------------------------------- pytest hooks


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "cuda2: needs two CUDA GPUs (skipped with fewer)")
    config.addinivalue_line("markers", "slow: long stress tests")
    config.addinivalue_line(
        "markers", "fakecuda: runs memlord's CUDA paths on the fake driver (tests/fakecuda/)"
    )
    config.addinivalue_line(
        "markers", "network: needs PyPI (installs into a fresh virtual environment)"
    )
    # torch warns every time something reads a FakeTensor storage's data pointer; memlord
    # has to read it to build its dedup key, so the warning is expected here.
    config.addinivalue_line("filterwarnings", f"ignore:{FAKE_PTR_WARNING}:UserWarning")
    # torch's own notices when the tests build sparse tensors
    config.addinivalue_line("filterwarnings", "ignore:Sparse CSR tensor support is in beta")
    config.addinivalue_line("filterwarnings", "ignore:Sparse invariant checks are implicitly")


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fake_mode_cuda() -> str:
    """The device for a FakeTensorMode tensor that reports a second CUDA device where it
    can: "cuda:1" on a CPU-only build (nothing is initialised) and on hosts with two
    GPUs or more, "cuda:0" on a one-GPU host, where FakeTensorMode initialises the real
    device and cuda:1 is an invalid device ordinal."""
    return "cuda:0" if cuda_device_count() == 1 else "cuda:1"


_ADDRESS_ID = re.compile(r" at 0x[0-9a-fA-F]+")


def pytest_collection_finish(session):
    if _GC_FREEZE:
        import gc

        collect_all_garbage()
        gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    # after the last test of a module, its module-scoped fixtures finalized: what is still
    # alive is frozen too (torch._dynamo and inductor, imported by the first compiled test,
    # add some 90,000 objects that every later gc.collect() walked: 0.2 s each)
    module = getattr(item, "module", None)
    if _GC_FREEZE and (nextitem is None or getattr(nextitem, "module", None) is not module):
        import gc

        collect_all_garbage()
        gc.freeze()


def pytest_collection_modifyitems(config, items):
    # pytest-xdist needs every worker to collect the same ids in the same order: an id
    # built from an object's address (repr of a bare object) differs between processes
    unstable = [item.nodeid for item in items if _ADDRESS_ID.search(item.nodeid)]
    if unstable:
        raise pytest.UsageError(
            "test ids that differ between processes (an address in the id; pass ids=): "
            + ", ".join(unstable[:5])
        )
    # MEMLORD_TEST_SHUFFLE=<seed>: run the tests in a random order (the seed's), to prove
    # that no test depends on another having run first (tools/gpu_check.sh uses it)
    seed = os.environ.get("MEMLORD_TEST_SHUFFLE")
    if seed:
        random.Random(seed).shuffle(items)
    ngpu = cuda_device_count()
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    skip_cuda2 = pytest.mark.skip(reason=f"needs two CUDA GPUs; {ngpu} visible")
    for item in items:
        # the markers themselves, not item.keywords (which also holds names and param ids)
        if item.get_closest_marker("cuda2") is not None and ngpu < 2:
            item.add_marker(skip_cuda2)
        elif item.get_closest_marker("cuda") is not None and ngpu < 1:
            item.add_marker(skip_cuda)


# --------------------------------------------------------------------------- fixtures


GC_TORTURE = os.environ.get("MEMLORD_GC_TORTURE", "") not in ("", "0")


class _Meddler:
    """Cyclic garbage whose finalizer calls into memlord on the torture lord."""

    ops = 0

    def __init__(self, lord, i):
        self.me = self
        self.lord = lord
        self.i = i

    def __del__(self):
        lord, i = self.lord, self.i
        _Meddler.ops += 1
        try:
            k = i % 7
            if k == 0:
                lord.reset()
            elif k == 1:
                lord.set_auto_gc(None if i % 2 else 1)
            elif k == 2:
                lord.set_auto_gc_strategy(
                    {(0, 101): {"metric": "freed", "threshold": {"bytes": 1}}}
                )
            elif k == 3:
                lord.allocate(torch.empty(4))
            elif k == 4:
                lord.free(torch.empty(3))
            elif k == 5:
                lord.allocated(), lord.stats(), lord.auto_gc_strategy, lord.top_alloc_site()
            else:
                _Meddler(lord, i + 1)  # more garbage, made during a collection
        except Exception:  # a finalizer must not raise; memlord's own errors are the test
            import traceback

            traceback.print_exc()
            raise


@pytest.fixture(autouse=True)
def _gc_torture():
    if not GC_TORTURE:
        yield
        return
    import gc

    from memlord import MemLord

    victim = MemLord(auto_gc_bytes=1)
    for i in range(64):
        _Meddler(victim, i)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.collect()


@pytest.fixture(autouse=True)
def _quiet_environment(monkeypatch):
    """Tests start with DEBUG and NO_COLOR unset, whatever the caller's shell has, and
    memlord told so now: left to its next event, a DEBUG=1 of the test before would still
    be on when this test sets the "memlord" logger's level (caplog), and turning it off
    then would put back the level saved when it went on, undoing the test's."""
    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    from memlord import _log

    _log._debug_env_changed(None)


class MemLog:
    """The messages of the "memlord" logger's records during a test (through caplog)."""

    def __init__(self, caplog):
        self._caplog = caplog

    def text(self) -> str:
        """Every message so far, one per line (a summary spans several), then cleared."""
        msgs = [r.getMessage() for r in self._caplog.records if r.name == "memlord"]
        self._caplog.clear()
        return "".join(m + "\n" for m in msgs)

    def records(self):
        return [r for r in self._caplog.records if r.name == "memlord"]


@pytest.fixture
def memlog(caplog):
    """memlord's log records, with INFO on for the "memlord" logger (auto-GC records); DEBUG=1
    turns DEBUG records on as in a program."""
    caplog.set_level(logging.INFO, logger="memlord")
    caplog.handler.setLevel(logging.NOTSET)  # set_level raised it too: keep DEBUG records
    return MemLog(caplog)


@pytest.fixture(params=["abi", "getters"])
def tensor_abi(request, monkeypatch):
    """Run a test once per way the hooks read tensor metadata: through torch's stable C ABI
    (the fast path) and through torch's Python getters (the fallback).  Subprocesses the test
    starts inherit the choice through MEMLORD_TENSOR_ABI."""
    from memlord import _core

    on = request.param == "abi"
    if on and not _core._tensor_abi()["valid"]:
        pytest.skip("torch's stable C ABI is not usable with this torch build")
    monkeypatch.setenv("MEMLORD_TENSOR_ABI", "1" if on else "0")
    previous = _core._tensor_abi()["enabled"]
    _core._tensor_abi(on)
    yield request.param
    _core._tensor_abi(previous)


@pytest.fixture
def lord():
    """A MemLord with auto-GC disabled, so nothing resets `freed` behind a test's back."""
    from memlord import MemLord

    return MemLord(auto_gc_bytes=None)


@pytest.fixture
def ops_lord():
    """A lord with the Python hooks and its dispatch mode on (ops=True), torch's dispatch
    stack checked empty after."""
    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    try:
        yield lord
    finally:
        h.disable()
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.fixture
def fake():
    """Factory fixture: fake(numel, index, dtype=torch.float32) -> CudaLike on cuda:index."""
    return fake_cuda


# --------------------------------------------------------------------------- helpers


def here() -> int:
    """The line the caller is executing: `lord.allocate(t); line = here()`."""
    return sys._getframe(1).f_lineno


# Called with the device index of the work a conversion of a CudaLike or CudaStandIn queues
# on its "device" (a copy off it, or a cast's kernel): the fake_torch_cuda fixture tells the
# fake driver's stream it has work queued.
COPY_OBSERVERS: list = []


def _queued_on(index: int) -> None:
    for observe in COPY_OBSERVERS:
        observe(index)


class CudaLike(torch.Tensor):
    """A real tensor in CPU memory that reports device ``cuda:<index>``.

    memlord counts a FakeTensor (a meta storage) as 0 bytes, so per-index CUDA paths are
    exercised without a GPU with this instead: its storage is a real CPU storage of
    numel * itemsize bytes, and ``.device`` says cuda. Conversions behave as on a GPU for
    the hooks: ``.to("cpu")`` / ``.cpu()`` return a new plain CPU tensor (a copy), a cast
    (``.half()``, ``.to(dtype)``) returns a new tensor that is again "on" the same device.
    """

    _ml_index: int | None = None

    @property
    def device(self):
        index = self.__dict__.get("_ml_index")
        if index is None:
            with torch._C.DisableTorchFunctionSubclass():
                return self.device
        return torch.device("cuda", index)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        src = args[0] if args else None
        index = src.__dict__.get("_ml_index") if isinstance(src, CudaLike) else None
        name = getattr(func, "__name__", "")
        if index is None or not isinstance(out, torch.Tensor):
            return out
        if name in ("to", "cpu", "cuda", "half", "float", "double", "bfloat16"):
            leaves = name == "cpu" or any(
                isinstance(a, (str, torch.device)) for a in (*args[1:], *kwargs.values())
            )
            if out is src:  # really on the CPU already: a move still makes a copy
                with torch._C.DisableTorchFunctionSubclass():
                    out = torch.Tensor.clone(out)
            out = out.as_subclass(torch.Tensor) if leaves else _cuda_like(out, index)
            _queued_on(index)  # the copy, or the cast's kernel, on the device's stream
        return out


def _cuda_like(t: torch.Tensor, index: int) -> CudaLike:
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(CudaLike)
    out.__dict__["_ml_index"] = index
    return out


def fake_cuda(numel: int, index: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A tensor reporting device cuda:<index>, with numel * itemsize real storage bytes
    (a ``CudaLike`` in CPU memory), for the per-index paths on a machine without a GPU."""
    t = _cuda_like(torch.empty(numel, dtype=dtype), index)
    assert str(t.device) == f"cuda:{index}"
    return t


class CudaStandIn(torch.Tensor):
    """A tensor that reports device cuda:<index> on a CPU-only machine, with no memory of its
    own: a wrapper subclass (not a FakeTensor, which memlord never counts).  Conversions go
    through aten._to_copy: to the CPU they give a real CPU tensor, elsewhere another
    stand-in."""

    @staticmethod
    def __new__(cls, shape, dtype, index):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=torch.device("cuda", index)
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0]
        if func is not torch.ops.aten._to_copy.default:
            raise NotImplementedError(f"CudaStandIn: {func}")
        dev = kwargs.get("device") or src.device
        dtype = kwargs.get("dtype") or src.dtype
        if dev.type == "cpu":
            _queued_on(src.device.index)
            # an aten op: memlord's Python-level factory hooks never see it
            return torch.ops.aten.empty.memory_format(list(src.shape), dtype=dtype)
        return CudaStandIn(src.shape, dtype, dev.index)


def cuda_standin(numel: int, index: int = 0, dtype=torch.float32) -> torch.Tensor:
    """A CudaStandIn of numel elements on cuda:<index>: what the hooks' tests move."""
    return CudaStandIn((numel,), dtype, index)


def storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensor_storages(t: torch.Tensor):
    if is_traceable_wrapper_subclass(t):
        # a jagged NestedTensor, DTensor: the inner tensors torch flattens it to
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _tensor_storages(i)]
    layout = t.layout
    if layout == torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        parts = [t]
    out = []
    for p in parts:
        if p.is_meta:
            continue
        s = p.untyped_storage()
        n = s.nbytes()
        if n == 0:
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", FAKE_PTR_WARNING)
            ptr = s.data_ptr()
        dev = str(p.device)
        out.append(((ptr, n, dev), dev, n))
    return out


def _module_tensors(m: nn.Module):
    for sub in m.modules():
        for t in sub._parameters.values():
            if t is not None:
                yield t
        for t in sub._buffers.values():
            if t is not None:
                yield t


def _ndarray_storage(a: np.ndarray):
    base = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    if base.nbytes == 0:
        return []
    ptr = base.__array_interface__["data"][0]
    return [((ptr, base.nbytes, "cpu"), "cpu", base.nbytes)]


def _one(obj):
    if isinstance(obj, torch.Tensor):
        return _tensor_storages(obj)
    if isinstance(obj, nn.Module):
        return [s for t in _module_tensors(obj) for s in _tensor_storages(t)]
    if isinstance(obj, np.ndarray):
        return _ndarray_storage(obj)
    raise TypeError(type(obj).__name__)


def expected_storages(obj):
    """[(device_str, nbytes)] that one allocate(obj)/free(obj) call counts, per the contract."""
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    seen = set()
    out = []
    for item in items:
        for key, dev, n in _one(item):
            if key in seen:
                continue
            seen.add(key)
            out.append((dev, n))
    return out


def expected_bytes(obj) -> dict:
    """{device_str: bytes} one call on obj counts."""
    per = {}
    for dev, n in expected_storages(obj):
        per[dev] = per.get(dev, 0) + n
    return per


def snapshot(lord) -> tuple:
    """Everything observable about a lord's counters, for 'nothing changed' assertions."""
    return (
        lord.stats(),
        lord.auto_gc_bytes,
        lord.allocated(),
        lord.freed(),
        lord.top_alloc_site(),
        lord.top_free_site(),
    )


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.fixture
def no_plotly(monkeypatch):
    """From here on, importing plotly fails, as where the memlord[report] extra is not
    installed."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "plotly" or name.startswith("plotly."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


@pytest.fixture(scope="session")
def browser() -> str:
    """The headless Chromium of the HTML report's browser tests: a failure when
    MEMLORD_REQUIRE_BROWSER is set (CI) and none is installed, a skip otherwise."""
    from support.browser import find_chromium

    path = find_chromium()
    if path is None:
        if os.environ.get("MEMLORD_REQUIRE_BROWSER"):
            pytest.fail("MEMLORD_REQUIRE_BROWSER is set but no chromium is installed")
        pytest.skip("no chromium on this machine: run tools/ensure_chromium.sh to install it")
    return path
