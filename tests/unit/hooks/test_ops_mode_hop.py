"""Higher-order operators under the dispatch mode (``hook_into_python(ops=True)``).

torch.cond, map, while_loop, scan, flex_attention (eager) and invoke_subgraph reach the
mode as one call, with the mode taken off the stack while their dense kernel runs.  memlord
counts every storage their outputs hold that no input holds, and puts its mode back on the
stack while their subgraphs run, so that the operators inside (and the peak they reach)
are counted too.

The references are torch's own: ``untyped_storage().nbytes()`` of the storages the test
still holds, and torch's profiler (``profile_memory=True``) for the peak inside a branch.
"""

from __future__ import annotations

import gc
import sys
import warnings

import pytest
import torch
from support.ledger import ledger, storage_bytes
from torch.profiler import ProfilerActivity, profile

from memlord import MemLord


@pytest.fixture(autouse=True)
def _dynamo_as_new():
    """Each test starts from dynamo's first state.  A higher-order operator that ran under
    a user's dispatch mode earlier in the process (the transparency corpus runs them under
    several) leaves torch running later eager ones through dynamo's frame evaluation, where
    bare torch 2.13 itself fails a plain cond ("torch.* op returned non-Tensor"): what this
    file checks is memlord on a fresh torch.  The tests of that state run in processes of
    their own (test_after_a_users_mode_..., test_cond_after_another_mode_...)."""
    torch._dynamo.reset()


def profiled_peak(fn, *args):
    """fn(*args) under torch's profiler: (its result, the most CPU bytes the allocator held
    at once during the call above what it held before: the running sum of the profiler's
    allocation and free events, in their order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return result, peak


def cond(pred, true_fn, false_fn, operands):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cond(pred, true_fn, false_fn, operands)


def test_operators_inside_a_higher_order_operator_are_counted(ops_lord):
    x = torch.randn(1000)
    out = cond(x.sum() > 0, lambda v: (v * 2).sin(), lambda v: v.cos() + 1, (x,))
    assert ledger(ops_lord) == storage_bytes(x, out)


@pytest.mark.parametrize("positive", [True, False])
def test_cond_counts_the_branch_taken_and_credits_its_death(ops_lord, positive):
    x = torch.randn(1000).abs() * (1 if positive else -1)
    base = ledger(ops_lord)
    assert base == storage_bytes(x)
    out = cond(
        x.sum() > 0,
        lambda v: (v * 2).sin().repeat(2),  # 8000 B
        lambda v: v.cos() + 1,  # 4000 B
        (x,),
    )
    assert out.numel() == (2000 if positive else 1000)
    assert ledger(ops_lord) == storage_bytes(x, out)
    del out
    assert ledger(ops_lord) == base


def test_peak_inside_a_branch_matches_torchs_profiler(ops_lord):
    """A branch makes a 400 KB intermediate that is gone when it returns 4 KB: the peak
    memlord saw is the profiler's."""
    x = torch.randn(1000)
    pred = x.sum() > 0  # made before, so that the profiler and memlord start level

    def big(v):
        return (v.expand(100, 1000) * 2).sum(0)

    cond(pred, big, big, (x,))  # compiled once (torch.cond's eager path), outside the profile
    gc.collect()
    base = ledger(ops_lord)
    ops_lord.reset_peak_memory_stats("cpu")
    out, theirs = profiled_peak(cond, pred, big, big, (x,))
    ours = ops_lord.stats()["cpu"]["peak_allocated"] - base
    assert theirs >= 404_000
    assert ours == theirs
    assert ledger(ops_lord) == storage_bytes(x, pred, out)


