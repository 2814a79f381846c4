"""An exact ledger under lifetime tracking: memlord follows storages, not tensor objects.

With ``hook_into_python()`` (and ``hook_into_torch()`` for conversions) on, a storage counts
once, from the moment a tracked factory, conversion, ``nn.Parameter`` or ``allocate()`` first
sees it until it dies, whatever tensor objects share it (views, ``detach()``, ``.data``,
re-wrapped parameters, swapped tensors). Sizes are storage bytes; meta and fake storages are 0.

Each reproduction of a known defect (shared/repros/rNN_*.py) is a test here. The crash
reproductions run in a subprocess (a crash there fails the test instead of killing the run),
and under tools/asan_run.py that subprocess runs under the sanitizers too.

Everything runs on the CPU with real torch objects.
"""

from __future__ import annotations

import gc
import os
import sys
import textwrap
import warnings
import weakref

import pytest
import torch
from support import warm
from torch import nn

import memlord
from memlord import MemLord, _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(memlord.__file__)))
TIMEOUT_S = 300

pytestmark = pytest.mark.usefixtures("tensor_abi")


# --------------------------------------------------------------------------- helpers


def cpu(lord, key="allocated"):
    return lord.stats().get("cpu", {}).get(key, 0)


def storage_bytes(*objs) -> int:
    """Bytes of the distinct storages of tensors and modules (params and buffers)."""
    seen = {}
    for obj in objs:
        tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, nn.Module) else [obj]
        for t in tensors:
            s = t.untyped_storage()
            if s.device.type != "meta":
                seen[id(s)] = s.nbytes()
    return sum(seen.values())


def python_installed() -> bool:
    return _core._hooks_info()["python_installed"]


@pytest.fixture
def tracking(lord):
    """Both hooks on (factories, deep autowrap, conversions); off again after the test."""
    py = lord.hook_into_python()
    th = lord.hook_into_torch()
    yield lord
    th.disable()
    py.disable()
    assert not python_installed()


@pytest.fixture
def future_flags():
    """Restores torch.__future__'s conversion flags after the test."""
    fut = torch.__future__
    saved = (
        fut.get_overwrite_module_params_on_conversion(),
        fut.get_swap_module_params_on_conversion(),
    )
    yield fut
    fut.set_overwrite_module_params_on_conversion(saved[0])
    fut.set_swap_module_params_on_conversion(saved[1])


def run_python(code, *, timeout=TIMEOUT_S):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for k in ("DEBUG", "NO_COLOR", "PYTHONWARNINGS"):
        env.pop(k, None)
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    # a child of the warm interpreter (tests/support/warm.py), without importing torch again
    return warm.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


# --------------------------------------------------------------------------- tensor objects


def test_tensor_objects_carry_no_weak_reference(tracking):
    t = torch.empty(16)
    p = nn.Parameter(torch.empty(4))
    m = nn.Linear(3, 3)
    lord = tracking
    lord.allocate([t, p, m])
    for x in (t, p, m.weight, m.bias, t.half()):
        assert weakref.getweakrefcount(x) == 0
    assert lord.hook_into_python().tracked == 5


def test_swap_tensors_accepts_tracked_tensors(tracking):
    """torch.utils.swap_tensors accepts tracked tensors (tracking adds no weak reference), and
    each storage is credited when it dies (repro r05)."""
    lord = tracking
    a = torch.empty(10)
    b = torch.empty(20)
    torch.utils.swap_tensors(a, b)
    assert a.numel() == 20 and b.numel() == 10
    assert cpu(lord) == 120
    del a
    gc.collect()
    assert cpu(lord) == 40
    del b
    gc.collect()
    assert cpu(lord) == 0


