"""Torch move hooks on the CPU: what lord.hook_into_torch() counts for each conversion.

What runs here without a GPU:

* same-device conversions (dtype casts, ``copy=True``, memory format): allocated on the device,
  source never freed; no-op conversions count nothing;
* real cross-device moves the CPU build can make: cpu -> meta (meta counts as nothing, so only
  the cpu free shows) and stand-in tensors reporting ``cuda:N`` moved to the cpu (dst allocated
  on cpu, src freed on cuda:N, auto-GC on cuda:N driven by the hook's free);
* Module.to, tied weights, errors passing through, the dispatcher's patch/unpatch identity,
  several lords, the handle, DEBUG lines, hotspot sites, reference counts, threads.

Deferred (non_blocking) frees behind CUDA events need a real GPU:
tests/unit/platform/test_hooks_cuda.py.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
import warnings
import weakref

import pytest
import torch
from conftest import fake_cuda, here
from support import misbehaving as misbehaving_extension
from torch import nn

from memlord import MemLord, _core
from memlord._sites import relative_path

HERE = relative_path(__file__)  # sites are shown relative to the working directory

# Every test runs with tensor metadata read through torch's stable C ABI and through its
# Python getters (conftest.tensor_abi).
pytestmark = pytest.mark.usefixtures("tensor_abi")

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)
TENSOR_NAMES = ("to", "cuda", "cpu", "half", "float", "double", "bfloat16")
CAST_DTYPES = {
    "half": torch.float16,
    "float": torch.float32,
    "double": torch.float64,
    "bfloat16": torch.bfloat16,
}
HAS_CUDA_BUILD = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _sync_owners():
    """(owner, name) of the synchronize functions the dispatcher patches on a CUDA build."""
    if not HAS_CUDA_BUILD:
        return []
    return [
        (torch.cuda, "synchronize"),
        (torch.cuda.Stream, "synchronize"),
        (torch.cuda.Event, "synchronize"),
    ]


def _patched_names():
    """Every (owner, name) the dispatcher replaces while a lord is subscribed."""
    return [(torch.Tensor, n) for n in TENSOR_NAMES] + [(nn.Module, "to")] + _sync_owners()


def _originals():
    """{(owner, name): (getattr value, owner.__dict__ entry or None)} as torch has them."""
    out = {}
    for owner, name in _patched_names():
        own = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        out[(owner, name)] = (getattr(owner, name), own)
    return out


# Captured at import, before any test hooks anything.
ORIGINALS = _originals()


def _assert_originals_back():
    for (owner, name), (value, own) in ORIGINALS.items():
        assert getattr(owner, name) is value, f"{owner}.{name} not restored"
        if isinstance(owner, type):
            assert owner.__dict__.get(name) is own, f"{owner}.__dict__[{name!r}] not restored"


def _alloc(lord, dev="cpu"):
    return lord.stats().get(dev, {}).get("allocated_total", 0)


def _freed(lord, dev="cpu"):
    return lord.stats().get(dev, {}).get("freed_total", 0)


def _counts(lord, dev="cpu"):
    s = lord.stats().get(dev, {})
    return s.get("allocs", 0), s.get("frees", 0)


@pytest.fixture(autouse=True)
def _hooks_left_clean():
    """Every test leaves torch unpatched, whatever it did (and fails if it did not)."""
    assert not _core._hooks_info()["installed"], "a previous test left hooks installed"
    yield
    info = _core._hooks_info()
    leaked = info["installed"]
    # Last resort so that one failing test does not poison the rest of the session.
    for obj in gc.get_objects():
        if type(obj).__name__ == "TorchHooks" and obj.enabled:
            obj.disable()
    assert not leaked, f"test left hooks installed: {info}"
    _assert_originals_back()


@pytest.fixture
def hooked(lord):
    """The `lord` fixture (auto-GC off) with hooks enabled; disabled at teardown."""
    h = lord.hook_into_torch()
    yield lord
    h.disable()


# --------------------------------------------------------------------------- same-device casts


@pytest.mark.parametrize("method", sorted(CAST_DTYPES))
def test_cast_methods_allocate_on_same_device(hooked, method):
    src_dtype = torch.float64 if method == "float" else torch.float32
    t = torch.empty(256, dtype=src_dtype)
    out = getattr(t, method)()
    assert out.dtype == CAST_DTYPES[method]
    assert _alloc(hooked) == out.nbytes == 256 * out.element_size()
    assert _freed(hooked) == 0
    assert _counts(hooked) == (1, 0)
    assert hooked.allocated("cpu")[0] == out.nbytes


@pytest.mark.parametrize("method", sorted(CAST_DTYPES))
def test_cast_to_own_dtype_is_noop(hooked, method):
    t = torch.empty(64, dtype=CAST_DTYPES[method])
    assert getattr(t, method)() is t
    assert hooked.stats() == {}


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.float16,), {}),
        ((), {"dtype": torch.float16}),
        (("cpu", torch.float16), {}),
        ((CPU,), {"dtype": torch.float16}),
        ((torch.empty(1, dtype=torch.float16),), {}),
        ((torch.float16, False), {}),
        ((torch.float16,), {"non_blocking": True}),
    ],
    ids=["dtype", "dtype-kw", "str-dev-dtype", "dev-dtype-kw", "other-tensor", "pos-bool", "nb"],
)
def test_to_dtype_forms_allocate_once(hooked, args, kwargs):
    t = torch.empty(256)
    out = t.to(*args, **kwargs)
    assert out.dtype == torch.float16
    assert _alloc(hooked) == 512
    assert _counts(hooked) == (1, 0)
    assert _freed(hooked) == 0


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        ((torch.float32,), {}),
        (("cpu",), {}),
        ((CPU,), {}),
        ((CPU, torch.float32), {}),
        ((torch.empty(1),), {}),
        ((), {"device": "cpu", "non_blocking": True}),
    ],
    ids=["bare", "dtype", "str", "device", "device-dtype", "other", "nb"],
)
def test_noop_to_counts_nothing(hooked, args, kwargs):
    t = torch.empty(256)
    assert t.to(*args, **kwargs) is t
    assert t.cpu() is t
    assert t.float() is t
    assert hooked.stats() == {}
    assert hooked.top_alloc_site() is None


def test_copy_true_allocates_same_device(hooked):
    t = torch.empty(100)
    out = t.to(torch.float32, copy=True)
    assert out is not t
    assert _alloc(hooked) == 400 and _freed(hooked) == 0
    out2 = t.to("cpu", copy=True)
    assert out2 is not t
    assert _alloc(hooked) == 800 and _counts(hooked) == (2, 0)


def test_memory_format_change_allocates(hooked):
    t = torch.empty(2, 3, 4, 5)
    out = t.to(memory_format=torch.channels_last)
    assert out is not t
    assert _alloc(hooked) == t.nbytes
    assert _freed(hooked) == 0


def test_unbound_calls_are_counted(hooked):
    t = torch.empty(256)
    torch.Tensor.half(t)
    torch.Tensor.to(t, torch.float64)
    assert _alloc(hooked) == 512 + 2048
    assert _counts(hooked) == (2, 0)


def test_parameter_cast_counted_once(hooked):
    p = nn.Parameter(torch.empty(256))
    p.half()
    assert _alloc(hooked) == 512 and _counts(hooked) == (1, 0)


def test_empty_tensor_counts_nothing(hooked):
    out = torch.empty(0).double()
    assert out.dtype == torch.float64
    assert hooked.stats().get("cpu", {}).get("allocs", 0) == 0


def test_sparse_coo_components_summed(hooked):
    sp = torch.eye(8).to_sparse()
    out = sp.to(torch.float64)
    want = out._indices().nbytes + out._values().nbytes
    assert _alloc(hooked) == want
    assert _counts(hooked) == (1, 0)


@pytest.mark.parametrize("layout", ["csr", "bsr"])
def test_sparse_compressed_components_summed(hooked, layout):
    dense = torch.eye(8)
    sp = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse_bsr((2, 2))
    out = sp.double()
    want = out.crow_indices().nbytes + out.col_indices().nbytes + out.values().nbytes
    assert _alloc(hooked) == want  # what lord.allocate(out) would count


def test_jagged_nested_cast_counts_its_new_values(hooked):
    """A jagged NestedTensor's cast makes new values and keeps its source's offsets: the
    values are what the conversion allocated (counted as 0 before: the NestedTensor has
    no storage of its own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype-stage note
        j = torch.nested.nested_tensor([torch.randn(3, 5), torch.randn(4, 5)], layout=torch.jagged)
    out = j.double()
    assert out.offsets().untyped_storage().data_ptr() == j.offsets().untyped_storage().data_ptr()
    assert _alloc(hooked) == out.values().untyped_storage().nbytes() == 7 * 5 * 8
    assert _counts(hooked) == (1, 0)


# ------------------------------------------------------------------- cross-device on the CPU


def test_cpu_to_meta_frees_cpu_source(hooked):
    t = torch.empty(256)
    hooked.allocate(t)
    out = t.to("meta")
    assert out.is_meta
    assert _freed(hooked) == 1024
    assert _alloc(hooked) == 1024  # only the explicit allocate; meta counts as nothing
    assert hooked.allocated("cpu")[0] == 0
    assert "meta" not in hooked.stats()


def test_cuda_standin_to_cpu_moves_bytes(hooked):
    f = fake_cuda(1000, 0)
    for out in (f.to("cpu"), f.cpu(), f.to(CPU, torch.float64)):
        assert out.device == CPU
    assert _alloc(hooked, "cpu") == 4000 + 4000 + 8000
    assert _freed(hooked, "cuda:0") == 3 * 4000
    assert _counts(hooked, "cuda:0") == (0, 3)
    assert _counts(hooked, "cpu") == (3, 0)


def test_cuda_standin_index_is_the_source_device(hooked):
    f = fake_cuda(300, 1)
    f.to("cpu")
    assert _freed(hooked, "cuda:1") == 1200
    assert _freed(hooked, "cuda:0") == 0


def test_cuda_standin_same_device_cast_allocates_on_cuda(hooked):
    f = fake_cuda(256, 0)
    f.half()
    f.to(torch.float64)
    assert _alloc(hooked, "cuda:0") == 512 + 2048
    assert _freed(hooked, "cuda:0") == 0
    assert "cpu" not in hooked.stats()


def test_non_blocking_cuda_standin_source_is_credited(hooked):
    """Without a CUDA runtime there is no event to wait on: the free is credited at once.
    With one, it is credited at the latest at poll()."""
    h = hooked.hook_into_torch()
    f = fake_cuda(512, 0)
    f.to("cpu", non_blocking=True)
    if not torch.cuda.is_available():
        assert h.pending() == 0
        assert _freed(hooked, "cuda:0") == 2048
    h.poll()
    if not torch.cuda.is_available():
        assert _freed(hooked, "cuda:0") == 2048


def test_hook_free_drives_auto_gc():
    lord = MemLord(auto_gc_bytes=4096)
    with lord.hook_into_torch():
        fake_cuda(512, 0).to("cpu")  # 2 KiB freed on cuda:0: below the threshold
        assert lord.stats()["cuda:0"]["gc_runs"] == 0
        assert lord.freed("cuda:0")[0] == 2048
        fake_cuda(1024, 0).to("cpu")  # 4 KiB more: 6 KiB >= 4 KiB
        s = lord.stats()["cuda:0"]
    assert s["gc_runs"] == 1
    assert s["freed"] == 0  # freed since the last GC resets at GC
    assert s["freed_total"] == 6144


def test_hook_auto_gc_is_per_device_index():
    lord = MemLord(auto_gc_bytes=4096)
    with lord.hook_into_torch():
        fake_cuda(2048, 1).to("cpu")
    stats = lord.stats()
    assert stats["cuda:1"]["gc_runs"] == 1
    assert stats.get("cuda:0", {}).get("gc_runs", 0) == 0


# --------------------------------------------------------------------------- modules


def _float_tensors_after(module):
    return [
        t
        for t in list(module.parameters()) + list(module.buffers())
        if t.is_floating_point() or t.is_complex()
    ]


def test_module_to_dtype_counts_each_tensor_once(hooked):
    m = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20), nn.Linear(20, 5))
    ret = m.to(torch.float64)
    assert ret is m
    floats = _float_tensors_after(m)
    assert all(t.dtype == torch.float64 for t in floats)
    assert _alloc(hooked) == sum(t.nbytes for t in floats)
    # num_batches_tracked (int64) is not converted, so not counted
    assert _counts(hooked) == (len(floats), 0)
    assert len(floats) == 8


