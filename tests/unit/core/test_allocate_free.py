"""allocate()/free(): what one call counts.

Within one call every storage counts once, keyed by (untyped storage data pointer, storage
nbytes, device); a view counts its whole storage. Across calls there is no dedup.
"""

import warnings

import numpy as np
import pytest
import torch
from conftest import ZERO_STATS, counters, expected_bytes, storage_nbytes
from torch import nn

# --------------------------------------------------------------------------- tensors


def test_tensor_counts_its_storage_bytes(lord):
    t = torch.empty(100, dtype=torch.float32)
    assert lord.allocate(t) is None
    assert lord.allocated() == (400, "400 B")
    assert lord.allocated("cpu") == (400, "400 B")
    assert lord.stats()["cpu"]["allocs"] == 1


def test_return_values_are_none(lord):
    t = torch.empty(3)
    assert lord.allocate(t) is None
    assert lord.free(t) is None


def test_same_tensor_twice_in_separate_calls_counts_twice(lord):
    t = torch.empty(10, dtype=torch.float64)
    lord.allocate(t)
    lord.allocate(t)
    assert lord.allocated()[0] == 160
    assert lord.stats()["cpu"]["allocs"] == 2


def test_same_tensor_twice_in_one_call_counts_once(lord):
    t = torch.empty(10, dtype=torch.float64)
    lord.allocate([t, t])
    assert lord.allocated()[0] == 80
    assert lord.stats()["cpu"]["allocs"] == 1


@pytest.mark.parametrize(
    "make_view",
    [
        lambda b: b[10:],
        lambda b: b[:1],
        lambda b: b.view(10, 10),
        lambda b: b.view(10, 10).t(),
        lambda b: b[::7],
        lambda b: b.narrow(0, 50, 5),
        lambda b: b.view(torch.uint8),
        lambda b: b.detach(),
    ],
    ids=["tail", "head", "reshape", "transpose", "strided", "narrow", "dtype-view", "detach"],
)
def test_view_counts_whole_storage(lord, make_view):
    base = torch.empty(100, dtype=torch.float32)
    v = make_view(base)
    assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    lord.allocate(v)
    assert lord.allocated()[0] == 400


def test_two_views_of_one_storage_in_one_call_count_once(lord):
    base = torch.empty(100, dtype=torch.float32)
    lord.allocate((base[:10], base[50:], base.view(4, 25)))
    assert lord.allocated()[0] == 400
    assert lord.stats()["cpu"]["allocs"] == 1


def test_base_and_view_in_one_call_count_once(lord):
    base = torch.empty(64, dtype=torch.int16)
    lord.allocate([base, base[3:5]])
    assert lord.allocated()[0] == 128


def test_distinct_tensors_add_up(lord):
    a = torch.empty(10, dtype=torch.float32)
    b = torch.empty(10, dtype=torch.float32)
    c = torch.empty(3, dtype=torch.int64)
    lord.allocate([a, b, c])
    assert lord.allocated()[0] == 40 + 40 + 24
    assert lord.stats()["cpu"]["allocs"] == 3


def test_parameter_and_tensor_subclass(lord):
    class Tagged(torch.Tensor):
        pass

    p = nn.Parameter(torch.empty(8))
    s = torch.empty(5).as_subclass(Tagged)
    assert isinstance(s, Tagged)
    lord.allocate(p)
    lord.allocate(s)
    assert lord.allocated()[0] == 32 + 20


def test_parameter_sharing_storage_with_tensor_counts_once(lord):
    t = torch.empty(16)
    p = nn.Parameter(t)  # shares t's storage
    lord.allocate((t, p))
    assert lord.allocated()[0] == 64


def test_same_pointer_different_nbytes_are_distinct_keys(lord):
    # The key is (pointer, nbytes, device): a storage over a prefix of another's memory
    # starts at the same address with fewer bytes, so it is a different key.
    a = np.zeros(100, dtype=np.uint8)
    whole, prefix = torch.from_numpy(a), torch.from_numpy(a[:10])
    assert whole.untyped_storage().data_ptr() == prefix.untyped_storage().data_ptr()
    assert (storage_nbytes(whole), storage_nbytes(prefix)) == (100, 10)
    lord.allocate([whole, prefix])
    assert lord.allocated()[0] == 110
    assert lord.stats()["cpu"]["allocs"] == 2


