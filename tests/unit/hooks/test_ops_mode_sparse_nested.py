"""``hook_into_python(ops=True)`` on sparse and nested results: every storage they hold.

A sparse result holds its memory in component tensors (COO: indices and values; CSR, CSC,
BSR, BSC: compressed indices, plain indices and values), a jagged NestedTensor in the inner
tensors it flattens to (values, offsets, lengths), a strided NestedTensor in one buffer. An
operator's result counts each storage it holds once, unless one of the operator's
arguments held it before the call (``torch.sparse_coo_tensor(i, v)`` keeps ``i`` and
``v``; ``j * 2`` keeps ``j``'s offsets): what the result shares is no new memory, as a
view's storage is not. Each storage is credited when it dies.

Two references that do not trust memlord:

* torch's own accessors: the storages of ``_indices()``, ``crow_indices()``, ``values()``,
  ``offsets()``, ... and their ``untyped_storage().nbytes()``;
* torch's profiler (``profile_memory=True``): the bytes the CPU allocator handed out during
  the call and did not get back, which is the new memory the result holds (the
  temporaries an operator frees inside come and go).

torch's ``MemTracker`` is no reference here: it cannot read a sparse tensor's storage
(``NotImplementedError``), and for a jagged result it stops at the first inner storage it
has seen before (``_track`` returns inside its loop), so ``j * 2`` counts nothing there.

Every test runs with tensor metadata read through torch's stable C ABI and through its
Python getters (conftest.tensor_abi).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from support.ledger import ledger
from torch.profiler import ProfilerActivity, profile

from memlord import MemLord

pytestmark = [
    pytest.mark.usefixtures("tensor_abi"),
    # torch's notes on its beta sparse layouts and prototype nested tensors
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype"),
]

CSR_LIKE = (torch.sparse_csr, torch.sparse_bsr)
CSC_LIKE = (torch.sparse_csc, torch.sparse_bsc)


@contextlib.contextmanager
def ops_on():
    """A lord with ops=True from here: what was made before is not tracked."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        yield lord


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding t's memory, through torch's public accessors."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in CSR_LIKE:
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in CSC_LIKE:
        return [t.ccol_indices(), t.row_indices(), t.values()]
    if t.layout == torch.jagged:
        lengths = t.lengths()
        return [t.values(), t.offsets(), *([] if lengths is None else [lengths])]
    return [t]


