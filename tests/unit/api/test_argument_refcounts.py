"""Reference counts of every argument are unchanged after many calls, on success and on error."""

import sys

import numpy as np
import pytest
import torch
from conftest import fake_cuda
from torch import nn

N = 2000


def _objects():
    t = torch.empty(64)
    a = np.zeros(32)
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    m[0].weight = nn.Parameter(torch.empty(4, 4))
    return {
        "tensor": t,
        "view": t[3:],
        "parameter": nn.Parameter(torch.empty(5)),
        "module": m,
        "ndarray": a,
        "ndarray_view": a[1:],
        "sparse": torch.eye(3).to_sparse_csr(),
        "fake_cuda": fake_cuda(7, 1),
        "list": [t, a, m],
        "tuple": (t, m, a[2:]),
    }


OBJECTS = _objects()


@pytest.mark.parametrize("name", list(OBJECTS))
def test_refcounts_unchanged_after_many_calls(name):
    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=16)  # GC runs on the fake-cuda case
    obj = OBJECTS[name]
    parts = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    inner = []
    for p in parts:
        if isinstance(p, nn.Module):
            inner += list(p.parameters()) + list(p.buffers()) + [p._parameters, p._modules]
        if isinstance(p, np.ndarray) and p.base is not None:
            inner.append(p.base)
    # torch caches one Python storage object per storage: a leaked reference to it keeps the
    # tensor's memory alive after the user drops the tensor, so watch storages too.
    storages = [
        x.untyped_storage()
        for x in [*parts, *inner]
        if isinstance(x, torch.Tensor) and x.layout == torch.strided
    ]
    watched = [obj, *parts, *inner, *storages]
    before = [sys.getrefcount(x) for x in watched]
    dev = "cpu" if name != "fake_cuda" else "cuda:1"
    for _ in range(N):
        lord.allocate(obj)
        lord.free(obj)
        lord.allocated(dev)
        lord.freed()
    after = [sys.getrefcount(x) for x in watched]
    assert after == before


def test_refcounts_unchanged_after_failing_calls():
    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=None)
    t, a, m = torch.empty(8), np.zeros(8), nn.Linear(2, 2)
    bad_tuple = (t, a, m, "x")
    bad_list = [t, [a]]
    watched = [t, a, m, bad_tuple, bad_list, m.weight]
    before = [sys.getrefcount(x) for x in watched]
    for _ in range(N):
        for bad in (bad_tuple, bad_list):
            with pytest.raises(TypeError):
                lord.allocate(bad)
            with pytest.raises(TypeError):
                lord.free(bad)
    del bad
    assert [sys.getrefcount(x) for x in watched] == before
    assert lord.stats() == {}


def test_refcounts_of_query_arguments():
    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=None)
    lord.allocate([torch.empty(3), fake_cuda(3, 0)])
    dev_obj = torch.device("cuda", 0)
    dev_str = "".join(["cuda", ":0"])
    # The core may keep the last selector string it parsed (one reference, a bounded cache
    # of an immutable object); what must not happen is growth per call.
    lord.freed(dev_str)
    lord.top_alloc_site(dev_str)
    before = (sys.getrefcount(dev_obj), sys.getrefcount(dev_str))
    for _ in range(N):
        lord.allocated(dev_obj)
        lord.freed(dev_str)
        lord.stats(dev_obj)
        lord.top_alloc_site(dev_str)
        lord.top_free_site(dev_obj)
    assert (sys.getrefcount(dev_obj), sys.getrefcount(dev_str)) == before


def test_refcounts_of_threshold_arguments():
    from memlord import MemLord

    big = 2**40 + 12345  # not a cached small int
    lord = MemLord(auto_gc_bytes=big)
    before = sys.getrefcount(big)
    for _ in range(N):
        lord.set_auto_gc(big)
        MemLord(auto_gc_bytes=big)
        lord.auto_gc_bytes  # noqa: B018
    assert sys.getrefcount(big) == before


def test_lord_is_collected():
    import gc
    import weakref

    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=None)
    lord.allocate(nn.Linear(3, 3))
    r = weakref.ref(lord)
    del lord
    gc.collect()
    assert r() is None


def _tracked_memory_is_released(kind, lord):
    """Track a tensor/module/array whose memory is owned by a numpy array, drop every user
    reference, and report whether that memory was released."""
    import gc
    import weakref

    owner = np.zeros(1000, dtype=np.float32)
    alive = weakref.ref(owner)
    t = torch.from_numpy(owner)
    if kind == "tensor":
        obj = t
    elif kind == "view":
        obj = t[10:]
    elif kind == "module":
        obj = nn.Linear(2, 2)
        obj.weight = nn.Parameter(t[:4].view(2, 2))
    elif kind == "sparse":
        obj = torch.sparse_coo_tensor(torch.zeros(1, 1000, dtype=torch.int64), t, (5,))
    else:
        obj = [t, owner[5:]]
    for _ in range(10):
        lord.allocate(obj)
        lord.allocated()
        lord.free(obj)
    del owner, t, obj
    gc.collect()
    return alive() is None


@pytest.mark.parametrize("kind", ["tensor", "view", "module", "sparse", "list"])
def test_tracking_does_not_keep_memory_alive(kind):
    from memlord import MemLord

    lord = MemLord(auto_gc_bytes=None)
    assert _tracked_memory_is_released(kind, lord)
    storages_per_call = {"module": 2, "sparse": 2}.get(kind, 1)  # weight+bias; indices+values
    assert lord.stats()["cpu"]["allocs"] == 10 * storages_per_call