def test_module_to_same_dtype_is_noop(hooked):
    m = nn.Linear(8, 8)
    m.to(torch.float32)
    m.to("cpu")
    assert hooked.stats() == {}


def test_module_round_trip(hooked):
    m = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    n32 = sum(p.nbytes for p in m.parameters())
    m.to(torch.float64)
    m.to(torch.float32)
    assert _alloc(hooked) == 2 * n32 + n32
    assert _counts(hooked) == (40, 0)


def test_module_half_and_double_are_counted_by_tensor_hooks(hooked):
    m = nn.Linear(16, 16)
    n = sum(p.numel() for p in m.parameters())
    m.half()
    m.double()
    assert _alloc(hooked) == n * 2 + n * 8


def test_module_to_meta_frees_cpu(hooked):
    m = nn.Linear(4, 4)
    m.to("meta")
    assert _freed(hooked) == (16 + 4) * 4
    assert _counts(hooked) == (0, 2)


def test_module_to_non_blocking_on_cpu_counts_normally(hooked):
    m = nn.Linear(8, 8)
    m.to(torch.float64, non_blocking=True)
    m.to("cpu", torch.float32, True)
    n = sum(p.numel() for p in m.parameters())
    assert _alloc(hooked) == n * 8 + n * 4
    assert hooked.hook_into_torch().pending() == 0


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100, bias=False)
        self.head.weight = self.emb.weight