def test_script_module_is_walked_as_its_module(lord, monkeypatch):
    """A ScriptModule's _parameters, _buffers and _modules are torch.jit's mappings, not
    dicts: allocate() counts every storage of it and of its submodules, and converting it
    under tracking reports no failure, the ledger equal to its live storages."""
    torch.manual_seed(0)
    m = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4))))
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    with lord.hook_into_python():
        lord.allocate(m)
        assert cpu(lord) == storage_bytes(m) == 4 * (8 * 8 + 8 + 8 * 4 + 4)
        with lord.hook_into_torch():
            m.half()
            m.to(torch.float64)
        gc.collect()
        assert reports == []
        assert cpu(lord) == storage_bytes(m) == 8 * (8 * 8 + 8 + 8 * 4 + 4)
        del m
        gc.collect()
        assert cpu(lord) == 0


@pytest.mark.parametrize("swap", [False, True], ids=["plain", "swap"])
def test_module_to_under_swap_on_conversion(tracking, future_flags, swap):
    """Module.to() on a tracked model, with and without set_swap_module_params_on_conversion:
    the ledger equals the live storage bytes (repro r05)."""
    future_flags.set_swap_module_params_on_conversion(swap)
    lord = tracking
    m = nn.Linear(4, 4)
    m.to(torch.float64)
    gc.collect()
    assert m.weight.dtype == torch.float64
    assert cpu(lord) == storage_bytes(m) == 160


# --------------------------------------------------------------------------- conversions

SPELLINGS = {
    "to(float64)": lambda m: m.to(torch.float64),
    "to(dtype=half)": lambda m: m.to(dtype=torch.float16),
    "half": lambda m: m.half(),
    "float": lambda m: m.float(),
    "double": lambda m: m.double(),
    "bfloat16": lambda m: m.bfloat16(),
    "cpu": lambda m: m.cpu(),
    "type(float64)": lambda m: m.type(torch.float64),
    "_apply(double)": lambda m: m._apply(lambda t: t.double()),
    "_apply(arith)": lambda m: m._apply(lambda t: t * 2),
    "to_empty(cpu)": lambda m: m.to_empty(device="cpu"),
    "to(meta)": lambda m: m.to("meta"),
    "double then to(float32)": lambda m: (m.double(), m.to(torch.float32)),
    "half then float": lambda m: (m.half(), m.float()),
}


@pytest.mark.parametrize("flags", ["none", "overwrite", "swap", "both"])
@pytest.mark.parametrize("how", sorted(SPELLINGS))
def test_every_module_conversion_spelling_is_exact(tracking, future_flags, how, flags):
    """Every Module conversion spelling, under each torch.__future__ flag, ends with the
    ledger equal to the live storage bytes (repros r07, r08)."""
    future_flags.set_overwrite_module_params_on_conversion(flags in ("overwrite", "both"))
    future_flags.set_swap_module_params_on_conversion(flags in ("swap", "both"))
    lord = tracking
    m = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32))
    SPELLINGS[how](m)
    gc.collect()
    assert cpu(lord) == storage_bytes(m)
    del m
    gc.collect()
    assert cpu(lord) == 0


@pytest.mark.parametrize(
    "how",
    [
        "m.to(torch.float64)",
        "m.double()",
        "m.half()",
        "m._apply(lambda t: t.double())",
        "(m.double(), m.to(torch.float32))",
    ],
)
def test_module_conversion_counts_the_converted_weight_once(lord, how):
    """Each Module conversion (to, double, half, _apply, double then to) leaves the ledger
    equal to the converted weight's storage, counted once (repro r07)."""
    with lord.hook_into_torch(), lord.hook_into_python():
        m = nn.Linear(256, 256, bias=False)
        eval(how)
        gc.collect()
        assert lord.allocated()[0] == m.weight.untyped_storage().nbytes()


def test_parameters_replaced_on_conversion_are_counted(lord, future_flags):
    """With set_overwrite_module_params_on_conversion(True), Module.to() replaces each
    Parameter: the new parameter's storage is what the ledger holds (repro r08)."""
    future_flags.set_overwrite_module_params_on_conversion(True)
    with lord.hook_into_torch(), lord.hook_into_python():
        m = nn.Linear(256, 256, bias=False)
        m.to(torch.float64)
        gc.collect()
        assert lord.allocated()[0] == m.weight.nbytes == 524288