def test_output_that_is_an_input_is_not_counted_again(ops_lord):
    """A subgraph returning its operand, or a view of it (torch.cond refuses that;
    invoke_subgraph runs it): no new storage.  The operands were made before the lord
    (untracked), and stay uncounted."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    a = torch.randn(1000)
    b = torch.randn(1000)
    gm = torch.fx.symbolic_trace(lambda a, b: (a, b.view(10, 100), a * 2))
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    try:
        same, view, new = invoke_subgraph(gm, "alias", a, b)
        assert same is a or same.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        assert view.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        assert ledger(lord) == storage_bytes(new) == 4000
    finally:
        h.disable()


def test_nested_higher_order_operators_count_their_inner_operators(ops_lord):
    x = torch.randn(1000)

    def outer(v):
        inner = torch.cond(v.mean() > 10, lambda w: w - 1, lambda w: (w * 3).exp(), (v,))
        return inner + v

    out = cond(x.sum() > -1e9, outer, lambda v: v.clone(), (x,))
    assert ledger(ops_lord) == storage_bytes(x, out)


def test_error_inside_a_branch_reaches_the_caller_unchanged():
    x = torch.randn(1000)
    pred = x.sum() > -1e9

    def bad(v):
        v * 2  # made and dropped before the error
        return v.view(7, 3)  # 1000 elements: not a 7 x 3 view

    def error():
        try:
            cond(pred, bad, lambda v: v.clone(), (x,))
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e), str(e)
        return None

    bare = error()  # without memlord
    assert bare is not None
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    try:
        assert error() == bare
        assert ledger(lord) == 0  # what the branch made before the error is gone
        y = x * 2  # memlord's mode still counts, from where it was
        assert torch._C._len_torch_dispatch_stack() == 1
        assert ledger(lord) == storage_bytes(y)
    finally:
        h.disable()


def test_map_counts_its_outputs_and_inner_operators(ops_lord):
    from torch._higher_order_ops.map import map as hop_map

    xs = torch.randn(8, 1000)
    w = torch.randn(1000)
    out = hop_map(lambda x, y: (x * y).exp() + 1, xs, w)
    assert out.shape == (8, 1000)
    assert ledger(ops_lord) == storage_bytes(xs, w, out)
    del out
    assert ledger(ops_lord) == storage_bytes(xs, w)


def test_while_loop_counts_what_it_carries_out(ops_lord):
    from torch._higher_order_ops.while_loop import while_loop

    i0 = torch.tensor(0)
    x0 = torch.randn(1000)
    i, x = while_loop(lambda i, x: i < 5, lambda i, x: (i + 1, x * 2), (i0, x0))
    assert int(i) == 5
    assert torch.equal(x, x0 * 32)
    assert ledger(ops_lord) == storage_bytes(i0, x0, i, x)


def test_scan_counts_its_outputs(ops_lord):
    from torch._higher_order_ops.scan import scan

    xs = torch.randn(6, 1000)
    carry, ys = scan(lambda c, x: (c + x, (c * x).sin()), torch.zeros(1000), xs)
    assert ys.shape == (6, 1000)
    assert ledger(ops_lord) == storage_bytes(xs, carry, ys)


def test_associative_scan_counts_its_outputs(ops_lord):
    from torch._higher_order_ops.associative_scan import associative_scan

    xs = torch.randn(16, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = associative_scan(lambda a, b: a + b, xs, dim=0, combine_mode="generic")
    assert torch.allclose(out, xs.cumsum(0), atol=1e-5)
    assert ledger(ops_lord) == storage_bytes(xs, out)


def test_flex_attention_in_eager_counts_its_outputs(ops_lord):
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 64, 16)
    k = torch.randn(1, 2, 64, 16)
    v = torch.randn(1, 2, 64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s * 2)
    assert out.shape == q.shape
    assert ledger(ops_lord) == storage_bytes(q, k, v, out)


def test_flex_attention_in_eager_peak_matches_torchs_profiler(ops_lord):
    """flex_attention's eager kernel materialises the scores matrix (1 x 2 x 256 x 256
    floats, 512 KB, and more of its size): memlord sees its kernel's operators, and its
    peak is the profiler's less what one operator allocates for itself and frees before it
    returns (no storage a program holds: the profiler sees it, memlord by design not):
    ``_safe_softmax``'s mask of the scores, a byte each, and its row flags."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 2, 256, 16)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return flex_attention(q, q, q, score_mod=lambda s, b, h, qi, kv: s * 2)

    run()  # warmed up (flex_attention's first call makes and caches what it needs)
    gc.collect()
    base = ledger(ops_lord)
    ops_lord.reset_peak_memory_stats("cpu")
    out, theirs = profiled_peak(run)
    ours = ops_lord.stats()["cpu"]["peak_allocated"] - base
    scores = 2 * 256 * 256 * 4
    assert ours >= 2 * scores  # two of the kernel's scores-sized results at once
    assert 0 <= theirs - ours <= scores // 4 + 1024
    assert ledger(ops_lord) == storage_bytes(q, out)


