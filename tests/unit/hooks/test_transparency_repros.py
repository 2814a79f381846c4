"""The transparency defects once reproduced by scripts (device contexts, lazy modules,
torch.compile, third-party patches, error types, the device table, nested conversions,
drop-in hooks), each as a test of the behaviour memlord promises now.

The corpus in test_transparency.py compares torch's behaviour hooked and unhooked; these
tests check memlord's own side: what is counted, what is raised, what disable() leaves.
"""

from __future__ import annotations

import copy
import functools
import pickle
import sys
import warnings

import pytest
import torch
from support import warm
from torch import nn
from torch.overrides import TorchFunctionMode

from memlord import MemLord, _core


def _alloc(lord, dev="cpu"):
    return lord.stats().get(dev, {}).get("allocated_total", 0)


# --------------------------------------------------------------------------- device contexts


DEVICE_CTX_SCRIPT = r"""
import torch, torch.utils._device as D
from torch import nn
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_python()
with torch.device("meta"):          # torch caches its constructor set now, while hooked
    t = torch.empty(1000, 1000)
    m = nn.Linear(4096, 4096)
inside = (str(t.device), str(m.weight.device), lord.allocated()[0])
h.disable()
with torch.device("meta"):
    u = torch.empty(3)
torch.set_default_device("meta")
v = torch.zeros(3)
torch.set_default_device(None)
h = lord.hook_into_python()
with torch.device("meta"):
    w = torch.ones(2)
h.disable()
print(inside, u.device, v.device, w.device, torch.zeros(1).device)
"""