def test_tied_weights_cast_once(hooked):
    m = _Tied()
    m.to(torch.float64)
    assert m.head.weight is m.emb.weight
    assert _alloc(hooked) == 100 * 16 * 8
    assert _counts(hooked) == (1, 0)


def test_tied_weights_cast_once_through_module_half(hooked):
    m = _Tied()
    m.half()
    assert m.head.weight is m.emb.weight
    assert _alloc(hooked) == 100 * 16 * 2
    assert _counts(hooked) == (1, 0)


# Tied weights *moved* once is GPU-only (tests/unit/platform/test_hooks_cuda.py): the only
# device move a CPU build can make, cpu -> meta, makes torch replace the Parameter
# (incompatible shallow-copy types), which unties the weights, so torch itself converts the
# shared tensor twice.


# --------------------------------------------------------------------------- errors


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    raise AssertionError("expected an exception")


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.to("not-a-device"),
        lambda t: t.to(object()),
        lambda t: t.to(torch.float32, bogus=1),
        lambda t: t.half(1),
        lambda t: t.double(memory_format=3),
        lambda t: t.cpu("x"),
        lambda t: t.cuda(),  # a CPU-only torch raises; on a GPU: a bad index below
        lambda t: t.cuda(10_000),
    ],
    ids=["bad-device", "object", "bad-kw", "half-arg", "bad-format", "cpu-arg", "cuda", "cuda-idx"],
)
def test_errors_pass_through_uncounted(lord, call):
    t = torch.empty(16)
    try:
        want = _error_of(lambda: call(t))
    except AssertionError:
        pytest.skip("this call succeeds on this machine")
    with lord.hook_into_torch():
        got = _error_of(lambda: call(t))
    assert got == want
    assert lord.stats() == {}
    assert lord.top_alloc_site() is None