# --------------------------------------------------------------------------- modules


def test_linear_counts_weight_and_bias(lord):
    m = nn.Linear(8, 4)
    lord.allocate(m)
    assert lord.allocated()[0] == (8 * 4 + 4) * 4
    assert lord.stats()["cpu"]["allocs"] == 2


def test_none_parameter_and_buffer_are_skipped(lord):
    m = nn.Linear(8, 4, bias=False)
    m.register_buffer("absent", None)
    lord.allocate(m)
    assert lord.allocated()[0] == 8 * 4 * 4
    assert lord.stats()["cpu"]["allocs"] == 1


def test_buffers_persistent_and_not_count(lord):
    m = nn.BatchNorm1d(10)  # weight, bias, running_mean, running_var, num_batches_tracked
    m.register_buffer("scratch", torch.empty(5), persistent=False)
    lord.allocate(m)
    assert lord.allocated()[0] == 4 * 10 * 4 + 8 + 20
    assert lord.allocated()[0] == expected_bytes(m)["cpu"]


def test_nested_submodules_are_walked(lord):
    m = nn.Sequential(
        nn.Linear(4, 4),
        nn.Sequential(nn.ReLU(), nn.Sequential(nn.Linear(4, 2, bias=False))),
        nn.LayerNorm(2),
    )
    lord.allocate(m)
    assert lord.allocated()[0] == (16 + 4 + 8 + 2 + 2) * 4


def test_tied_weight_counts_once(lord):
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    m = TiedLM()
    lord.allocate(m)
    assert lord.allocated()[0] == 50 * 16 * 4
    assert lord.stats()["cpu"]["allocs"] == 1


def test_weights_sharing_one_storage_count_once(lord):
    flat = torch.empty(40)
    m = nn.Module()
    m.a = nn.Parameter(flat[:20])
    m.b = nn.Parameter(flat[20:])
    lord.allocate(m)
    assert lord.allocated()[0] == 160


def test_shared_submodule_counts_once(lord):
    shared = nn.Linear(10, 10)
    m = nn.Sequential(shared, nn.ReLU(), shared)
    m2 = nn.Module()
    m2.x = shared
    m2.y = shared
    m2.z = nn.Sequential(shared)
    lord.allocate(m)
    assert lord.allocated()[0] == 110 * 4
    lord.reset()
    lord.allocate(m2)
    assert lord.allocated()[0] == 110 * 4


def test_module_and_its_parameter_in_one_call_count_once(lord):
    m = nn.Linear(3, 3)
    lord.allocate([m, m.weight, m.bias[1:]])
    assert lord.allocated()[0] == 12 * 4


def test_module_twice_in_separate_calls_counts_twice(lord):
    m = nn.Linear(3, 3)
    lord.allocate(m)
    lord.allocate(m)
    assert lord.allocated()[0] == 2 * 12 * 4


def test_module_with_no_tensors_counts_nothing(lord):
    lord.allocate(nn.ReLU())
    lord.allocate(nn.Sequential())
    assert lord.allocated() == (0, "0 B")
    assert lord.stats() == {}


def test_module_subclass_with_custom_registration(lord):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(7, dtype=torch.float64))
            self.register_buffer("mask", torch.ones(3, dtype=torch.bool))
            self.sub = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.d = nn.ModuleDict({"k": nn.Linear(1, 1)})
            self.pl = nn.ParameterList([nn.Parameter(torch.empty(5))])

    m = Block()
    lord.allocate(m)
    assert lord.allocated()[0] == 7 * 8 + 3 + 3 * 6 * 4 + 2 * 4 + 5 * 4
    assert lord.allocated()[0] == expected_bytes(m)["cpu"]


# --------------------------------------------------------------------------- sparse layouts


def _dense():
    d = torch.zeros(6, 6)
    d[0, 1] = 1
    d[2, 3] = 2
    d[5, 5] = 3
    d[4, 0] = 4
    return d