def test_device_context_first_used_while_hooked():
    """torch's cached constructor set, built while hooked, works hooked and after disable()."""
    out = warm.run(  # a new process, where torch has not built that set yet
        [sys.executable, "-c", DEVICE_CTX_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["('meta',", "'meta',", "0)", "meta", "meta", "meta", "cpu"]


def test_hooks_are_found_in_torchs_constructor_set():
    import torch.utils._device as D

    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        ctors = D._device_constructors()
        assert torch.zeros in ctors and torch.ones in ctors and torch.empty in ctors
        with torch.device("meta"):
            assert torch.zeros(2).device.type == "meta"
    assert lord.allocated()[0] == 0


# --------------------------------------------------------------------------- lazy modules


@pytest.mark.parametrize("op", ["to_f64", "double", "half", "cpu"])
def test_lazy_module_converts_under_torch_hooks(op):
    lord = MemLord(auto_gc_bytes=None)
    m = nn.Sequential(nn.LazyLinear(8), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lord.hook_into_torch():
            r = {
                "to_f64": lambda: m.to(torch.float64),
                "double": m.double,
                "half": m.half,
                "cpu": m.cpu,
            }[op]()
    assert r is m
    assert lord.stats() == {}  # nothing to count: no memory yet


def test_allocate_of_lazy_model_counts_only_initialised_parameters():
    lord = MemLord(auto_gc_bytes=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(3))
    lord.allocate(m)
    assert lord.allocated("cpu")[0] == (2 * 2 + 2) * 4
    lord.free(m)
    assert lord.allocated("cpu")[0] == 0


# --------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_through_factory_hooks():
    def g(n):
        return torch.zeros(n) + 1

    lord = MemLord(auto_gc_bytes=None)
    torch._dynamo.reset()
    with lord.hook_into_python():
        out = torch.compile(g, backend="eager", fullgraph=True)(4)
    torch._dynamo.reset()
    assert out.tolist() == [1.0] * 4


def test_compile_counts_no_phantom_memory():
    """Tracing runs conversions on fake and functional tensors: none of them is counted."""

    def f(x):
        return x.half().float()

    x = torch.ones(1024)
    lord = MemLord(auto_gc_bytes=None)
    torch._dynamo.reset()
    with lord.hook_into_torch():
        f(x)
        eager = _alloc(lord)
        cf = torch.compile(f, backend="aot_eager")
        counted = []
        for _ in range(2):
            lord.reset()
            cf(x)
            counted.append(_alloc(lord))
    torch._dynamo.reset()
    assert eager == 1024 * 2 + 1024 * 4
    assert counted[0] == counted[1] <= eager  # first call (tracing) counts no more than later


def test_fake_tensor_conversions_are_not_counted():
    from torch._subclasses.fake_tensor import FakeTensorMode

    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python():
        with FakeTensorMode():
            t = torch.empty(1000)
            t.double()
            t.to("cpu", torch.float16)
            torch.zeros_like(t)
            lin = nn.Linear(100, 100)
            lin.weight.to(torch.float64)
    assert lord.stats() == {}


# --------------------------------------------------------------------------- third-party patches


@pytest.fixture
def tensor_to_restored():
    """torch.Tensor's own __dict__ entry for 'to' as it was (torch has none: it inherits
    TensorBase.to), whatever a test assigned."""
    own = torch.Tensor.__dict__.get("to")
    yield
    if own is None:
        if "to" in torch.Tensor.__dict__:
            del torch.Tensor.to
    else:
        torch.Tensor.to = own


def test_disable_keeps_a_patch_made_on_top(tensor_to_restored):
    orig = torch.Tensor.to
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_torch()
    hooked = torch.Tensor.to
    calls = []

    def lib_to(self, *a, **k):
        calls.append(1)
        return hooked(self, *a, **k)

    torch.Tensor.to = lib_to
    try:
        h.disable()
        assert torch.Tensor.__dict__["to"] is lib_to
        torch.ones(1).to(torch.float64)
        assert calls
        assert not _core._hooks_info()["installed"]
    finally:
        del torch.Tensor.to
    assert torch.Tensor.to is orig


def test_disable_never_resurrects_a_removed_patch(tensor_to_restored):
    orig = torch.Tensor.to

    def lib2(self, *a, **k):
        raise RuntimeError("library 2 wrapper should be gone")

    lord = MemLord(auto_gc_bytes=None)
    torch.Tensor.to = lib2
    try:
        h = lord.hook_into_torch()  # memlord's original is lib2
        torch.Tensor.to = orig  # library 2 uninstalls itself
        h.disable()
        assert torch.Tensor.to is orig
        assert torch.ones(1).to(torch.float64).dtype == torch.float64
    finally:
        torch.Tensor.to = orig


def test_module_level_patch_on_top_survives_disable():
    orig, orig_empty = torch.zeros, torch.empty
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python()
    hooked = torch.zeros

    def lib_zeros(*a, **k):
        return hooked(*a, **k)

    torch.zeros = lib_zeros
    try:
        h.disable()
        assert torch.zeros is lib_zeros
        assert torch.empty is orig_empty  # the rest restored
    finally:
        torch.zeros = orig


# --------------------------------------------------------------------------- error types


class LyingDevice(torch.Tensor):
    @property
    def device(self):
        return "cuda:0"  # a str, not a torch.device


class BadStorage(torch.Tensor):
    def untyped_storage(self):
        return 42


def _bad_objects():
    m_int = nn.Linear(2, 2)
    m_int._parameters["x"] = 5
    nested = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    nested[1][0]._buffers["b"] = "text"
    # (a jagged NestedTensor was here: its memory is read through its inner tensors now,
    # tests/unit/core/test_allocate_free.py)
    opaque = {}
    if torch.backends.mkldnn.is_available():
        opaque["mkldnn"] = (
            torch.ones(2, 2).to_mkldnn(),
            "argument 'obj' is a tensor whose memory cannot be read",
        )
    return {
        **opaque,
        "int_param": (m_int, "argument 'obj._parameters['x']' is a int"),
        "nested_buffer": (nested, "argument 'obj.1.0._buffers['b']' is a str"),
        "in_list": ([torch.ones(1), nested], "argument 'obj[1].1.0._buffers['b']'"),
        "device_str": (
            torch.ones(2).as_subclass(LyingDevice),
            "argument 'obj' is a tensor whose memory cannot be read",
        ),
        "storage_int": (
            [torch.ones(3), torch.ones(2).as_subclass(BadStorage)],
            "argument 'obj[1]' is a tensor whose memory cannot be read",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_objects()))
@pytest.mark.parametrize("method", ["allocate", "free"])
def test_bad_objects_raise_type_error_naming_where(case, method):
    obj, text = _bad_objects()[case]
    lord = MemLord(auto_gc_bytes=None)
    lord.allocate(torch.ones(4))
    before = lord.stats()
    with pytest.raises(TypeError) as info:
        getattr(lord, method)(obj)
    assert f"{method}(): {text}" in str(info.value)
    assert lord.stats() == before  # nothing changed


def test_unreadable_tensor_error_keeps_torchs_error_as_cause():
    lord = MemLord(auto_gc_bytes=None)
    with pytest.raises(TypeError) as info:
        lord.allocate(torch.ones(2).as_subclass(BadStorage))
    assert info.value.__cause__ is not None


# --------------------------------------------------------------------------- device table


class _Dev:
    def __init__(self, t, i):
        self.type, self.index = t, i


def _lying(devtype):
    class L(torch.Tensor):
        @property
        def device(self):
            return _Dev(devtype, 0)

    return torch.ones(1).as_subclass(L)


def test_unknown_device_type_never_enters_the_table():
    lord = MemLord(auto_gc_bytes=None)
    for i in range(70):  # more than the table holds
        with pytest.raises(TypeError, match="not a device type torch knows"):
            lord.allocate(_lying(f"bogus{i}"))
    assert lord.stats() == {}
    assert lord.top_alloc_site() is None
    other = MemLord(auto_gc_bytes=None)
    with pytest.raises(ValueError, match="bogus0"):
        other.allocated("bogus0")

    class Sub(torch.Tensor):
        pass

    lord.allocate(torch.ones(1).as_subclass(Sub))  # the table still has room
    assert lord.allocated("cpu")[0] == 4


RENAME_SCRIPT = r"""
import torch
from memlord import MemLord
class Dev:
    def __init__(self, t, i): self.type, self.index = t, i
class L(torch.Tensor):
    @property
    def device(self): return Dev("foo", 0)
torch.utils.rename_privateuse1_backend("foo")
lord = MemLord(auto_gc_bytes=None)
print(lord.allocated("foo")[0], lord.allocated("foo:0")[0])
lord.allocate(torch.ones(1).as_subclass(L))
print(sorted(lord.stats()), lord.allocated("foo:0")[0], lord.top_alloc_site()[0])
"""


def test_renamed_privateuse1_backend_is_a_device():
    out = warm.run(  # a new process: the backend's name is set once per process
        [sys.executable, "-c", RENAME_SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["0 0", "['foo:0'] 4 foo:0"]


# --------------------------------------------------------------------------- nested conversions


class SideCopy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func == torch.Tensor.double:
            self.kept = args[0].to(torch.float16)  # a real, different allocation
        return func(*args, **(kwargs or {}))


def test_different_conversion_inside_a_hooked_call_counts():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch():
        with SideCopy():
            torch.ones(100).double()
    assert _alloc(lord) == 800 + 200


class Passthrough(torch.Tensor):
    pass


class Reentering(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_same_conversion_reentering_counts_once():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch():
        torch.ones(100).as_subclass(Passthrough).double()
        with Reentering():
            torch.ones(50).double()
            torch.ones(25).to(torch.float16)
    assert _alloc(lord) == 800 + 400 + 50


class Counting(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", "?"))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclass_override_sees_only_the_programs_calls():
    s = torch.ones(8).as_subclass(Counting)
    Counting.calls = []
    s.to(torch.float64)
    expected = list(Counting.calls)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch():
        Counting.calls = []
        s.to(torch.float64)
        seen = list(Counting.calls)
    assert seen == expected
    assert _alloc(lord) == 64


# --------------------------------------------------------------------------- results and failures


class ReturnsString(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("to", "half", "clone"):
            return "converted"
        return super().__torch_function__(func, types, args, kwargs or {})


def test_any_result_type_is_returned_unchanged():
    s = torch.ones(2).as_subclass(ReturnsString)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python():
        assert s.to(torch.float64) == "converted"
        assert s.half() == "converted"
        assert s.clone() == "converted"
    assert lord.stats() == {}


class BadDeviceAfterConversion(torch.Tensor):
    """Converts fine, but its device cannot be read: accounting fails, torch does not."""

    @property
    def device(self):
        raise RuntimeError("device unreadable")


def test_accounting_failure_is_unraisable_and_the_result_stands(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_type))
    s = torch.ones(4).as_subclass(BadDeviceAfterConversion)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch():
        r = s.to(torch.float64)
    assert type(r) is BadDeviceAfterConversion
    with torch._C.DisableTorchFunctionSubclass():
        assert r.dtype == torch.float64 and r.tolist() == [1.0] * 4
    assert seen == [RuntimeError]


# --------------------------------------------------------------------------- drop-in hooks


class HoldsFactory(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.init_fn = torch.zeros


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_hooks_are_drop_in_replacements():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python():
        assert torch.zeros is not torch.zeros.__wrapped__  # hooked
        assert pickle.loads(pickle.dumps(torch.zeros)) == torch.zeros
        assert pickle.dumps(torch.zeros) == pickle.dumps(torch.zeros.__wrapped__)
        assert pickle.dumps(torch.Tensor.to) == pickle.dumps(torch.Tensor.to.__wrapped__)
        p = pickle.loads(pickle.dumps(functools.partial(torch.empty, 3)))
        assert p().shape == (3,)
        m = copy.deepcopy(HoldsFactory())
        assert m.init_fn is torch.zeros
        assert torch.overrides.resolve_name(torch.zeros) == "torch.zeros"
        assert torch.overrides.is_tensor_method_or_property(torch.Tensor.to)
        assert torch.zeros.__qualname__ == torch.zeros.__wrapped__.__qualname__
        assert torch.Tensor.to.__objclass__ is torch._C.TensorBase
        captured = torch.zeros
        held = HoldsFactory()

        def scripted(n: int):
            return torch.zeros(n)

        assert torch.jit.script(scripted)(2).tolist() == [0.0, 0.0]
    # what captured a hook while hooked stays usable and picklable after disable()
    assert pickle.loads(pickle.dumps(captured)) == torch.zeros
    assert pickle.loads(pickle.dumps(held)).init_fn == torch.zeros
    assert captured == torch.zeros and hash(captured) == hash(torch.zeros)


def test_module_function_pickles_after_disable():
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch():
        hooked = nn.Module.to
        assert pickle.loads(pickle.dumps(hooked)) is hooked
    assert nn.Module.to is not hooked
    assert pickle.loads(pickle.dumps(hooked)) is nn.Module.to
