"""Ways a program comes to hold a storage that torch allocated, each against the bytes of
the storages the program holds, found from outside (a walk of the garbage collector's
tensors and storages, deduplicated by storage) and, where torch's profiler sees the
allocation, its memory timeline: the random number generator's state
(``torch.get_rng_state``, which activation checkpointing calls for every checkpointed
call), the category of what checkpointing's recomputation makes in backward with
``ops=True`` alone (no ``track_modules``), and ``set_`` of a storage that existed."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.checkpoint as cp
from support.ledger import torch_memory

from memlord import MemLord


def live_storages() -> dict[tuple[int, int], int]:
    """Every CPU storage a tensor or storage object the garbage collector knows holds, keyed
    by (data pointer, bytes): torch's figures, nothing of memlord's."""
    gc.collect()
    out: dict[tuple[int, int], int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.layout == torch.strided and not o.is_nested:
            s = o.untyped_storage()
        elif isinstance(o, torch.UntypedStorage):
            s = o
        else:
            continue
        if s.device.type == "cpu" and s.nbytes():
            out[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return out


def new_bytes(before: dict[tuple[int, int], int]) -> int:
    """The bytes of the storages held now that were not held at ``before``."""
    return sum(v for k, v in live_storages().items() if k not in before)


# --------------------------------------------------------------- the generator's state


OPS = pytest.mark.parametrize("ops", [False, True], ids=["factories", "ops"])


@OPS
@pytest.mark.parametrize("owner", [torch, torch.random], ids=["torch", "torch.random"])
def test_rng_state_is_counted_as_torch_allocates_it(owner, ops):
    """torch.get_rng_state() makes a tensor in C++ that no dispatch mode sees; torch's
    profiler sees its allocation on the CPU, and memlord counts the same bytes."""
    lord = MemLord(auto_gc_bytes=None)
    before = live_storages()
    with lord.hook_into_torch(), lord.hook_into_python(ops=ops):
        # one hook under both names, as bare: torch.random's function is torch's
        assert torch.get_rng_state is torch.random.get_rng_state
        with torch_memory() as seen:
            state = owner.get_rng_state()
        assert state.untyped_storage().nbytes() == seen.net > 0
        assert lord.allocated("cpu")[0] == new_bytes(before) == seen.net
        assert lord.categories("cpu")["activation"]["current"] == seen.net
        del state
        gc.collect()
        assert lord.allocated("cpu")[0] == 0  # credited when it dies


@OPS
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoints_saved_rng_state_is_counted_while_held(ops, reentrant):
    """A checkpointed call keeps the generator's state for its recomputation: counted
    while the checkpoint holds it; with ``ops=True`` everything the step holds is."""
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(8, 32, requires_grad=True)
    rng = torch.get_rng_state().untyped_storage().nbytes()
    lord = MemLord(auto_gc_bytes=None)
    before = live_storages()
    with lord.hook_into_torch(), lord.hook_into_python(ops=ops):
        y = cp.checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=reentrant)
        held = new_bytes(before)
        ys = y.untyped_storage().nbytes()
        assert held == rng + ys
        assert lord.allocated("cpu")[0] == (held if ops else rng)
        y.sum().backward()
        del y
        held = new_bytes(before)  # x.grad and w.grad
        assert lord.allocated("cpu")[0] == (held if ops else 0)


# -------------------------------------------- checkpointing's recomputation, no modules


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_recomputation_is_activation_without_track_modules(reentrant):
    """What the checkpointed function makes again in backward is an activation (as
    MemTracker counts a checkpointed module's recomputation), with ``ops=True`` alone;
    what backward itself makes stays a temporary."""
    made: list[torch.Tensor] = []

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a.sin()
        made.append(h)  # the forward's h, then the recomputation's
        return h.cos()

    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(1024)
    w = torch.randn(16, 16, requires_grad=True)
    with lord.hook_into_python(ops=True):
        y = cp.checkpoint(fn, torch.randn(4, 16) @ w, use_reentrant=reentrant)
        y.sum().backward()
        recs = lord.decode_events(lord.events())
    assert len(made) == 2
    born = {e["address"]: e["category"] for e in recs if e["kind"] == "alloc"}
    forward, recomputed = (born[t.untyped_storage().data_ptr()] for t in made)
    assert forward == recomputed == "activation"
    assert "temporary" in born.values()  # backward's own (cos' and sin's derivatives)


# ------------------------------------------- set_ onto a storage no source saw made


@pytest.mark.parametrize(
    "how", ["set_", "deepcopy", "storage_copy"], ids=["set_", "deepcopy", "storage_copy"]
)
def test_an_existing_storage_set_into_a_tensor_is_found_not_made(how):
    """``set_`` allocates nothing: the storage it puts into a tensor existed. One that no
    source saw made (a tensor made before the hooks) is found (counted from here, with no
    call site, category other), never an allocation of the line that called it; what the
    call really made is (``copy.deepcopy`` and ``UntypedStorage.copy_`` wrap both storages
    in tensors with ``set_``)."""
    import copy

    old = torch.randn(64, 64)  # before the hooks: no source saw it made
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(64)
    before = live_storages()
    with lord.hook_into_python(ops=True):
        if how == "set_":
            t = torch.empty(0)
            t.set_(old.untyped_storage())
        elif how == "deepcopy":
            t = copy.deepcopy(old)
        else:
            t = torch.empty(64, 64)
            t.untyped_storage().copy_(old.untyped_storage())
        recs = lord.decode_events(lord.events())
    made = new_bytes(before)
    allocs = [e for e in recs if e["kind"] == "alloc"]
    frees = sum(e["bytes"] for e in recs if e["kind"] == "free")  # deepcopy's new_empty([])
    found = {(e["address"], e["bytes"], e["category"]) for e in allocs if e["source"] == "found"}
    old_storage = (old.untyped_storage().data_ptr(), old.untyped_storage().nbytes(), "other")
    if how == "deepcopy":
        # the copy's storage comes from torch.UntypedStorage(n), which no source sees
        # (docs/guide.md): found too when set_ puts it in a tensor
        copied = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), "other")
        assert found == {old_storage, copied}
        made -= copied[1]
    else:
        assert found == {old_storage}
    assert sum(e["bytes"] for e in allocs if e["source"] != "found") - frees == made
    assert lord.allocated("cpu")[0] == new_bytes(before) + old.untyped_storage().nbytes()
    top = lord.top_alloc_site()
    assert (top[2] if top else 0) == made + frees  # a found storage is no line's


# ------------------------------------------------------------ Tensor.new_* factories


@OPS
@pytest.mark.parametrize(
    "make",
    [
        lambda b: b.new_empty(10),
        lambda b: b.new_zeros(11),
        lambda b: b.new_ones((3, 4)),
        lambda b: b.new_full((13,), 2.0),
        lambda b: b.new_empty_strided((4, 4), (4, 1)),
        lambda b: b.new_tensor([1.0, 2.0]),
    ],
    ids=["new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "new_tensor"],
)
def test_tensor_new_methods_are_counted_as_factories(make, ops):
    """``Tensor.new_*`` are factories (a new storage, the source's dtype and device): counted
    with the factory wrappers, ``ops`` or not, as torch's profiler sees them allocate."""
    base = torch.randn(8, 8)
    lord = MemLord(auto_gc_bytes=None)
    before = live_storages()
    with lord.hook_into_python(ops=ops):
        with torch_memory() as seen:
            t = make(base)
        assert t.untyped_storage().nbytes() == seen.net == new_bytes(before) > 0
        assert lord.allocated("cpu")[0] == seen.net
        assert lord.categories("cpu")["activation"]["current"] == seen.net