def storages(*tensors: torch.Tensor) -> dict[tuple[int, int], int]:
    """The distinct storages the tensors hold: (data pointer, nbytes) -> nbytes."""
    out = {}
    for t in tensors:
        for p in parts(t):
            s = p.untyped_storage()
            if s.nbytes():
                out[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return out


def held(*tensors: torch.Tensor) -> int:
    return sum(storages(*tensors).values())


def new_in(result: torch.Tensor, *inputs: torch.Tensor) -> int:
    """The bytes of the storages result holds that none of the inputs holds."""
    theirs = storages(*inputs)
    return sum(n for k, n in storages(result).items() if k not in theirs)


def profiled(fn, *args):
    """fn(*args) under torch's profiler: (its result, the CPU bytes allocated during the
    call and not freed by its end)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args)
    return result, sum(e.self_cpu_memory_usage for e in prof.events())


def sparse_input(n: int = 256) -> torch.Tensor:
    """A dense matrix with about a third of its entries nonzero."""
    torch.manual_seed(0)
    d = torch.randn(n, n)
    d[d.abs() < 1] = 0
    return d


def jagged(*lengths: int, width: int = 50) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor(
            [torch.randn(k, width) for k in lengths], layout=torch.jagged
        )


TO_SPARSE = {
    "coo": lambda d: d.to_sparse(),
    "csr": lambda d: d.to_sparse_csr(),
    "csc": lambda d: d.to_sparse_csc(),
    "bsr": lambda d: d.to_sparse_bsr((4, 4)),
    "bsc": lambda d: d.to_sparse_bsc((4, 4)),
}


# ----------------------------------------------------------------------- dense -> sparse


@pytest.mark.parametrize("layout", list(TO_SPARSE))
def test_dense_to_sparse_counts_every_component_and_credits_them(ops_lord, layout):
    """A 256 x 256 matrix a third full: its COO form is some 400 KB (counted as 0 before)."""
    d = sparse_input()
    base = ledger(ops_lord)
    assert base == held(d)  # the factory's result
    allocs = ops_lord.stats()["cpu"]["allocs"]
    s, grown = profiled(TO_SPARSE[layout], d)
    assert s.layout != torch.strided
    want = held(s)
    assert want > 100_000
    assert ledger(ops_lord) - base == want == grown
    assert ops_lord.stats()["cpu"]["allocs"] - allocs == len(storages(s))  # each once
    del s
    assert ledger(ops_lord) == base
    del d
    assert ledger(ops_lord) == 0


# ----------------------------------------------------------------------- sparse operators


def _uncoalesced() -> torch.Tensor:
    i = torch.tensor([[0, 1, 1, 3, 0], [2, 0, 0, 3, 2]])
    return torch.sparse_coo_tensor(i, torch.arange(5.0), (4, 4))


SPARSE_OPS = {
    "sparse.mm": lambda s, c: torch.sparse.mm(s, s),
    "add": lambda s, c: s + s,
    "mul": lambda s, c: s * 2,
    "sub_scalar_mul": lambda s, c: torch.sub(s, s * 3),
    "coalesce": lambda s, c: _uncoalesced().coalesce(),
    "clone": lambda s, c: s.clone(),
    "to_float64": lambda s, c: s.to(torch.float64),
    "t": lambda s, c: s.t(),  # annotated as a view, yet new indices and values
    "sparse.sum": lambda s, c: torch.sparse.sum(s, dim=0),
    "csr_add": lambda s, c: c + c,
    "csr_matmul": lambda s, c: c @ c,
    "csr_to_coo": lambda s, c: c.to_sparse_coo(),
    "coo_to_csr": lambda s, c: s.to_sparse_csr(),
}


@pytest.mark.parametrize("name", list(SPARSE_OPS))
def test_sparse_operators_count_the_storages_their_result_adds(ops_lord, name):
    d = sparse_input(128)
    s, c = d.to_sparse(), d.to_sparse_csr()
    base = ledger(ops_lord)
    assert base == held(d, s, c)
    r, grown = profiled(SPARSE_OPS[name], s, c)
    assert r.layout != torch.strided
    want = new_in(r, s, c)
    assert want > 0
    assert ledger(ops_lord) - base == want == grown
    assert ledger(ops_lord) == held(d, s, c, r)  # each storage once
    del r
    assert ledger(ops_lord) == base


def test_sparse_results_that_keep_their_inputs_storages_add_nothing():
    """torch.sparse_coo_tensor / sparse_csr_tensor wrap the tensors they are given;
    detach() and coalesce() of a coalesced tensor return the same components: nothing new,
    even when memlord never saw those components made (no storage counted twice, none
    counted that its result did not create)."""
    d = sparse_input(64)
    s, c = d.to_sparse(), d.to_sparse_csr()
    i, v = s._indices().clone(), s._values().clone()
    crow, col, vals = c.crow_indices().clone(), c.col_indices().clone(), c.values().clone()
    with ops_on() as lord:
        results = [
            torch.sparse_coo_tensor(i, v, s.shape),
            torch.sparse_csr_tensor(crow, col, vals, c.shape),
            s.detach(),
            s.coalesce(),
            c.detach(),
            c.t(),  # a CSC view of the same components
        ]
        for r in results:
            assert new_in(r, i, v, crow, col, vals, s, c) == 0
        assert ledger(lord) == 0


def test_in_place_sparse_operator_counts_the_components_it_replaces(ops_lord):
    """s.add_(x) of two sparse tensors gives s new indices and values: new memory, counted;
    the old ones die with the call and are credited."""
    s = torch.eye(64).to_sparse()
    x = torch.ones(64, 64).triu().to_sparse()
    base = ledger(ops_lord)
    assert base == held(s, x)
    before = storages(s)
    s.add_(x)
    assert storages(s).keys().isdisjoint(before)  # torch replaced them
    assert ledger(ops_lord) == held(s, x)
    s.mul_(2)  # in place: the same components
    assert ledger(ops_lord) == held(s, x)
    o = torch.eye(8).to_sparse()
    torch.add(s, x, out=o)  # an out= sparse tensor gets components of s's size
    assert ledger(ops_lord) == held(s, x, o)
    del s, o
    assert ledger(ops_lord) == held(x)


def test_sparse_results_of_an_untracked_input_count_only_what_they_add():
    """A sparse tensor made before ops=True is not tracked: ops on it count their results'
    storages (s * 2: new values, s.t(): new indices and values) and none of its own."""
    s = sparse_input(128).to_sparse()
    with ops_on() as lord:
        r = s * 2
        t = s.t()
        assert ledger(lord) == new_in(r, s) + new_in(t, s) == held(r, t)
        del r, t
        assert ledger(lord) == 0


# ----------------------------------------------------------------------- nested tensors


NESTED_OPS = {
    "mul": lambda j, w: j * 2,
    "sin": lambda j, w: j.sin(),
    "add": lambda j, w: j + j,
    "linear": lambda j, w: torch.nn.functional.linear(j, w),
    "clone": lambda j, w: j.clone(),
    "to_float64": lambda j, w: j.to(torch.float64),
    "softmax": lambda j, w: j.softmax(-1),
}


@pytest.mark.parametrize("name", list(NESTED_OPS))
def test_jagged_results_count_their_new_inner_tensors(ops_lord, name):
    """A jagged result holds new values and its input's offsets: the values count."""
    j = jagged(30, 40, 7)
    w = torch.randn(20, 50)
    base = ledger(ops_lord)
    assert base == held(j, w)  # nested_tensor's values and offsets, and w
    r, grown = profiled(NESTED_OPS[name], j, w)
    assert r.layout == torch.jagged
    want = new_in(r, j, w)
    assert want == r.values().untyped_storage().nbytes() > 0
    assert ledger(ops_lord) - base == want == grown
    assert ledger(ops_lord) == held(j, w, r)
    del r
    assert ledger(ops_lord) == base


def test_jagged_nested_tensor_counts_values_offsets_and_lengths(ops_lord):
    values = torch.randn(20, 8)
    offsets = torch.tensor([0, 5, 12, 20])
    lengths = torch.tensor([4, 6, 8])
    base = ledger(ops_lord)
    j = torch.nested.nested_tensor_from_jagged(values, offsets, lengths)
    assert ledger(ops_lord) == base  # a view of the three: nothing new
    r = j * 2  # new values; the offsets and lengths are j's
    assert len(storages(r)) == 3
    assert ledger(ops_lord) - base == r.values().untyped_storage().nbytes()
    made, grown = profiled(jagged, 3, 4)
    assert ledger(ops_lord) == held(values, offsets, lengths, r, made)
    assert grown == held(made) == 7 * 50 * 4 + 3 * 8
    del j, r, made
    assert ledger(ops_lord) == base


def test_jagged_made_before_the_hooks_lends_nothing_to_the_count():
    j = jagged(30, 40)
    with ops_on() as lord:
        r = j * 2
        v = j.transpose(1, 2)  # a view: nothing
        assert ledger(lord) == r.values().untyped_storage().nbytes() == new_in(r, j)
        del r, v
        assert ledger(lord) == 0


def test_strided_nested_results_count_their_buffer(ops_lord):
    """A strided NestedTensor's memory is one buffer (its untyped_storage()); torch keeps
    its components' sizes, strides and offsets in small CPU tensors of its own, which are
    no storage of the tensor and not counted (the profiler sees them: 64 B here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = torch.nested.nested_tensor([torch.randn(30, 50), torch.randn(40, 50)])
    base = ledger(ops_lord)
    assert base == n.untyped_storage().nbytes()
    r, grown = profiled(torch.mul, n, 2)
    assert ledger(ops_lord) - base == r.untyped_storage().nbytes() == 70 * 50 * 4
    metadata = sum(
        t.untyped_storage().nbytes() for t in (r._nested_tensor_size(), r._nested_tensor_strides())
    )
    assert grown == r.untyped_storage().nbytes() + metadata
    del r
    assert ledger(ops_lord) == base


# --------------------------------------------- no storage to read; what a quantizer keeps


def test_an_opaque_result_is_not_counted_though_torch_allocated_it(ops_lord):
    """An mkldnn tensor has no storage torch can show (``untyped_storage()`` raises): not
    counted, as docs/guide.md says, where torch's profiler sees its bytes; the call is as
    without memlord, and nothing is credited when it dies."""
    d = torch.randn(16, 16)
    base = ledger(ops_lord)
    m, grown = profiled(torch.Tensor.to_mkldnn, d)
    assert m.layout == torch._mkldnn
    with pytest.raises(NotImplementedError):
        m.untyped_storage()
    assert grown == 16 * 16 * 4
    assert ledger(ops_lord) == base
    assert torch.equal(m.to_dense(), d)
    del m
    assert ledger(ops_lord) == base


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_per_channel_quantized_result_counts_its_data_not_the_scales_torch_copies(ops_lord):
    """A per-channel quantized tensor keeps its scales and zero points in its quantizer:
    the zero points made here (int64 already) are the program's tensor, counted as it was
    made; the float64 copy torch makes of float32 scales inside the operator is not
    counted (docs/guide.md), the one storage the profiler sees that memlord does not,
    until the program reads it (``q_per_channel_scales()`` is an operator whose result
    memlord sees: counted from then on, once)."""
    d = torch.randn(10, 10)
    scales = torch.rand(10) + 0.1
    zero_points = torch.zeros(10, dtype=torch.long)
    base = ledger(ops_lord)
    q, grown = profiled(torch.quantize_per_channel, d, scales, zero_points, 0, torch.quint8)
    assert ledger(ops_lord) - base == q.untyped_storage().nbytes() == 100
    assert grown == 100 + 80
    assert q.q_per_channel_zero_points().data_ptr() == zero_points.data_ptr()
    kept = q.q_per_channel_scales()
    assert kept.dtype == torch.float64 and kept.untyped_storage().nbytes() == 80
    assert q.q_per_channel_scales().data_ptr() == kept.data_ptr()
    assert ledger(ops_lord) - base == 100 + 80
    del zero_points  # the quantizer holds it: nothing credited
    assert ledger(ops_lord) - base == 100 + 80
    del q, kept  # data, scales and zero points
    assert ledger(ops_lord) == base - 80


# ----------------------------------------------------------------------- many results


def test_a_list_of_sparse_results_counts_each(ops_lord):
    d = sparse_input(64)
    s = d.to_sparse()
    base = ledger(ops_lord)
    rs = s.unbind(0)  # 64 sparse rows: annotated as views, new components each
    assert ledger(ops_lord) - base == sum(new_in(r, s) for r in rs) == held(*rs)
    del rs
    assert ledger(ops_lord) == base


# ----------------------------------------------------------------------- sparse gradients


def test_sparse_gradient_is_counted_and_categorised_gradient(ops_lord):
    """nn.Embedding(sparse=True): backward makes a sparse gradient (indices and values),
    an operator's result counted in backward and then categorised as the gradient; the
    optimizer's step and zero_grad(set_to_none) leave the ledger at the live storages."""
    emb = torch.nn.Embedding(1000, 64, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    idx = torch.randint(0, 1000, (32,))
    emb(idx).sum().backward()
    g = emb.weight.grad
    assert g.layout == torch.sparse_coo
    assert ledger(ops_lord) == held(emb.weight, idx, g)
    cats = ops_lord.stats()["cpu"]["categories"]
    assert cats["gradient"] == held(g) > 0
    opt.step()
    opt.zero_grad(set_to_none=True)
    del g
    assert ledger(ops_lord) == held(emb.weight, idx)


# ----------------------------------------------------------------------- DTensor


@pytest.fixture
def fake_mesh():
    """A 2-rank DeviceMesh on torch's own fake process group (this process is rank 0; no
    communication happens): DTensor's operators run on the local shard."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a process group is already up")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield DeviceMesh("cpu", [0, 1])
    finally:
        dist.destroy_process_group()


def test_dtensor_results_count_their_local_shard(fake_mesh):
    """A DTensor is a traceable wrapper subclass: its operators' results hold a new local
    tensor each (the operators DTensor runs on it are not seen: torch takes the modes off
    the stack first), counted and credited; allocate() counts the local shard."""
    from torch.distributed.tensor import Shard, distribute_tensor

    x = distribute_tensor(torch.randn(64, 32), fake_mesh, [Shard(0)])
    with ops_on() as lord:
        y = x * 2
        z = y.sin()
        local = [t._local_tensor for t in (y, z)]
        assert ledger(lord) == held(*local) == 2 * 32 * 32 * 4
        del y, z, local
        assert ledger(lord) == 0
    other = MemLord(auto_gc_bytes=None)
    other.allocate(x)
    assert other.allocated("cpu")[0] == held(x._local_tensor) == 32 * 32 * 4
