"""The dispatch mode (``hook_into_python(ops=True)``): what it counts, against torch's own figures.

Every aten operator's new outputs (the returns its schema gives no alias annotation) are
counted once per storage and credited when the storage dies; views, in-place ops and
``out=`` add nothing; ``resize_`` and ``set_`` count the change of size of a storage. The
reference is always torch's own: ``t.untyped_storage().nbytes()`` of the storages the test
still holds (the ledger equals their sum once everything else is gone).

Everything runs on the CPU with real torch objects. Each test turns its hooks off again,
whatever happens (the ``ops_lord`` fixture): the dispatch mode sits on this thread's stack.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import torch
from support.ledger import ledger, storage_bytes
from torch import nn

from memlord import MemLord

# ----------------------------------------------------------------------- what counts


def test_op_outputs_are_counted_once_per_storage(ops_lord):
    a = torch.randn(1000)  # a factory: counted by the factory hook
    b = a * 2
    c = torch.mm(a.view(10, 100).t(), a.view(10, 100))
    values, indices = torch.sort(a)  # two new outputs, two storages
    assert ledger(ops_lord) == storage_bytes(a, b, c, values, indices)
    del b, c
    assert ledger(ops_lord) == storage_bytes(a, values, indices)
    del values
    assert ledger(ops_lord) == storage_bytes(a, indices)


def test_each_new_output_storage_is_one_event_with_its_address(ops_lord):
    """An operator with several new outputs (torch.sort: values and indices) records one
    alloc event per storage, with the storage's data pointer, as each storage's death
    does: a reader that pairs allocations with frees by address (torch's memory_viz on
    the profile's pickle) finds every free's allocation."""
    a = torch.randn(1000)
    ops_lord.record_events(64)
    values, indices = torch.sort(a)
    born = [e for e in ops_lord.decode_events(ops_lord.events(clear=True)) if e["source"] == "op"]
    expect = {values.untyped_storage().data_ptr(): 4000, indices.untyped_storage().data_ptr(): 8000}
    assert {e["address"]: e["bytes"] for e in born} == expect
    assert [e["count"] for e in born] == [1, 1]
    del values, indices
    died = [e for e in ops_lord.decode_events(ops_lord.events()) if e["source"] == "death"]
    assert {e["address"]: e["bytes"] for e in died} == expect


def test_views_in_place_and_out_add_nothing(ops_lord):
    a = torch.randn(64, 64)
    b = a + 1
    before = ledger(ops_lord)
    views = [b.view(-1), b.t(), b[1:], b.unsqueeze(0), b.expand(2, 64, 64), *b.chunk(4), b.T]
    b.add_(1)
    b.mul_(a)
    torch.add(a, a, out=b)
    torch.mm(a, a, out=b)
    torch.sum(a, dim=0, out=b[0])
    b.copy_(a)
    b.zero_()
    assert ledger(ops_lord) == before == storage_bytes(a, b, *views)


def test_out_tensor_that_torch_grows_counts_its_new_memory(ops_lord):
    """out= into a tensor too small for the result: torch resizes the out tensor (new
    memory); the growth is counted, a tensor of the right size adds nothing."""
    a = torch.randn(100, 100)
    b = torch.empty(0)  # empty: not tracked until torch gives it memory
    torch.mm(a, a, out=b)
    assert ledger(ops_lord) == storage_bytes(a, b) == 80000
    c = torch.empty(10)
    with pytest.warns(UserWarning, match="resized"):  # torch's deprecation of the resize
        torch.cat([a, a], out=c)  # tracked, grown: the change counted
    values, indices = torch.empty(0), torch.empty(0, dtype=torch.long)
    torch.sort(a, out=(values, indices))  # two out tensors, both grown
    assert ledger(ops_lord) == storage_bytes(a, b, c, values, indices)
    before = ledger(ops_lord)
    torch.mm(a, a, out=b)  # the right size already: nothing new
    torch.add(a, 1, out=values)
    assert ledger(ops_lord) == before == storage_bytes(a, b, c, values, indices)
    del b, c, values, indices
    assert ledger(ops_lord) == storage_bytes(a)


def test_foreach_outputs_counted_each(ops_lord):
    xs = [torch.randn(10 + i) for i in range(20)]  # more than the C side's 8 inline items
    ys = torch._foreach_mul(xs, 2.0)
    assert ledger(ops_lord) == storage_bytes(*xs, *ys)
    del ys
    assert ledger(ops_lord) == storage_bytes(*xs)


def test_resize_counts_the_new_size_and_death_credits_it(ops_lord):
    t = torch.empty(0)
    t.resize_(1000)  # not tracked yet (empty): counted whole
    assert ledger(ops_lord) == t.untyped_storage().nbytes() == 4000
    t.resize_(3000)  # grows: the change counted
    assert ledger(ops_lord) == t.untyped_storage().nbytes() == 12000
    t.resize_(10)  # shrinking keeps the storage's bytes (torch's own figure)
    assert ledger(ops_lord) == t.untyped_storage().nbytes() == 12000
    u = torch.randn(10)
    u.resize_as_(torch.empty(50, 50))
    assert ledger(ops_lord) == storage_bytes(t, u)
    del t, u
    assert ledger(ops_lord) == 0


def test_set_counts_the_storage_it_takes(ops_lord):
    src = torch.randn(500)
    t = torch.empty(0)
    t.set_(src)  # shares src's storage: nothing new
    assert ledger(ops_lord) == storage_bytes(src) == 2000
    outside = torch.UntypedStorage(800)  # made by no operator: not tracked
    u = torch.empty(0, dtype=torch.uint8)
    u.set_(outside)
    assert ledger(ops_lord) == storage_bytes(src, u) == 2800
    del src, t
    assert ledger(ops_lord) == 800
    del u, outside
    assert ledger(ops_lord) == 0


# ----------------------------------------------------------------------- backward


class Nest(torch.autograd.Function):
    """Backward runs a backward of its own, ``depth`` deep: past the autograd engine's
    reentrant limit the engine runs it on a thread of its pool."""

    kept: list = []
    threads: set = set()

    @staticmethod
    def forward(ctx, x, depth):
        ctx.depth = depth
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Nest.threads.add(threading.get_ident())
        if ctx.depth > 0:
            with torch.enable_grad():
                y = torch.ones(4, requires_grad=True)
                (gy,) = torch.autograd.grad(Nest.apply(y, ctx.depth - 1).sum(), y)
        out = g * 3 + 1  # made in backward, on whatever thread runs this
        Nest.kept.append((threading.get_ident(), out))
        return out, None


def settled_ledger(lord, want: int, timeout: float = 10.0) -> int:
    """The ledger once it equals `want`, or when `timeout` runs out.  backward() returns
    when the autograd engine's worker threads have computed the last gradient, a little
    before they drop their own references to what they made (torch's C++ holds them, out
    of the cyclic GC's sight): until then those storages are alive, and the ledger rightly
    counts them."""
    deadline = time.monotonic() + timeout
    got = ledger(lord)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.005)
        got = ledger(lord)
    return got


def test_ops_in_backward_on_the_engines_threads_are_counted(ops_lord):
    Nest.kept, Nest.threads = [], set()
    x = torch.ones(4, requires_grad=True)
    Nest.apply(x, 70).sum().backward()
    main = threading.get_ident()
    others = [t for tid, t in Nest.kept if tid != main]
    assert others, "the engine ran no backward on another thread: the test proves nothing"
    kept = [t for _, t in Nest.kept]
    want = storage_bytes(x, x.grad, *kept)
    assert settled_ledger(ops_lord, want) == want
    cats = ops_lord.stats()["cpu"]["categories"]
    assert cats["temporary"] >= storage_bytes(*others)
    Nest.kept = []
    del kept, others
    want = storage_bytes(x, x.grad)
    assert settled_ledger(ops_lord, want) == want


# ----------------------------------------------------------------------- no fake bytes


def test_fake_tensor_mode_counts_nothing(ops_lord):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(1000, 1000)
        y = x @ x
        z = torch.empty(500, 500).add_(1)
        w = y.sum(0).resize_(5000)
    assert ledger(ops_lord) == 0
    del x, y, z, w
    assert ledger(ops_lord) == 0


def test_meta_tensors_count_nothing(ops_lord):
    x = torch.randn(1000, 1000, device="meta")
    y = x @ x
    z = torch.empty(0, device="meta").resize_(10000)
    ones = torch.ones(4)
    assert ledger(ops_lord) == storage_bytes(ones)
    del x, y, z


def test_vmap_grad_and_functionalize_count_only_real_storages(ops_lord):
    x = torch.randn(8, 16)

    def f(v):
        w = v * 2
        w.add_(1)
        return (w.sin() * v).sum()

    vm = torch.vmap(f)(x)
    g = torch.func.grad(f)(x[0].clone())
    fn = torch.func.functionalize(lambda v: v.clone().mul_(3).view(-1))(x)
    jac = torch.func.vmap(torch.func.grad(f))(x)
    assert ledger(ops_lord) == storage_bytes(x, vm, g, fn, jac)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_code_counts_only_real_storages(ops_lord, backend):
    torch._dynamo.reset()
    try:
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        x = torch.randn(16, 32, requires_grad=True)
        out = torch.compile(m, backend=backend)(x)
        out.sum().backward()
        live = [x, out, x.grad, *m.parameters(), *(p.grad for p in m.parameters())]
        assert ledger(ops_lord) == storage_bytes(*live)
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------- installing


def test_ops_false_puts_no_mode_on_the_stack():
    lord = MemLord(auto_gc_bytes=None)
    for kwargs in ({}, {"ops": False}):
        h = lord.hook_into_python(**kwargs)
        try:
            assert torch._C._len_torch_dispatch_stack() == 0
            assert h.ops is False
            assert "ops=off" in repr(h)
            a = torch.ones(100)
            b = a * 2  # an op: not seen
            assert ledger(lord) == storage_bytes(a)
            del a, b
        finally:
            h.disable()


def test_ops_true_puts_one_mode_and_disable_takes_it_off():
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    try:
        assert torch._C._len_torch_dispatch_stack() == 1
        assert h.ops is True
        assert "ops=on" in repr(h)
    finally:
        h.disable()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert h.ops is True and "disabled" in repr(h)


@pytest.mark.parametrize("bad", ["yes", 1, None, 1.0])
def test_ops_must_be_a_bool(bad):
    lord = MemLord(auto_gc_bytes=None)
    with pytest.raises(TypeError, match="ops"):
        lord.hook_into_python(ops=bad)
    assert torch._C._len_torch_dispatch_stack() == 0
    a = torch.ones(10)
    assert ledger(lord) == 0  # no factory hook either
    del a


def test_disable_removes_the_mode_under_a_users_mode():
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    rec = Recorder()
    try:
        with rec:
            h.disable()
            assert [type(m) for m in stack()] == [Recorder]
            torch.ones(2) + 1
        assert stack() == []
    finally:
        h.disable()
    assert rec.ops == ["aten.ones.default", "aten.add.Tensor"]


def test_disable_from_another_thread_then_enable_again_leaves_no_mode_behind():
    """disable() from another thread cannot reach this thread's stack: the mode stays,
    counting nothing; turned on again here, it is taken up (not doubled), and the next
    disable() here takes it off."""
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    t = threading.Thread(target=h.disable)
    t.start()
    t.join()
    try:
        a = torch.ones(100)
        b = a * 2
        assert ledger(lord) == 0  # nothing subscribes: nothing counted
        h = lord.hook_into_python(ops=True)
        assert len(stack()) == 1
        c = a * 3
        assert ledger(lord) == storage_bytes(c)
    finally:
        h.disable()
    assert stack() == []
    del b, c


def stack():
    return [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]


# ----------------------------------------------------------------------- user modes


class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class FunctionRecorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def workload():
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = m(x).relu().sum()
    y.backward()
    return [y.item(), x.grad.tolist(), m.weight.grad.tolist()]


def recorded(order, ops=True):
    """What a user's dispatch mode and function mode see of workload(), memlord's hooks
    turned on before them ("before"), after them ("after") or not at all ("bare")."""
    lord = MemLord(auto_gc_bytes=None)
    rec, frec = Recorder(), FunctionRecorder()
    h = lord.hook_into_python(ops=ops) if order == "before" else None
    try:
        with frec, rec:
            if order == "after":
                h = lord.hook_into_python(ops=ops)
            out = workload()
            if order == "after":
                h.disable()
                h = None
    finally:
        if h is not None:
            h.disable()
    return out, rec.ops, frec.funcs, stack()


@pytest.mark.parametrize("ops", [True, False])
@pytest.mark.parametrize("order", ["before", "after"])
def test_users_modes_see_what_they_see_bare(order, ops):
    """The user's modes see the same operators and torch functions, in the same order, and
    the results are the same; ops=False: the category sources (parameter registration,
    gradient hooks) are not seen by a TorchFunctionMode either."""
    bare = recorded("bare")
    assert bare[1] and bare[2]
    assert recorded(order, ops) == bare
    assert stack() == []


def test_user_mode_exited_while_memlord_is_on_leaves_memlord_on():
    """A user's mode entered before ops=True and exited while memlord's mode is on: its
    exit takes the user's mode off the stack (not memlord's), and memlord keeps counting."""
    lord = MemLord(auto_gc_bytes=None)
    rec = Recorder()
    rec.__enter__()
    h = lord.hook_into_python(ops=True)
    try:
        rec.__exit__(None, None, None)
        assert [type(m).__name__ for m in stack()] == ["OpsMode"]
        a = torch.ones(100)
        b = a * 2
        assert ledger(lord) == storage_bytes(a, b)
        n = len(rec.ops)
        b * 2
        assert len(rec.ops) == n  # the user's mode is off
    finally:
        h.disable()
    assert stack() == []


def test_mode_goes_between_torchs_infra_modes_and_the_users():
    """Turned on inside FakeTensorMode (an infra mode, kept below every user mode) and a
    user's mode: memlord's mode goes above the infra mode, below the user's; each exit
    takes its own mode off, and the fake tensors count nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memlord._ops import OpsMode

    lord = MemLord(auto_gc_bytes=None)
    rec = Recorder()
    with FakeTensorMode() as fake, rec:
        h = lord.hook_into_python(ops=True)
        try:
            assert [type(m) for m in stack()] == [FakeTensorMode, OpsMode, Recorder]
            x = torch.randn(100, 100)
            y = x @ x
            assert ledger(lord) == 0
        finally:
            h.disable()
        assert stack() == [fake, rec]
        h = lord.hook_into_python(ops=True)
    try:
        assert [type(m) for m in stack()] == [OpsMode]
        assert rec.ops == ["aten.randn.default", "aten.mm.default"]
        assert type(y).__name__ == "FakeTensor"
    finally:
        h.disable()
    assert stack() == []


# ----------------------------------------------------------------------- checkpoint, saved tensors


def checkpointed(reentrant):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=reentrant)
    y.square().sum().backward()
    return [y.tolist(), x.grad.tolist(), [p.grad.tolist() for p in m.parameters()]]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_unchanged(reentrant):
    bare = checkpointed(reentrant)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        hooked = checkpointed(reentrant)
        assert ledger(lord) == 0  # everything it made is gone
    assert hooked == bare