@pytest.mark.parametrize(
    ("make", "parts"),
    [
        (lambda d: d.to_sparse(), lambda s: [s._indices(), s._values()]),
        (lambda d: d.to_sparse_csr(), lambda s: [s.crow_indices(), s.col_indices(), s.values()]),
        (lambda d: d.to_sparse_csc(), lambda s: [s.ccol_indices(), s.row_indices(), s.values()]),
        (
            lambda d: d.to_sparse_bsr((2, 2)),
            lambda s: [s.crow_indices(), s.col_indices(), s.values()],
        ),
        (
            lambda d: d.to_sparse_bsc((3, 3)),
            lambda s: [s.ccol_indices(), s.row_indices(), s.values()],
        ),
    ],
    ids=["coo", "csr", "csc", "bsr", "bsc"],
)
def test_sparse_counts_component_storages(lord, make, parts):
    s = make(_dense())
    want = sum(storage_nbytes(p) for p in parts(s))
    assert want > 0
    lord.allocate(s)
    assert lord.allocated()[0] == want
    assert lord.stats()["cpu"]["allocs"] == len(parts(s))
    lord.free(s)
    assert lord.allocated()[0] == 0
    assert lord.stats()["cpu"]["freed_total"] == want


def test_sparse_coo_from_components(lord):
    idx = torch.tensor([[0, 1, 2], [2, 0, 1]])  # int64, 48 bytes
    val = torch.tensor([1.0, 2.0, 3.0])  # 12 bytes
    s = torch.sparse_coo_tensor(idx, val, (3, 3))
    lord.allocate(s)
    assert lord.allocated()[0] == 48 + 12


def test_sparse_and_its_values_in_one_call_count_once(lord):
    s = _dense().to_sparse_csr()
    lord.allocate([s, s.values()])
    assert lord.allocated()[0] == expected_bytes(s)["cpu"]


# --------------------------------------------------------------------------- nested tensors


def _jagged(*lengths, width=5):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype-stage note
        return torch.nested.nested_tensor(
            [torch.randn(k, width) for k in lengths], layout=torch.jagged
        )


def _jagged_parts(j):
    """The tensors holding a jagged NestedTensor's memory, through torch's public API."""
    return [p for p in (j.values(), j.offsets(), j.lengths()) if p is not None]


def test_jagged_nested_tensor_counts_its_values_and_offsets(lord):
    """A jagged NestedTensor is a tensor subclass with no storage of its own (its
    untyped_storage() is torch's invalid one): its memory is the inner tensors it flattens
    to. allocate() raised TypeError ("memory cannot be read") for it before."""
    j = _jagged(3, 4)
    parts = _jagged_parts(j)
    want = sum(storage_nbytes(p) for p in parts)
    assert want == 7 * 5 * 4 + 3 * 8
    lord.allocate(j)
    assert lord.allocated()[0] == want == expected_bytes(j)["cpu"]
    assert lord.stats()["cpu"]["allocs"] == len(parts) == 2
    lord.free(j)
    assert lord.allocated()[0] == 0
    assert lord.stats()["cpu"]["freed_total"] == want


def test_jagged_nested_tensor_with_lengths_counts_all_three(lord):
    values, offsets, lengths = torch.randn(20, 8), torch.tensor([0, 5, 12, 20]), torch.ones(3)
    j = torch.nested.nested_tensor_from_jagged(values, offsets, lengths)
    lord.allocate(j)
    assert lord.allocated()[0] == sum(map(storage_nbytes, (values, offsets, lengths)))
    assert lord.stats()["cpu"]["allocs"] == 3


def test_jagged_and_its_values_in_one_call_count_once(lord):
    j = _jagged(2, 6)
    k = j * 2  # new values, j's offsets
    lord.allocate([j, j.values(), k])
    want = sum(storage_nbytes(p) for p in (j.values(), j.offsets(), k.values()))
    assert lord.allocated()[0] == want == expected_bytes([j, k])["cpu"]
    assert lord.stats()["cpu"]["allocs"] == 3


def test_strided_nested_tensor_counts_its_buffer(lord):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    lord.allocate(n)
    assert lord.allocated()[0] == storage_nbytes(n) == 6 * 3 * 4


# --------------------------------------------------------------------------- numpy