def test_a_base_hop_counts_its_outputs_and_the_peak_inside(ops_lord):
    """foreach_map, a BaseHOP (its subgraph is its first argument): the outputs are
    counted, and the products its function makes and drops inside are seen (the peak is
    the profiler's)."""
    from torch._higher_order_ops.foreach_map import foreach_map

    xs = [torch.randn(10_000) for _ in range(3)]
    ys = [torch.randn(10_000) for _ in range(3)]

    def run():
        return foreach_map(lambda a, b: (a * b).sin(), xs, ys)

    run()  # compiled once (foreach_map's function is traced), outside the profile
    gc.collect()
    base = ledger(ops_lord)
    ops_lord.reset_peak_memory_stats("cpu")
    out, theirs = profiled_peak(run)
    ours = ops_lord.stats()["cpu"]["peak_allocated"] - base
    assert len(out) == 3
    assert ledger(ops_lord) - base == storage_bytes(*out) == 120_000
    assert theirs > 120_000  # a product lives beside the sines
    assert ours == theirs


def test_invoke_subgraph_counts_its_outputs(ops_lord):
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    gm = torch.fx.symbolic_trace(lambda a, b: ((a @ b).relu(),))
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    (out,) = invoke_subgraph(gm, "sub", a, b)
    assert ledger(ops_lord) == storage_bytes(a, b, out)


def test_cond_gradients_unchanged_and_counted(ops_lord):
    torch.manual_seed(0)
    y = torch.randn(1000, requires_grad=True)
    pred = y.sum() > -1e9  # o's graph holds it (torch.cond's backward picks the branch)
    o = cond(pred, lambda v: (v * 2).sin(), lambda v: v.cos(), (y,))
    o.sum().backward()
    assert torch.equal(y.grad, 2 * torch.cos(2 * y.detach()))
    assert ledger(ops_lord) == storage_bytes(y, pred, o, y.grad)
    del o
    assert ledger(ops_lord) == storage_bytes(y, pred, y.grad)


def test_compiled_cond_runs_and_counts_only_real_storages(ops_lord):
    def f(x):
        return torch.cond(x.sum() > 0, lambda v: v.sin() * 2, lambda v: v.cos(), (x,))

    x = torch.randn(1000)
    expected = f(x)
    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(out, expected)
    del expected
    assert ledger(ops_lord) == storage_bytes(x, out)


def test_fake_tensor_mode_and_tracing_of_a_cond_count_nothing(ops_lord):
    """Under FakeTensorMode, and while make_fx traces, torch's own rules take the operator
    (the subgraphs run on fake tensors or proxies): nothing counted, the graph torch's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.cond(x.sum() > 0, lambda v: v.sin() * 2, lambda v: v.cos(), (x,))

    with FakeTensorMode():
        out = f(torch.randn(1000, 1000))
        assert out.shape == (1000, 1000)
    assert ledger(ops_lord) == 0
    del out
    x = torch.randn(10)
    base = ledger(ops_lord)
    traced = make_fx(f)(x)
    assert "torch.ops.higher_order.cond" in traced.code
    assert "memlord" not in traced.code
    assert torch.equal(traced(x), f(x))
    del traced
    assert ledger(ops_lord) == base


def test_vmap_of_cond_counts_only_real_storages(ops_lord):
    xs = torch.randn(8, 1000)
    out = torch.vmap(lambda x: torch.cond(x.sum() > 0, lambda v: v * 2, lambda v: v.cos(), (x,)))(
        xs
    )
    expected = torch.where(xs.sum(1, keepdim=True) > 0, xs * 2, xs.cos())
    assert torch.equal(out, expected)
    del expected
    assert ledger(ops_lord) == storage_bytes(xs, out)


def test_subgraph_wrapper_checks_its_arguments_and_forwards_attributes():
    from memlord import _core

    with pytest.raises(TypeError, match="fn must be callable, not int"):
        _core._in_mode(3, None)
    with pytest.raises(TypeError, match="tensors must be a list or tuple, not int"):
        _core._count_new(3)

    def sub(a):
        return a + 1

    sub._boxed_call = False
    w = _core._in_mode(sub, None)
    assert w.__wrapped__ is sub
    assert w._boxed_call is False  # what invoke_subgraph reads
    assert w.__name__ == "sub"
    with pytest.raises(AttributeError):
        w.no_such_attribute  # noqa: B018


def test_subgraph_wrappers_hold_their_type_once_each():
    """A subgraph wrapper holds one reference to its type, given back when it dies (the
    type's reference count is the same before and after a thousand wrappers)."""
    from memlord import _core

    def sub(a):
        return a

    keep = _core._in_mode(sub, None)
    tp = type(keep)
    before = (sys.getrefcount(tp), sys.getrefcount(sub))
    made = [_core._in_mode(sub, None) for _ in range(1000)]
    del made
    gc.collect()
    assert (sys.getrefcount(tp), sys.getrefcount(sub)) == before
    del keep


def test_a_users_mode_above_sees_what_it_sees_bare():
    """A user's dispatch mode that lets higher-order operators through (entered after
    memlord's, so above it) sees the same operators as without memlord: memlord's mode
    goes back on the stack only below it, for the subgraphs torch runs after both."""
    from torch._higher_order_ops.map import map as hop_map
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        supports_higher_order_operators = True

        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    xs = torch.randn(4, 100)

    def run():
        with Seen() as mode:
            out = hop_map(lambda x: (x * 2).sin(), xs)
        return mode.seen, out

    bare_seen, bare_out = run()
    lord = MemLord(auto_gc_bytes=None)
    h = lord.hook_into_python(ops=True)
    try:
        seen, out = run()
        assert seen == bare_seen
        assert "map_impl" in seen
        assert torch.equal(out, bare_out)
        del bare_out
        assert ledger(lord) == storage_bytes(out)
    finally:
        h.disable()


_COND_AFTER_A_MODE = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from memlord import MemLord

class Identity(TorchDispatchMode):  # no rule for torch.cond: it fails under this mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

x = torch.ones(3)

def outcome():
    try:
        out = torch.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return repr(out.tolist())

try:
    with Identity():
        torch.cond(x.sum() > 0, lambda v: v.sin(), lambda v: v.cos(), (x,))
except Exception:
    pass
print(outcome())
with MemLord().hook_into_python(ops=True):
    print(outcome())
"""


def test_cond_after_another_mode_failed_on_it_runs_as_bare_and_reports_nothing(tmp_path):
    """Once torch.cond has failed under a Python dispatch mode with no rule for it, torch
    runs later eager conds through dynamo (its frame evaluation on; in torch 2.13 it then
    raises "torch.* op returned non-Tensor" for a plain cond). memlord's mode called its
    Python helper (_hop_prepare) inside that evaluation: dynamo compiled the helper's
    frame and failed ("Non-constant GetAttrVariable hash"), memlord printed "Exception
    ignored in: CondOp" and ran the cond some other way than bare torch does. The
    helpers' frames are now never compiled: the cond does what it does bare (torch is
    the reference). In a process of its own: the failed cond changes torch's state for
    the rest of the process."""
    import subprocess

    script = tmp_path / "cond_after_a_mode.py"
    script.write_text(_COND_AFTER_A_MODE)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    bare, ops = proc.stdout.splitlines()
    assert ops == bare


_AFTER_A_USERS_MODE = """
import gc
import sys
import torch
from torch._higher_order_ops.map import map as hop_map
from torch.utils._python_dispatch import TorchDispatchMode
from memlord import MemLord