def test_module_to_error_passes_through(lord):
    m = nn.Linear(2, 2)
    want = _error_of(lambda: m.to("not-a-device"))
    with lord.hook_into_torch():
        assert _error_of(lambda: m.to("not-a-device")) == want
        assert _error_of(lambda: m.to(torch.int32)) == _error_of(
            lambda: nn.Module.to.__wrapped__(m, torch.int32)
        )
    assert lord.stats() == {}


def test_exception_object_is_the_originals(lord):
    class Boom(Exception):
        pass

    err = Boom("x")

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            raise err

    s = torch.empty(4).as_subclass(Sub)
    with lord.hook_into_torch():
        with pytest.raises(Boom) as info:
            s.half()
    assert info.value is err
    assert lord.stats() == {}


def test_non_tensor_result_is_returned_unchanged(lord):
    """A __torch_function__ may legally return anything from .half(): memlord passes it on."""

    class Odd(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return 42

    s = torch.empty(4).as_subclass(Odd)
    assert s.half() == 42  # torch itself lets it through
    with lord.hook_into_torch():
        assert s.half() == 42
        assert s.to(torch.float64) == 42
    assert lord.stats() == {}


# --------------------------------------------------------------------------- nested dispatch


class _Passthrough(torch.Tensor):
    """The default __torch_function__: re-enters Tensor.half (the hook) under the hood."""


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_tensor_subclass_cast_counted_once(hooked):
    s = torch.empty(256).as_subclass(_Passthrough)
    out = s.half()
    assert type(out) is _Passthrough
    assert _alloc(hooked) == 512 and _counts(hooked) == (1, 0)


def test_torch_function_mode_cast_counted_once(hooked):
    with _Mode():
        torch.empty(256).half()
    assert _alloc(hooked) == 512 and _counts(hooked) == (1, 0)


def test_device_context_manager_cast_counted_once(hooked):
    with torch.device("cpu"):  # a TorchFunctionMode under the hood
        t = torch.empty(256)
        t.half()
    assert _alloc(hooked) == 512 and _counts(hooked) == (1, 0)


# --------------------------------------------------------------------------- dispatcher / identity


def test_patches_installed_and_wrapped(lord):
    h = lord.hook_into_torch()
    try:
        for (owner, name), (value, _own) in ORIGINALS.items():
            hook = getattr(owner, name)
            assert hook is not value
            # a method's hook is a descriptor like torch's; a module function's
            # (torch.cuda.synchronize on a CUDA build) is not
            assert type(hook).__name__ == ("Hook" if isinstance(owner, type) else "FunctionHook")
            assert hook.__wrapped__ is value
            assert hook.__name__ == name
            assert hook.__doc__ == value.__doc__
            assert repr(hook) == repr(value)
            assert hook == value and hash(hook) == hash(value)
        assert "to" in torch.Tensor.__dict__
    finally:
        h.disable()


def test_hook_type_cannot_be_instantiated(lord):
    with lord.hook_into_torch():
        with pytest.raises(TypeError):
            type(torch.Tensor.half)()


@pytest.mark.parametrize("cycles", [1, 3])
def test_identity_restored_after_disable(lord, cycles):
    for _ in range(cycles):
        h = lord.hook_into_torch()
        torch.empty(4).half()
        h.disable()
        _assert_originals_back()
        for name in TENSOR_NAMES:
            assert name not in torch.Tensor.__dict__ or ORIGINALS[(torch.Tensor, name)][1]
        assert nn.Module.__dict__["to"] is ORIGINALS[(nn.Module, "to")][0]


@pytest.mark.skipif(not HAS_CUDA_BUILD, reason="torch built without CUDA: nothing to patch")
def test_sync_functions_patched_on_cuda_build(lord):
    with lord.hook_into_torch():
        for owner, name in _sync_owners():
            assert getattr(owner, name).__wrapped__ is ORIGINALS[(owner, name)][0]


@pytest.mark.skipif(HAS_CUDA_BUILD, reason="checks the CPU-only torch build")
def test_sync_functions_skipped_cleanly_on_cpu_build(lord):
    before = getattr(torch.cuda, "synchronize", None)
    with lord.hook_into_torch():
        assert getattr(torch.cuda, "synchronize", None) is before


DIRECT_CALLS = sys.version_info < (3, 14)  # see ml_call_direct in src/hooks/direct.c


def test_hooks_call_torchs_c_functions_directly():
    """Up to CPython 3.13 every torch hook calls the original's C function itself (torch's
    methods and functions are METH_VARARGS | METH_KEYWORDS); later versions, and any original
    that is not CPython's own method descriptor or builtin, go through the original's call."""
    lord = MemLord(auto_gc_bytes=None)
    assert _core._hooks_info()["direct"] == []
    with lord.hook_into_torch(), lord.hook_into_python():
        direct = _core._hooks_info()["direct"]
        t = torch.ones(4)
        assert t.half().dtype == torch.float16 and torch.zeros(3).shape == (3,)
    assert _core._hooks_info()["direct"] == []
    if not DIRECT_CALLS:
        assert direct == []
        return
    assert set(TENSOR_NAMES) <= set(direct)
    assert {"empty", "zeros", "full", "empty_like", "clone"} <= set(direct)
    assert "__new__" not in direct  # nn.Parameter.__new__ is a Python function


def test_an_original_patched_by_someone_else_is_called_through_its_own_call():
    lord = MemLord(auto_gc_bytes=None)
    seen = []
    original = torch.Tensor.half

    def their_half(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    torch.Tensor.half = their_half
    try:
        with lord.hook_into_torch():
            direct = _core._hooks_info()["direct"]
            t = torch.ones(8)
            assert t.half().dtype == torch.float16 and seen == [t]
            assert lord.allocated(CPU)[0] == 16
    finally:
        del torch.Tensor.half
    assert "half" not in direct
    assert ("float" in direct) == DIRECT_CALLS


def test_hooks_info_consistency():
    a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
    info0 = _core._hooks_info()
    assert set(info0) >= {"installed", "subscribers", "pending", "events_created", "events_pooled"}
    assert info0["installed"] is False and info0["subscribers"] == 0 and info0["pending"] == 0
    ha = a.hook_into_torch()
    i1 = _core._hooks_info()
    assert i1["installed"] is True and i1["subscribers"] == 1
    hb = b.hook_into_torch()
    assert _core._hooks_info()["subscribers"] == 2
    assert a.hook_into_torch() is ha  # no third subscriber
    assert _core._hooks_info()["subscribers"] == 2
    ha.disable()
    i3 = _core._hooks_info()
    assert i3["installed"] is True and i3["subscribers"] == 1
    hb.disable()
    i4 = _core._hooks_info()
    assert i4["installed"] is False and i4["subscribers"] == 0 and i4["pending"] == 0
    for info in (i1, i3, i4):
        assert 0 <= info["events_pooled"] <= info["events_created"]
    if not torch.cuda.is_available():
        assert i4["events_created"] == info0["events_created"]


# --------------------------------------------------------------------------- the handle


def test_handle_basics(lord):
    h = lord.hook_into_torch()
    assert type(h).__name__ == "Hooks" and h.kind == "torch"
    assert h.enabled is True
    assert h.lord is lord
    assert "enabled" in repr(h)
    assert h.pending() == 0 and h.pending("cpu") == 0 and h.pending(device="cuda:0") == 0
    assert h.pending(CUDA0) == 0 and h.pending("cuda") == 0
    assert h.poll() is None
    assert h.disable() is None
    assert h.enabled is False
    assert "disabled" in repr(h)
    assert h.disable() is None  # idempotent
    assert h.pending() == 0
    with pytest.raises(TypeError):
        type(h)()


@pytest.mark.parametrize(
    ("args", "kwargs", "exc"),
    [
        ((1, 2), {}, TypeError),
        ((), {"dev": "cpu"}, TypeError),
        ((3.5,), {}, TypeError),
        (("nonsense",), {}, (ValueError, RuntimeError)),
    ],
)
def test_pending_bad_arguments(hooked, args, kwargs, exc):
    h = hooked.hook_into_torch()
    with pytest.raises(exc):
        h.pending(*args, **kwargs)


def test_double_enable_returns_same_handle(lord):
    h = lord.hook_into_torch()
    try:
        assert lord.hook_into_torch() is h
        torch.empty(256).half()
        assert _counts(lord) == (1, 0)  # subscribed once, counted once
    finally:
        h.disable()
    h2 = lord.hook_into_torch()
    try:
        assert h2 is not h and h2.enabled and not h.enabled
        h.disable()  # a stale handle does not unsubscribe the new one
        assert h2.enabled and _core._hooks_info()["installed"]
        torch.empty(256).half()
        assert _counts(lord) == (2, 0)
    finally:
        h2.disable()


def test_context_manager(lord):
    with lord.hook_into_torch() as h:
        assert type(h).__name__ == "Hooks" and h.kind == "torch" and h.enabled
        torch.empty(256).half()
    assert not h.enabled
    _assert_originals_back()
    torch.empty(256).half()  # not counted
    assert _alloc(lord) == 512


def test_context_manager_exception_propagates_and_disables(lord):
    with pytest.raises(KeyError):
        with lord.hook_into_torch() as h:
            raise KeyError("boom")
    assert not h.enabled
    _assert_originals_back()


def test_stale_hook_object_counts_nothing(lord):
    with lord.hook_into_torch():
        stale = torch.Tensor.half
    t = torch.empty(16)
    out = stale(t)
    assert out.dtype == torch.float16
    assert lord.stats() == {}


def test_subscribed_lord_kept_alive_then_released():
    lord = MemLord(auto_gc_bytes=None)
    ref = weakref.ref(lord)
    h = lord.hook_into_torch()
    del lord
    gc.collect()
    assert ref() is not None and h.lord is ref()
    torch.empty(256).half()
    assert _alloc(ref()) == 512
    h.disable()
    del h
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------- several lords


@pytest.mark.parametrize("first_out", ["a", "b"])
def test_two_lords_disable_in_either_order(first_out):
    a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
    ha, hb = a.hook_into_torch(), b.hook_into_torch()
    t = torch.empty(256)
    t.half()
    assert _alloc(a) == _alloc(b) == 512
    first, second = (ha, hb) if first_out == "a" else (hb, ha)
    first.disable()
    assert _core._hooks_info()["installed"]
    t.double()
    stay, gone = (b, a) if first_out == "a" else (a, b)
    assert _alloc(stay) == 512 + 2048
    assert _alloc(gone) == 512
    assert torch.Tensor.half is not ORIGINALS[(torch.Tensor, "half")][0]
    second.disable()
    _assert_originals_back()
    t.half()
    assert _alloc(a) + _alloc(b) == 512 + 512 + 2048


def test_three_lords_each_receive_every_event():
    lords = [MemLord(auto_gc_bytes=None) for _ in range(3)]
    handles = [lo.hook_into_torch() for lo in lords]
    try:
        fake_cuda(100, 0).to("cpu")
        torch.empty(8).to("meta")
        for lo in lords:
            assert _alloc(lo, "cpu") == 400
            assert _freed(lo, "cuda:0") == 400
            assert _freed(lo, "cpu") == 32
    finally:
        for h in reversed(handles):
            h.disable()


def test_lords_keep_their_own_auto_gc():
    eager, lazy = MemLord(auto_gc_bytes=1024), MemLord(auto_gc_bytes=None)
    with eager.hook_into_torch(), lazy.hook_into_torch():
        fake_cuda(512, 0).to("cpu")
    assert eager.stats()["cuda:0"]["gc_runs"] == 1
    assert lazy.stats()["cuda:0"]["gc_runs"] == 0
    assert lazy.freed("cuda:0")[0] == 2048


# --------------------------------------------------------------------------- DEBUG and sites


def test_debug_lines_are_labelled_hook(hooked, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    torch.empty(256).half()
    line_a = here() - 1
    torch.empty(64).to("meta")
    line_f = here() - 1
    out = ANSI.sub("", memlog.text())
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 2, out
    assert lines[0].startswith("[allocate] (hook) cpu +512 B"), out
    assert f"{HERE}:{line_a}" in lines[0]
    assert lines[1].startswith("[free] (hook) cpu -256 B"), out
    assert f"{HERE}:{line_f}" in lines[1]
    assert "summary" not in out


def test_debug_cuda_standin_move_logs_both_devices(hooked, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    fake_cuda(256, 0).to("cpu")
    out = memlog.text()
    assert "[allocate] (hook) cpu +1 KiB" in out, out
    assert "[free] (hook) cuda:0 -1 KiB" in out, out


def test_no_output_without_debug(hooked, capsys, memlog):
    torch.empty(256).half()
    torch.empty(64).to("meta")
    fake_cuda(64, 0).to("cpu")
    nn.Linear(4, 4).to(torch.float64)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert memlog.text() == ""


def test_alloc_site_is_the_callers_line(hooked):
    t = torch.empty(256)
    t.half(); line = here()  # fmt: skip # noqa: E702
    assert hooked.top_alloc_site() == (CPU, f"{HERE}:{line}", 512)


def test_free_site_is_the_callers_line(hooked):
    f = fake_cuda(256, 0)
    f.to("cpu"); line = here()  # fmt: skip # noqa: E702
    assert hooked.top_free_site() == (CUDA0, f"{HERE}:{line}", 1024)
    assert hooked.top_alloc_site() == (CPU, f"{HERE}:{line}", 1024)


def test_module_to_site_is_the_callers_line(hooked):
    m = nn.Linear(16, 16, bias=False)
    m.to(torch.float64); line = here()  # fmt: skip # noqa: E702
    assert hooked.top_alloc_site() == (CPU, f"{HERE}:{line}", 16 * 16 * 8)


def test_no_sites_when_callsite_tracking_is_off():
    lord = MemLord(auto_gc_bytes=None, track_callsite=False)
    with lord.hook_into_torch():
        torch.empty(256).half()
    assert _alloc(lord) == 512
    assert lord.top_alloc_site() is None


# --------------------------------------------------------------------------- reference counts


def test_refcounts_unchanged_after_many_hooked_calls(lord):
    t = torch.empty(16)
    m = nn.Linear(4, 4)
    f = fake_cuda(8, 0)
    dtype, dev = torch.float64, torch.device("cpu")
    h = lord.hook_into_torch()
    hook = torch.Tensor.__dict__["to"]
    objs = {"t": t, "m": m, "f": f, "h": h, "lord": lord, "dtype": dtype, "dev": dev, "hook": hook}

    def round_():
        t.to(torch.float32)
        t.half()
        t.to(dtype, copy=True)
        t.to(dev, non_blocking=True)
        t.to("meta")
        f.to(dev)
        m.to(dtype)
        m.to(torch.float32)
        try:
            t.to("not-a-device")
        except RuntimeError:
            pass
        h.pending()
        h.poll()

    try:
        for _ in range(10):
            round_()  # warm up caches
        before = {k: sys.getrefcount(v) for k, v in objs.items()}
        for _ in range(1000):
            round_()
        after = {k: sys.getrefcount(v) for k, v in objs.items()}
    finally:
        h.disable()
    assert after == before


def test_no_leak_of_results(hooked):
    t = torch.empty(16)
    out = t.half()
    ref = weakref.ref(out)
    del out
    assert ref() is None


# --------------------------------------------------------------------------- threads


def test_hooks_in_threads(hooked):
    n_threads, n_iter = 4, 300
    errors = []
    barrier = threading.Barrier(n_threads)

    def work():
        try:
            t = torch.empty(64)
            m = nn.Linear(2, 2, bias=False)
            barrier.wait()
            for _ in range(n_iter):
                t.half()
                m.to(torch.float64)
                m.to(torch.float32)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    per_iter = 128 + 4 * 8 + 4 * 4
    assert _alloc(hooked) == n_threads * n_iter * per_iter
    assert _counts(hooked) == (n_threads * n_iter * 3, 0)


def test_enable_disable_while_threads_convert():
    stop = threading.Event()
    errors = []

    def work():
        try:
            t = torch.empty(32)
            while not stop.is_set():
                out = t.half()
                assert out.dtype == torch.float16
                t.to("meta")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        for _ in range(200):
            a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
            ha = a.hook_into_torch()
            hb = b.hook_into_torch()
            ha.disable()
            hb.disable()
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert errors == []
    _assert_originals_back()


def _in_a_big_stack(fn, *args):
    """fn(*args) on a thread with a 512 MiB stack: CPython's C recursion limit is a count,
    not a measure of the stack, and a build whose count is high (3.12.3: about 2,700 of
    these levels) overflows an 8 MiB main-thread stack before it raises RecursionError
    (the GPU host's workers died of SIGSEGV in the bare measurement)."""
    out: list = []

    def run():
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out.append(e)

    old = threading.stack_size(512 << 20)
    try:
        th = threading.Thread(target=run)
        th.start()
    finally:
        threading.stack_size(old)
    th.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _deepest_through_c(call):
    """The deepest nesting of calls through C (sorted's key function: each level enters the
    interpreter again from C, counted against the C recursion limit on 3.12 and 3.13 and
    against the one limit on 3.11) at whose bottom call() still runs."""

    def down(n):
        if n == 0:
            return call()
        return sorted((n,), key=lambda _: down(n - 1))

    lo, hi = 0, 6000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            down(mid)
            lo = mid
        except RecursionError:
            hi = mid - 1
    return lo


@pytest.mark.parametrize("cast", ["half", "to"])
def test_a_hooked_cast_meets_the_recursion_limit_where_torch_does(cast):
    """The hook's own call of torch's C function counts one level against the recursion
    limit, as CPython's call of it does, and raises RecursionError at the same depth: on 3.11
    and 3.12 the hook keeps the counter itself while it is above 0 (base/compat.h,
    ML_INLINE_RECURSION) and leaves the limit to CPython's check."""
    t = torch.zeros(4)
    call = (lambda: t.half()) if cast == "half" else (lambda: t.to(torch.float16))
    limit = sys.getrecursionlimit()
    # 3.11: one limit for Python and C, a few hundred levels away; 3.12+: the C limit is
    # fixed, and the Python limit is set out of its way
    depth = len(__import__("inspect").stack(0))
    sys.setrecursionlimit(depth + (400 if sys.version_info < (3, 12) else 20000))
    lord = MemLord(auto_gc_bytes=None)
    try:
        bare = _in_a_big_stack(_deepest_through_c, call)
        with lord.hook_into_torch():
            hooked = _in_a_big_stack(_deepest_through_c, call)
            assert lord.allocated(CPU)[0] > 0  # the casts at the bottom were counted
    finally:
        sys.setrecursionlimit(limit)
    assert 0 < bare < 6000
    assert hooked == bare


@pytest.mark.parametrize("misbehaving", ["return_null_without_error", "return_result_with_error"])
@pytest.mark.parametrize("call", ["direct", "vectorcall"])
def test_a_hooked_original_that_breaks_the_call_protocol_raises_what_cpython_raises(
    monkeypatch, misbehaving, call
):
    """A C function returning NULL with no exception set, or a result with one set, becomes
    CPython's SystemError naming the function (the second with the exception as its cause and
    context), hooked as bare, down either path of the hook's call (base/compat.h):

    * ``direct``: a METH_VARARGS | METH_KEYWORDS builtin, torch's calling convention
      (tests/support/misbehaving.c), which the hook calls itself up to 3.13: on 3.10-3.12
      the result goes to _Py_CheckFunctionResult, on 3.13 to the hook's own check, written
      as CPython 3.13's;
    * ``vectorcall``: _testcapi's METH_NOARGS ones, called through their vectorcall
      (PyObject_Vectorcall up to 3.12; from 3.13 the hook calls the vectorcall and checks
      the result itself, ML_VECTORCALL_CHECK).

    (CPython's check of the hook's own result would give the same messages, the hook's repr
    being the original's: this pins what a user sees, not which of the two checks raised.)"""
    if call == "direct":
        original = getattr(misbehaving_extension.load(), misbehaving)
    else:
        original = getattr(pytest.importorskip("_testcapi"), misbehaving)
    monkeypatch.setattr(torch, "empty", original)

    def seen():
        with pytest.raises(SystemError) as info:
            torch.empty()
        e = info.value
        return [str(e), repr(e.__cause__), repr(e.__context__), e.__suppress_context__]

    bare = seen()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        assert torch.empty is not original  # hooked
        direct = "empty" in _core._hooks_info()["direct"]
        hooked = seen()
    assert direct == (call == "direct" and DIRECT_CALLS)
    assert hooked == bare
    if misbehaving == "return_null_without_error":
        assert bare == [
            f"{original!r} returned NULL without setting an exception",
            "None",
            "None",
            False,
        ]
    else:
        assert bare == [
            f"{original!r} returned a result with an exception set",
            "ValueError()",
            "ValueError()",
            True,
        ]
