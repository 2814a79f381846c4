"""Ways a program comes to hold a storage that torch allocated, each against the bytes of
the storages the program holds, found from outside (a walk of the garbage collector's
tensors and storages, deduplicated by storage) and, where torch's profiler sees the
allocation, its memory timeline: the random number generator's state
(``torch.get_rng_state``, which activation checkpointing calls for every checkpointed
call), the category of what checkpointing's recomputation makes in backward with
``ops=True`` alone (no ``track_modules``), ``set_`` of a storage that existed, the
``Tensor.new_*`` factories, each other creation path docs/guide.md lists as counted, and
the memory torch did not allocate, which it does not count."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.checkpoint as cp
from support.ledger import torch_memory
from support.outcomes import error_of, outcome

from memlord import MemLord


def _storages_of(t: torch.Tensor, out: dict[tuple[int, int], int]) -> None:
    """t's storages into out: a sparse tensor's components, a jagged tensor's inner
    tensors, else its own storage."""
    if t.is_sparse:
        parts = [t._indices(), t._values()]
    elif t.layout == torch.sparse_csr:
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.is_nested and t.layout == torch.jagged:
        parts = [getattr(t, n) for n in t.__tensor_flatten__()[0]]
    elif t.layout == torch.strided:
        parts = []
        s = t.untyped_storage()
        if s.device.type == "cpu" and s.nbytes():
            out[(s.data_ptr(), s.nbytes())] = s.nbytes()
    else:
        parts = []
    for p in parts:
        _storages_of(p, out)


def live_storages() -> dict[tuple[int, int], int]:
    """Every CPU storage a tensor or storage object the garbage collector knows holds, keyed
    by (data pointer, bytes): torch's figures, nothing of memlord's."""
    gc.collect()
    out: dict[tuple[int, int], int] = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor):
                _storages_of(o, out)
            elif isinstance(o, torch.UntypedStorage) and o.device.type == "cpu" and o.nbytes():
                out[(o.data_ptr(), o.nbytes())] = o.nbytes()
        except RuntimeError:
            continue  # a storage object whose storage is gone
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
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    mt = mem_tracker.MemTracker()
    with mt:
        state = owner.get_rng_state()
    # MemTracker sees no operator make it (docs/guide.md says so)
    assert state.numel() > 0
    assert mt.get_tracker_snapshot().get(torch.device("cpu"), {}).get("Total", 0) == 0


@OPS
@pytest.mark.parametrize("how", ["bound", "unbound"])
def test_a_generators_own_state_is_counted_and_the_method_put_back(how, ops):
    """``Generator.get_state()`` (a generator of one's own: a sampler's, a data loader's)
    makes its tensor in C++ as ``torch.get_rng_state()`` does: counted as torch's
    profiler sees it allocated, credited when it dies; ``set_state`` takes it back as
    bare; a bad call raises what it raises bare; ``disable()`` puts the very method
    descriptor back in the immutable C type."""
    original = torch.Generator.__dict__["get_state"]
    g = torch.Generator().manual_seed(7)
    bare_state = g.get_state()
    bare_error = error_of(lambda: torch.Generator.get_state(5))
    lord = MemLord(auto_gc_bytes=None)
    before = live_storages()
    with lord.hook_into_python(ops=ops):
        assert torch.Generator.__dict__["get_state"] is not original
        with torch_memory() as seen:
            state = g.get_state() if how == "bound" else torch.Generator.get_state(g)
        assert torch.equal(state, bare_state)
        assert state.untyped_storage().nbytes() == seen.net > 0
        assert lord.allocated("cpu")[0] == new_bytes(before) == seen.net
        g.set_state(state)
        assert torch.equal(g.get_state(), bare_state)
        assert error_of(lambda: torch.Generator.get_state(5)) == bare_error
        del state
        gc.collect()
        assert lord.allocated("cpu")[0] == 0  # credited when it dies
    assert torch.Generator.__dict__["get_state"] is original
    assert torch.Generator.get_state is original


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
    # deepcopy's copy is made by torch.UntypedStorage(n): counted there, at this line
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


# ------------------------------------------------- the creation paths, one by one


def _load(tmp_path, **kw):
    path = tmp_path / "w.pt"
    torch.save({"w": torch.randn(50, 50)}, path)
    return lambda keep: keep.append(torch.load(path, **kw))


def _in_thread(keep):
    import threading

    th = threading.Thread(target=lambda: keep.append(torch.zeros(100)))
    th.start()
    th.join()


def _under(ctx):
    def make(keep):
        with ctx():
            keep.append(torch.zeros(100))
            keep.append(keep[-1] * 2)

    return make


def _share(keep):
    t = torch.randn(100)
    t.share_memory_()
    keep.append(t)


def _cat_out(keep):
    out = torch.empty(0)
    torch.cat([torch.ones(10), torch.ones(10)], out=out)
    keep.append(out)


def _resize(keep):
    t = torch.empty(10)
    t.resize_(1000)
    keep.append(t)


def _storage_resize(keep):
    t = torch.empty(10)
    t.untyped_storage().resize_(4000)
    keep.append(t)


def _deepcopy(what):
    def make(keep):
        import copy

        keep.append(copy.deepcopy(what()))

    return make


def _pickled(keep):
    import pickle

    keep.append(pickle.loads(pickle.dumps(torch.randn(30, 30))))


PATHS = {
    # name: (make, counted without ops)
    "load": (None, True),
    "load_weights_only_false": (None, True),
    "thread_factory": (_in_thread, True),
    "share_memory_": (_share, True),
    "complex": (lambda k: k.append(torch.randn(10, dtype=torch.complex64)), True),
    "tensor_of_numpy": (lambda k: k.append(torch.tensor(torch.ones(5).numpy())), True),
    "deepcopy_module": (_deepcopy(lambda: torch.nn.Linear(8, 8)), True),
    "no_grad": (_under(torch.no_grad), False),
    "inference_mode": (_under(torch.inference_mode), False),
    "cat_out": (_cat_out, False),
    "resize_": (_resize, False),
    "storage_resize_": (_storage_resize, False),
    "parameters_to_vector": (
        lambda k: k.append(torch.nn.utils.parameters_to_vector(torch.nn.Linear(4, 4).parameters())),
        False,
    ),
    "foreach_add": (lambda k: k.append(torch._foreach_add([torch.ones(8)] * 2, 1.0)), False),
    "to_sparse": (lambda k: k.append(torch.eye(16).to_sparse()), False),
    "to_sparse_csr": (lambda k: k.append(torch.eye(16).to_sparse_csr()), False),
    "quantize": (
        lambda k: k.append(torch.quantize_per_tensor(torch.ones(64), 0.1, 0, torch.qint8)),
        False,
    ),
    "nested_jagged": (
        lambda k: k.append(
            torch.nested.nested_tensor([torch.ones(3, 4), torch.ones(5, 4)], layout=torch.jagged)
        ),
        False,
    ),
    "deepcopy_tensor": (_deepcopy(lambda: torch.randn(16, 16)), True),
    "pickle_loads": (_pickled, True),
    "untyped_storage": (lambda k: k.append(torch.UntypedStorage(1000)), True),
    "typed_storage": (lambda k: k.append(torch.FloatStorage(100)), True),
}


@OPS
@pytest.mark.parametrize("name", list(PATHS))
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
def test_each_creation_path_is_counted_exactly(name, ops, tmp_path):
    """With both hooks on, the ledger equals the bytes of the storages each path leaves the
    program holding (found from outside); without ``ops`` only the paths a factory,
    conversion or category source sees count (operators' results do not)."""
    make, without_ops = PATHS[name]
    if name.startswith("load"):
        make = _load(tmp_path, **({"weights_only": False} if "false" in name else {}))
    keep: list = []
    lord = MemLord(auto_gc_bytes=None)
    before = live_storages()
    with lord.hook_into_torch(), lord.hook_into_python(ops=ops):
        make(keep)
        held = new_bytes(before)
        assert held > 0
        if ops or without_ops:
            assert lord.allocated("cpu")[0] == held
        keep.clear()
        gc.collect()
        assert lord.allocated("cpu")[0] == 0  # every one credited as it died


@pytest.mark.parametrize(
    ("view", "memtracker_sees"),
    [
        (lambda: torch.from_numpy(torch.ones(64).numpy() * 2), True),
        (lambda: torch.frombuffer(bytearray(256), dtype=torch.float32), False),
        (lambda: torch.utils.dlpack.from_dlpack(torch.ones(64).numpy() * 2), False),
        (lambda: torch.as_tensor(torch.ones(64).numpy() * 2), True),
    ],
    ids=["from_numpy", "frombuffer", "from_dlpack", "as_tensor_of_array"],
)
def test_memory_torch_did_not_allocate_is_not_counted(view, memtracker_sees):
    """A tensor over numpy's or a buffer's memory: torch's profiler sees no allocation,
    and memlord counts nothing (ops or not); torch's MemTracker counts the tensors an
    operator it sees returns (from_numpy's, as_tensor's of an array), as docs/guide.md
    says."""
    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python(ops=True):
        with torch_memory() as seen:
            t = view()
        assert t.numel() == 64
        assert seen.net == 0
        assert lord.allocated("cpu")[0] == 0
    mt = mem_tracker.MemTracker()
    with mt:
        t = view()
    theirs = mt.get_tracker_snapshot().get(torch.device("cpu"), {}).get("Total", 0)
    assert theirs == (t.untyped_storage().nbytes() if memtracker_sees else 0)


def test_a_storage_made_without_a_tensor_is_the_callers_allocation():
    """``torch.UntypedStorage(n)`` is counted at the line that called it (not memlord's,
    not torch's), credited when it dies, and the class is torch's own again after."""
    from conftest import here

    own_before = "__new__" in torch.UntypedStorage.__dict__
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        with torch_memory() as seen:
            s, line = torch.UntypedStorage(4096), here()
        assert s.nbytes() == seen.net == lord.allocated("cpu")[0]
        _dev, site, nbytes = lord.top_alloc_site()
        assert nbytes == 4096
        assert site.endswith(f"test_creation_paths.py:{line}"), site
        del s
        gc.collect()
        assert lord.allocated("cpu")[0] == 0
    assert ("__new__" in torch.UntypedStorage.__dict__) == own_before
    assert torch.UntypedStorage(8).nbytes() == 8


@OPS
def test_mmap_load_counts_the_loaded_storages(ops, tmp_path):
    """``torch.load(mmap=True)``: each loaded tensor's storage counts its bytes (``loaded``),
    as without mmap; the mapping of the whole file (a storage torch keeps besides) does
    not."""
    path = tmp_path / "w.pt"
    torch.save({"a": torch.randn(50, 50), "b": torch.randn(10)}, path)
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python(ops=ops):
        sd = torch.load(path, mmap=True)
        want = sum(t.untyped_storage().nbytes() for t in sd.values())
        assert want == 50 * 50 * 4 + 10 * 4
        assert lord.allocated("cpu")[0] == want
        assert lord.categories("cpu")["loaded"]["current"] == want


def test_the_storage_helpers_check_their_arguments_and_change_nothing():
    """The core's helpers behind the UntypedStorage hook: a bad argument to the slot
    helper is a TypeError naming what it takes; something that is no storage given to the
    counter is not counted and raises nothing (it runs inside torch's constructor); the
    argument's reference count is unchanged either way."""
    import sys

    from memlord import _core

    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        before = lord.allocated("cpu")[0]
        for args in ((3, True), (torch.UntypedStorage, 1), (torch.UntypedStorage,)):
            with pytest.raises(TypeError, match=r"_storage_new_slot\(cls, restore\)"):
                _core._storage_new_slot(*args)
        thing = object()
        refs = sys.getrefcount(thing)
        for bad in (thing, "storage", None, torch.empty(0).untyped_storage()):
            assert _core._storage_made(bad) is None
        assert sys.getrefcount(thing) == refs
        assert lord.allocated("cpu")[0] == before
    assert "__new__" not in torch.UntypedStorage.__dict__  # the hook came off as usual


def test_cuda_generator_state_is_hooked_under_both_names_and_put_back():
    """torch.cuda.get_rng_state is hooked too (on a GPU its CPU tensor is counted as
    torch.get_rng_state's is, above): torch.cuda.random's name keeps naming the same
    function, as bare, a CPU-only torch raises exactly what it raises bare, and
    disable() puts the very functions back."""
    import torch.cuda.random as cuda_random

    original = torch.cuda.get_rng_state
    assert cuda_random.get_rng_state is original

    def state_type():
        return outcome(lambda: type(torch.cuda.get_rng_state()).__name__)

    bare = state_type()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        assert torch.cuda.get_rng_state is not original
        assert cuda_random.get_rng_state is torch.cuda.get_rng_state
        assert state_type() == bare
    assert torch.cuda.get_rng_state is original
    assert cuda_random.get_rng_state is original