def saved_hooks_run():
    packed, unpacked = [], []

    def pack(t):
        packed.append((tuple(t.shape), t.dtype))
        return t.clone()

    def unpack(t):
        unpacked.append(tuple(t.shape))
        return t

    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = (x.sin() * x).exp().sum()
    y.backward()
    return [y.item(), x.grad.tolist(), packed, unpacked]


def test_saved_tensors_hooks_unchanged():
    bare = saved_hooks_run()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        hooked = saved_hooks_run()
        assert ledger(lord) == 0
    assert hooked == bare


# ----------------------------------------------------------------------- torch's own tracker


def test_peak_of_a_step_matches_torchs_memtracker():
    """A small MLP's training step under torch's MemTracker and memlord's ops mode at once:
    the same peak (MemTracker counts whole storages as memlord does)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(64, 256)
        m(x).sum().backward()  # warm-up: the gradients exist
        opt.step()
        gc.collect()
        lord.reset_peak_memory_stats("cpu")
        mt = MemTracker()
        mt.track_external(m, opt, x)
        with mt:
            m(x).sum().backward()
            opt.step()
        gc.collect()
        ours = lord.stats()["cpu"]["peak_allocated"]
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(ours - theirs) <= 0.01 * theirs, (ours, theirs)


# ----------------------------------------------------------------------- reference counts


def test_dispatch_leaks_no_references(ops_lord):
    from memlord._ops import OpsMode

    mode = next(m for m in stack() if isinstance(m, OpsMode))
    func = torch.ops.aten.add.Tensor
    a, b = torch.ones(3), torch.ones(3)
    args = (a, b)
    kwargs = {"alpha": 2}
    types_ = (torch.Tensor,)
    with torch.utils._python_dispatch._pop_mode_temporarily() as popped:
        assert popped is mode  # called here as torch calls it: the mode off the stack
        objs = (func, args, kwargs, types_, a, b, mode)
        mode.__torch_dispatch__(func, types_, args, kwargs)  # the operator's entry cached
        before = [sys.getrefcount(o) for o in objs]
        for _ in range(1000):
            mode.__torch_dispatch__(func, types_, args, kwargs)
            mode.__torch_dispatch__(func, types_, args=args, kwargs=kwargs)
            mode.__torch_dispatch__(func, types_, list(args))
            mode.__torch_dispatch__(func, types_, args)
            mode.__torch_dispatch__(func=func, types=types_, args=args)
        after = [sys.getrefcount(o) for o in objs]
        r = mode.__torch_dispatch__(func, types_, args, kwargs)
        # an out= overload: the out tensors are held across the call, then released
        out_func = torch.ops.aten.add.out
        outs = [torch.empty(0) for _ in range(100)]
        mode.__torch_dispatch__(out_func, types_, args, {"out": torch.empty(0)})  # cached
        out_before = [sys.getrefcount(o) for o in (out_func, *outs)]
        for o in outs:
            assert mode.__torch_dispatch__(out_func, types_, args, {"out": o}) is o
        del o
        out_after = [sys.getrefcount(o) for o in (out_func, *outs)]
    assert after == before
    assert out_after == out_before
    assert ledger(ops_lord) == storage_bytes(a, b, r, *outs)  # counted while called directly


# ----------------------------------------------------------------------- known gaps


class Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor, torchao's quantized tensors, jagged nested
    tensors): its ``__torch_dispatch__`` runs each operator on the plain tensor inside."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, Wrapper) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapper(x) if isinstance(x, torch.Tensor) else x, out)


@pytest.mark.xfail(
    strict=True,
    reason="torch takes every mode off the stack before it calls a subclass's "
    "__torch_dispatch__ (modes first, then subclasses): the plain operators a wrapper "
    "runs inside are not seen, and the wrapper's own outputs hold no storage of theirs",
)
def test_operators_inside_a_wrapper_subclass_are_counted(ops_lord):
    w = Wrapper(torch.ones(1000))
    before = ledger(ops_lord)
    v = w * 2
    assert ledger(ops_lord) - before == v.inner.untyped_storage().nbytes()