class Seen(TorchDispatchMode):  # lets higher-order operators through
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

torch.manual_seed(0)
xs = torch.randn(4, 100)
with Seen():
    hop_map(lambda x: (x * 2).sin(), xs)

w = torch.randn(100)
x = torch.randn(100)
calls = {
    "map": lambda: hop_map(lambda a, b: (a * b).exp() + 1, xs, w),
    "cond": lambda: torch.cond(x.sum() > 0, lambda v: v.sin() * 2, lambda v: v.cos(), (x,)),
}
call = calls[sys.argv[1]]
if sys.argv[2] == "ops":
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        out = call()
    gc.collect()
    counted = lord.allocated("cpu")[0]
    held = out.untyped_storage().nbytes()
    print("counted" if counted == held else f"counted {counted} of {held}")
else:
    out = call()
    print("counted")
print(out.sum().item())
"""


@pytest.mark.parametrize("op", ["map", "cond"])
def test_after_a_users_mode_ran_a_map_the_next_ones_run_as_bare(tmp_path, op):
    """Once torch.map has run under a user's dispatch mode, torch runs later eager maps
    and conds with dynamo's frame evaluation on, which compiles the operator's dense
    kernel.  memlord's mode passed that kernel its subgraphs wrapped (to count the
    operators inside them), a call dynamo cannot trace: the map raised "Unsupported
    method call ... InMode" where bare it returns, and so did a cond.  While that
    evaluation is on, memlord now calls the operator as torch did and counts its outputs.
    The reference is the same program without memlord; each in a process of its own (the
    first map changes torch's state for the rest of the process)."""
    import subprocess

    script = tmp_path / "after_a_users_mode.py"
    script.write_text(_AFTER_A_USERS_MODE)

    def run(how):
        proc = subprocess.run(
            [sys.executable, str(script), op, how], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        assert "Exception ignored" not in proc.stderr, proc.stderr
        return proc.stdout.splitlines()

    bare = run("bare")
    ops = run("ops")
    assert ops == bare