def test_move_keeps_the_source_counted_while_it_lives(tracking):
    """With tracking on, y = x.to(...) credits x when x's storage dies, not at the move."""
    lord = tracking
    x = torch.empty(100)
    y = x.to("meta")
    assert cpu(lord) == 400 and cpu(lord, "freed") == 0
    z = x.to(torch.float64)
    assert cpu(lord) == 1200
    del x
    gc.collect()
    assert cpu(lord) == 800 and cpu(lord, "freed") == 400
    del y, z
    gc.collect()
    assert cpu(lord) == 0


def test_move_with_tracking_off_credits_at_the_move(lord):
    with lord.hook_into_torch():
        x = torch.empty(100)
        lord.allocate(x)
        x.to("meta")
        assert cpu(lord) == 0 and cpu(lord, "freed") == 400


def test_plain_lord_beside_a_tracking_lord(lord):
    """Two lords on the same conversion: each follows its own rule."""
    plain = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(), lord.hook_into_torch(), plain.hook_into_torch():
        x = torch.empty(100)  # counted by the tracking lord only (factory)
        plain.allocate(x)
        y = x.to("meta")
        assert cpu(lord) == 400 and cpu(lord, "freed") == 0
        assert cpu(plain) == 0 and cpu(plain, "freed") == 400
        del x, y
        gc.collect()
        assert cpu(lord) == 0 and cpu(lord, "freed") == 400
        assert cpu(plain, "freed") == 400


def test_deep_autowrap_off_counts_conversions_without_tracking(lord):
    with lord.hook_into_python(enable_deep_autowrap=False) as h, lord.hook_into_torch():
        t = torch.empty(100)
        u = t.double()
        assert cpu(lord) == 1200 and h.tracked == 1
        del u
        gc.collect()
        assert cpu(lord, "freed") == 0
        del t
        gc.collect()
        assert cpu(lord, "freed") == 400


# --------------------------------------------------------------------------- parameters