def test_ndarray_counts_nbytes_as_cpu(lord):
    a = np.zeros((10, 10), dtype=np.float64)
    lord.allocate(a)
    assert lord.allocated() == (800, "800 B")
    assert lord.allocated("cpu")[0] == 800
    assert list(lord.stats()) == ["cpu"]


@pytest.mark.parametrize(
    "make_view",
    [lambda a: a[3:], lambda a: a[::2], lambda a: a.reshape(5, 20), lambda a: a[10:][5:]],
    ids=["slice", "strided", "reshape", "view-of-view"],
)
def test_ndarray_view_counts_base_buffer(lord, make_view):
    a = np.zeros(100, dtype=np.float32)
    v = make_view(a)
    assert v.base is a
    lord.allocate(v)
    assert lord.allocated()[0] == 400


def test_ndarray_views_in_one_call_count_once(lord):
    a = np.zeros(100, dtype=np.int8)
    lord.allocate((a, a[1:], a[50:].reshape(10, 5)))
    assert lord.allocated()[0] == 100
    assert lord.stats()["cpu"]["allocs"] == 1


def test_distinct_ndarrays_add_up(lord):
    lord.allocate([np.zeros(10, np.int8), np.zeros(10, np.int16), np.zeros(1, np.complex128)])
    assert lord.allocated()[0] == 10 + 20 + 16


def test_ndarray_and_tensor_sharing_memory_count_once(lord):
    a = np.zeros(32, dtype=np.float32)
    t = torch.from_numpy(a)
    assert t.untyped_storage().data_ptr() == a.ctypes.data
    lord.allocate([a, t])
    assert lord.allocated()[0] == 128


def test_zero_size_ndarray_counts_nothing(lord):
    lord.allocate(np.zeros(0))
    lord.allocate(np.zeros((3, 0), dtype=np.float64))
    assert lord.allocated()[0] == 0
    assert lord.stats() == {}


# --------------------------------------------------------------------------- sequences


def test_tuple_and_list_mix_all_kinds(lord):
    t = torch.empty(10)
    m = nn.Linear(2, 2)
    a = np.zeros(8, dtype=np.uint8)
    for obj in ((t, m, a), [t, m, a]):
        lord.reset()
        lord.allocate(obj)
        assert lord.allocated()[0] == 40 + 24 + 8
        assert lord.stats()["cpu"]["allocs"] == 4


def test_empty_sequences_count_nothing(lord):
    lord.allocate(())
    lord.allocate([])
    lord.free(())
    assert lord.allocated() == (0, "0 B")
    assert lord.freed() == (0, "0 B")


def test_list_is_not_mutated_and_may_hold_duplicates(lord):
    t = torch.empty(4)
    lst = [t, t, t]
    lord.allocate(lst)
    assert len(lst) == 3 and all(x is t for x in lst)
    assert lord.allocated()[0] == 16


def test_tuple_subclass_namedtuple(lord):
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    lord.allocate(Pair(torch.empty(2), torch.empty(3)))
    assert lord.allocated()[0] == 20


# --------------------------------------------------------------------------- meta / zero-size


def test_meta_tensor_counts_nothing(lord):
    lord.allocate(torch.empty(1000, device="meta"))
    lord.free(torch.empty(1000, device="meta"))
    assert lord.allocated() == (0, "0 B")
    assert lord.freed() == (0, "0 B")
    assert lord.stats() == {}


def test_meta_module_counts_nothing(lord):
    with torch.device("meta"):
        m = nn.Linear(100, 100)
    lord.allocate(m)
    assert lord.stats() == {}


def test_zero_size_tensor_counts_nothing(lord):
    lord.allocate(torch.empty(0))
    lord.allocate([torch.empty(0, 5), torch.empty(3)[3:]])  # last is a view of 12 bytes
    assert lord.allocated()[0] == 12
    assert set(lord.stats()) == {"cpu"}
    lord.reset()
    lord.allocate(torch.empty(0))
    assert lord.stats() == {}


# --------------------------------------------------------------------------- free


def test_free_balances_allocate(lord):
    m = nn.Linear(16, 15)
    lord.allocate(m)
    lord.free(m)
    st = lord.stats()["cpu"]
    assert st["allocated"] == 0
    assert st["freed"] == st["freed_total"] == st["allocated_total"] == 255 * 4
    assert st["allocs"] == st["frees"] == 2
    assert lord.freed() == (1020, "1020 B")


def test_free_never_goes_below_zero(lord):
    t = torch.empty(25)  # 100 bytes
    lord.allocate(t)
    lord.free(t)
    lord.free(t)
    st = lord.stats()["cpu"]
    assert st["allocated"] == 0
    assert lord.allocated() == (0, "0 B")
    assert st["freed"] == st["freed_total"] == 200
    assert st["frees"] == 2


def test_free_without_allocate_clamps_and_records_freed(lord):
    lord.free(torch.empty(10))
    st = lord.stats()["cpu"]
    assert st["allocated"] == 0
    assert st["freed"] == 40
    # later allocations start from zero, not from a negative balance
    lord.allocate(torch.empty(10))
    assert lord.allocated()[0] == 40


def test_partial_free(lord):
    a, b = torch.empty(10), torch.empty(20)
    lord.allocate((a, b))
    lord.free(a)
    assert lord.allocated()[0] == 80
    assert lord.freed()[0] == 40


def test_clamp_is_per_device(lord, fake):
    c0 = fake(100, 0)
    lord.allocate(c0)
    lord.free(torch.empty(1000))  # cpu over-free must not touch cuda:0
    assert lord.allocated("cuda:0")[0] == 400
    assert lord.allocated("cpu")[0] == 0
    assert lord.allocated()[0] == 400


# --------------------------------------------------------------------------- devices in one call


def test_fake_cuda_tensors_count_per_index(lord, fake):
    c0, c1 = fake(10, 0), fake(20, 1)
    cpu = torch.empty(5)
    lord.allocate([c0, c1, cpu])
    assert lord.allocated("cuda:0")[0] == 40
    assert lord.allocated("cuda:1")[0] == 80
    assert lord.allocated("cpu")[0] == 20
    assert lord.allocated()[0] == 140
    assert set(lord.stats()) == {"cpu", "cuda:0", "cuda:1"}


def test_same_key_on_different_devices_is_not_deduplicated(lord, fake):
    # fake storages all have pointer 0: same size on two devices is two storages
    lord.allocate([fake(10, 0), fake(10, 1)])
    assert lord.allocated("cuda")[0] == 80


def test_stats_entries_have_all_keys_as_ints(lord):
    lord.allocate(torch.empty(2))
    st = lord.stats()
    assert all(type(v) is int for v in counters(st["cpu"]).values())
    assert set(counters(st["cpu"])) == set(ZERO_STATS)


def test_a_method_patched_after_first_use_is_honoured(lord):
    """memlord calls torch's own descriptors directly while a type resolves to them; a
    type patched later (its version tag changes) is looked up again."""

    class Patchable(torch.Tensor):
        pass

    t = torch.ones(4).as_subclass(Patchable)
    lord.allocate(t)  # the fast path now knows Patchable
    assert lord.stats()["cpu"]["allocated"] == 16

    def refuse(self):
        raise RuntimeError("storage hidden by a patch")

    Patchable.untyped_storage = refuse
    try:
        with pytest.raises(TypeError, match="obj") as info:
            lord.allocate(t)
        assert "storage hidden by a patch" in str(info.value.__cause__)
    finally:
        del Patchable.untyped_storage
    lord.allocate(t)
    assert lord.stats()["cpu"]["allocated"] == 32


def test_a_tensor_whose_storage_is_invalid_is_named_with_a_cold_type_cache(lord):
    """A FunctionalTensor left by a FunctionalTensorMode has a storage whose data_ptr()
    raises. The walk asked whether its type is a traceable wrapper subclass with that
    RuntimeError pending, and CPython's type lookup, on a miss of its method cache,
    cleared it: allocate() then returned NULL with no exception (a SystemError), in a
    fresh process or after anything cleared the cache."""
    import sys

    from torch._subclasses.functional_tensor import FunctionalTensorMode

    with FunctionalTensorMode():
        kept = torch.ones(3) + 1
    for _ in range(2):
        sys._clear_type_cache()
        with pytest.raises(TypeError, match="memory cannot be read"):
            lord.allocate([kept])
        with pytest.raises(TypeError, match="memory cannot be read"):
            lord.free(kept)
    assert lord.stats() == {}