def test_weight_norm_keeps_the_live_weights_counted(tracking):
    """weight_norm re-wraps the weight's storage in new Parameters: the ledger equals the
    live parameters' bytes (repro r09)."""
    lord = tracking
    m = nn.Linear(64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(m)
    gc.collect()
    live = sum(p.untyped_storage().nbytes() for p in m.parameters())
    assert live == 16896
    assert lord.allocated()[0] == live


def test_parametrized_weight_norm(tracking):
    lord = tracking
    m = nn.Linear(32, 32)
    torch.nn.utils.parametrizations.weight_norm(m)
    gc.collect()
    assert cpu(lord) == storage_bytes(m)
    del m
    gc.collect()
    assert cpu(lord) == 0


def test_parameter_rewrap_keeps_the_storage_counted(tracking):
    lord = tracking
    p = nn.Parameter(torch.empty(100))
    q = nn.Parameter(p.data)
    del p
    gc.collect()
    assert cpu(lord) == 400 and cpu(lord, "freed") == 0
    del q
    gc.collect()
    assert cpu(lord) == 0 and cpu(lord, "freed") == 400


def test_parameter_of_an_untracked_storage_is_counted(lord):
    data = torch.empty(50)  # made before tracking
    with lord.hook_into_python() as h:
        p = nn.Parameter(data)
        assert cpu(lord) == 200 and h.tracked == 1
        del data, p
        gc.collect()
        assert cpu(lord) == 0 and cpu(lord, "freed") == 200


# --------------------------------------------------------------------------- free, allocate

VIEWS = {
    "slice": lambda t: t[:10],
    "detach": lambda t: t.detach(),
    "data": lambda t: nn.Parameter(t).data,
    "view": lambda t: t.view(10, 100),
    "itself": lambda t: t,
}


@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_free_of_a_sharing_tensor_credits_its_storage_once(lord, kind):
    """free() of a view, detach(), .data or the tensor itself credits the storage once;
    the base's later death credits nothing more (repro r10)."""
    with lord.hook_into_python() as h:
        keep = torch.empty(1000)
        t = torch.empty(1000)
        lord.free(VIEWS[kind](t))
        assert h.tracked == 1
        del t
        gc.collect()
        s = lord.stats()["cpu"]
        assert s["allocated"] == 4000 == keep.nbytes
        assert s["freed_total"] == 4000
        assert s["frees"] == 1


def test_allocate_after_a_factory_counts_once(lord):
    """The quick start: x = torch.empty(...); lord.allocate(x) counts x once."""
    with lord.hook_into_python() as h:
        x = torch.empty(256)
        lord.allocate(x)
        lord.allocate([x, x.view(16, 16), x.detach()])
        assert cpu(lord) == 1024 and cpu(lord, "allocs") == 1 and h.tracked == 1
        del x
        gc.collect()
        assert cpu(lord) == 0


def test_allocate_of_shared_storages_counts_each_once(lord):
    with lord.hook_into_python():
        pass
    base = torch.empty(100)
    with lord.hook_into_python() as h:
        lord.allocate(base[:10])
        lord.allocate(base[50:])
        assert cpu(lord) == 400 and h.tracked == 1


def test_free_then_death_credits_nothing_more(lord):
    with lord.hook_into_python() as h:
        t = torch.empty(100)
        v = t[5:]
        lord.free(v)
        assert h.tracked == 0 and cpu(lord, "freed") == 400
        del t, v
        gc.collect()
        assert cpu(lord, "freed") == 400


# --------------------------------------------------------------------------- sizes


def test_moving_an_expanded_view_credits_its_storage(lord):
    """Moving an expanded view (tracking off) credits the 4-byte storage, not numel x 4
    (repro r11)."""
    with lord.hook_into_torch():
        keep = torch.zeros(1000)
        lord.allocate(keep)
        torch.zeros(1).expand(10**6).to("meta")
    s = lord.stats()["cpu"]
    assert s["freed"] == 4  # the source's storage, credited at the move
    assert s["allocated"] == 4000 - 4


def test_zero_stride_tensor_counts_its_storage_bytes(lord):
    """torch.empty_strided with a zero stride counts its 4-byte storage, not numel x 4
    (repro r11)."""
    with lord.hook_into_python():
        t = torch.empty_strided((10**6,), (0,))
        assert lord.allocated()[0] == t.untyped_storage().nbytes() == 4


def test_a_huge_zero_stride_tensor_counts_without_int64_wrap(lord):
    """A zero-stride tensor of 2**62 + 2**59 elements counts its 4-byte storage: no size
    product wraps in int64 (repro r11)."""
    with lord.hook_into_python():
        u = torch.empty_strided((2**62 + 2**59,), (0,))
        assert lord.allocated()[0] == u.untyped_storage().nbytes() == 4


def test_expanded_cast_counts_the_result_storage(tracking):
    lord = tracking
    x = torch.zeros(1, 8).expand(1000, 8)  # a 32 B storage
    y = x.double()  # materialised: 1000 * 8 * 8 B
    assert cpu(lord) == 32 + y.untyped_storage().nbytes()


def test_storage_sizes_of_the_hooks():
    """_tensor_meta reports what the hooks count: storage bytes, 0 for meta."""
    base = torch.empty(100)
    assert _core._tensor_meta(base[10:20]) == ("cpu", 400, base.untyped_storage().data_ptr())
    ones = torch.zeros(1)
    assert _core._tensor_meta(ones.expand(10**6)) == ("cpu", 4, ones.data_ptr())
    assert _core._tensor_meta(torch.empty(10, device="meta"))[1] == 0


# --------------------------------------------------------------------------- fake, functorch


def test_fake_tensors_count_zero_bytes(lord):
    """Fake tensors hold no memory: allocate() of them, factories and conversions under
    FakeTensorMode count 0 bytes, without torch's FakeTensor data-pointer warning
    (repro r13)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        a = torch.ones(5)
        b = torch.zeros(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FakeTensor data-pointer warning either
        lord.allocate([a, b])
    assert lord.allocated()[0] == 0
    with lord.hook_into_python() as h, lord.hook_into_torch():
        with mode:
            c = torch.empty(1000, 1000)
            d = c.double()
            e = c.to("cpu")
        assert lord.allocated()[0] == 0 and h.tracked == 0
    del c, d, e


def test_compiled_function_counts_real_conversions_only(lord):
    """torch.compile: tracing converts fake and functional tensors, which count nothing;
    every call of the compiled function counts what eager counts (repro r06)."""
    import torch._dynamo

    def f(x):
        return x.half().float()

    x = torch.ones(1024)
    with lord.hook_into_torch():
        f(x)
        eager = cpu(lord, "allocated_total")
        assert eager == 6144
        cf = torch.compile(f, backend="aot_eager")
        for _ in range(2):
            lord.reset()
            cf(x)
            assert cpu(lord, "allocated_total") in (0, eager)
    torch._dynamo.reset()


def test_vmap_counts_the_batched_storage(lord):
    """A conversion under torch.func.vmap counts the whole batched storage, as eager does,
    not one example's share (repro r14)."""
    x = torch.ones(64, 1000)

    def f(r):
        return r.half().float()

    with lord.hook_into_torch():
        f(x)
        eager = cpu(lord, "allocated_total")
        lord.reset()
        torch.func.vmap(f)(x)
        assert cpu(lord, "allocated_total") == eager == 384000


def test_vmap_with_tracking_is_exact(tracking):
    lord = tracking
    x = torch.ones(64, 100)
    y = torch.func.vmap(lambda r: r.double() * 2)(x)
    gc.collect()
    # the intermediate batched double() died with the transform; x was made before... by ones
    assert cpu(lord) == storage_bytes(x)
    del y


def test_grad_transform_counts_real_storages(lord):
    with lord.hook_into_torch():
        torch.func.grad(lambda r: r.double().sum())(torch.ones(10))
        assert cpu(lord, "allocated_total") == 80


# --------------------------------------------------------------------------- crash-proofing

PARAMETER_OF_DATA_WHILE_THE_GC_RUNS = """
import gc, weakref, torch
from torch import nn
from memlord import MemLord

class Sub(torch.Tensor):
    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "_is_param":
            global holder
            holder = None
            gc.enable()

lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_python()
data = torch.Tensor(16).as_subclass(Sub)
gc.collect()
gc.disable()
gc.set_threshold(1)

class Holder: pass
holder = Holder(); holder.me = holder
holder.w = weakref.ref(data, lambda r: None)
lord.allocate(data)

p = nn.Parameter(data)
gc.set_threshold(700)
gc.enable()
print("done", h.tracked)
del data, p
gc.collect()
print("freed", lord.stats()["cpu"]["freed"])
h.disable()
"""

LORD_COLLECTED_IN_ITS_TRACKER_CALLBACK = """
import gc, torch
from memlord import MemLord

class Trainer:
    def __init__(self):
        self.lord = MemLord(auto_gc_bytes=None)
        self.me = self

def killer():
    global params
    del params

gc.disable()
gc.set_threshold(1)
tr = Trainer()
with tr.lord.hook_into_python():
    params = torch.empty(1000)
del tr
gc.enable()
killer()
gc.set_threshold(700)
print("survived")
"""

RESET_IN_A_FINALIZER_WHILE_ALLOCATE_TRACKS = """
import gc, sys
import numpy as np
from memlord import MemLord

lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_python(enable_factory_wrappers=False)
a = np.ones(1000)
sys._getframe()

class EpochEnd:
    def __del__(self):
        lord.reset()

gc.disable()
gc.set_threshold(1)
e = EpochEnd(); e.me = e; del e
lord.reset()
gc.enable()
lord.allocate(a)
gc.set_threshold(700)
print("survived", h.tracked)
del a
gc.collect()
print("after del", lord.stats().get("cpu", {}).get("freed", 0))
h.disable()
"""

RESET_FROM_THREADS_WHILE_ALLOCATE_TRACKS = """
import threading, time, sys, torch, numpy as np
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_python(enable_factory_wrappers=False)
stop = threading.Event()
class Cyc:
    def __init__(self): self.me = self; self.t = torch.empty(256)
def registrar():
    arrs = [np.ones(8) for _ in range(64)]
    ts = [torch.empty(8) for _ in range(64)]
    while not stop.is_set():
        for a, t in zip(arrs, ts):
            lord.allocate(a); lord.allocate(t)
        lord.free(ts[:8])
        junk = [Cyc() for _ in range(50)]
def resetter():
    while not stop.is_set():
        lord.reset()
        time.sleep(0)
ts = [threading.Thread(target=registrar), threading.Thread(target=resetter),
      threading.Thread(target=resetter)]
[t.start() for t in ts]
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 3)
stop.set(); [t.join() for t in ts]
h.disable()
print("survived")
"""


def test_parameter_of_tracked_data_survives_a_gc_during_the_transfer():
    """nn.Parameter(data) while the cyclic GC frees a weak reference to data: no crash, the
    storage stays tracked once and is credited when it dies (repro r02)."""
    r = run_python(PARAMETER_OF_DATA_WHILE_THE_GC_RUNS)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.split() == ["done", "1", "freed", "64"], r.stdout


def test_lord_collected_inside_its_own_tracker_callback():
    """A lord that is cyclic garbage when one of its tracked storages dies is collected
    without the tracker callback touching freed memory (repro r21)."""
    r = run_python(LORD_COLLECTED_IN_ITS_TRACKER_CALLBACK)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.strip() == "survived"


def test_reset_in_a_finalizer_while_allocate_tracks():
    """The finalizer's reset() lands inside allocate() up to CPython 3.11, where an
    allocation runs the cyclic GC at once: the reset comes first and the array is then
    tracked. From 3.12 the GC runs at the next bytecode, after allocate() returned: the
    reset forgets the tracked array. Either way the ledger agrees with the registry
    (repro r23)."""
    r = run_python(RESET_IN_A_FINALIZER_WHILE_ALLOCATE_TRACKS)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    if sys.version_info >= (3, 12):
        assert r.stdout.split() == ["survived", "0", "after", "del", "0"], r.stdout
    else:
        assert r.stdout.split() == ["survived", "1", "after", "del", "8000"], r.stdout


def test_reset_from_other_threads_while_allocate_tracks():
    """Other threads call reset() while one thread allocate()s with lifetime tracking on and
    reference cycles become garbage: the process survives (repro r23b)."""
    r = run_python(RESET_FROM_THREADS_WHILE_ALLOCATE_TRACKS)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.strip() == "survived"


def test_lord_dropped_while_its_storages_live():
    """The registry outlives its lord only as an inert table: later deaths credit nobody."""
    r = run_python(
        """
        import gc, torch
        from memlord import MemLord
        lord = MemLord(auto_gc_bytes=None)
        with lord.hook_into_python():
            ts = [torch.empty(10) for _ in range(100)]
        del lord
        gc.collect()
        del ts
        gc.collect()
        print("ok")
        """
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert r.stdout.strip() == "ok"


def test_module_type_conversion_counts_converted_gradients():
    """Module._apply converts gradients with the parameters; spellings that go through no
    hooked conversion (type, _apply) still count the new gradient storages."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(), lord.hook_into_torch():
        m = nn.Linear(6, 4)
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        m.type(torch.float64)
        live = sum(
            p.untyped_storage().nbytes() + p.grad.untyped_storage().nbytes() for p in m.parameters()
        )
        assert lord.allocated("cpu")[0] == live == 2 * 2 * (24 + 4) * 8 // 2
