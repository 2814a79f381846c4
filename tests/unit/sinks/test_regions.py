"""Regions (lord.region), their aggregate (lord.regions) and module breakdowns
(lord.track_modules): exact per-device numbers on the CPU."""

from __future__ import annotations

import threading

import pytest
import torch
from support.ledger import storage_bytes
from torch import nn

from memlord import MemLord

KiB = 1024


def plain(d: dict) -> dict:
    """Stats without their split by category (tests/unit/sinks/test_region_categories.py
    checks that): a device's dict, or a dict of them."""
    if "categories" in d:
        return {k: v for k, v in d.items() if k != "categories"}
    return {k: plain(v) if isinstance(v, dict) else v for k, v in d.items()}


def u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_region_delta_peak_counts():
    lord = MemLord()
    lord.allocate(u8(10 * KiB))  # live before the region
    with lord.region("step") as r:
        a, b = u8(4 * KiB), u8(2 * KiB)
        lord.allocate(a)
        lord.allocate(b)
        lord.free(a)
    assert plain(r.stats) == {
        "cpu": {"delta": 2 * KiB, "peak": 16 * KiB, "peak_delta": 6 * KiB, "allocs": 2, "frees": 1}
    }
    assert r.duration_s > 0
    assert r.name == "step"


def test_a_free_of_more_than_is_allocated_moves_the_region_as_the_ledger():
    """free() never drives allocated below 0 (docs/api.md): freeing 100 B with 30 B counted
    leaves 0. A region's delta is allocated at exit minus at entry, so it is -30, not the
    -100 the free asked for; its category split follows."""
    lord = MemLord()
    lord.allocate(u8(30))
    before = lord.allocated("cpu")[0]
    with lord.region("clipped") as r:
        lord.free(u8(100))
    after = lord.allocated("cpu")[0]
    assert (before, after) == (30, 0)
    assert plain(r.stats) == {
        "cpu": {"delta": after - before, "peak": 30, "peak_delta": 0, "allocs": 0, "frees": 1}
    }
    assert sum(c["delta"] for c in r.stats["cpu"]["categories"].values()) == after - before
    assert lord.stats()["cpu"]["freed"] == 100  # what was freed is still what it was


def test_empty_region_has_no_devices():
    lord = MemLord()
    with lord.region("nothing") as r:
        pass
    assert plain(r.stats) == {}
    assert lord.regions()["nothing"]["count"] == 1


def test_nested_regions():
    lord = MemLord()
    with lord.region("outer") as outer:
        lord.allocate(u8(KiB))
        with lord.region("inner") as inner:
            t = u8(8 * KiB)
            lord.allocate(t)
            lord.free(t)
        lord.allocate(u8(2 * KiB))
    assert plain(inner.stats["cpu"]) == {
        "delta": 0,
        "peak": 9 * KiB,
        "peak_delta": 8 * KiB,
        "allocs": 1,
        "frees": 1,
    }
    assert plain(outer.stats["cpu"]) == {
        "delta": 3 * KiB,
        "peak": 9 * KiB,
        "peak_delta": 9 * KiB,
        "allocs": 3,
        "frees": 1,
    }


def test_region_never_resets_the_global_peak():
    lord = MemLord()
    big = u8(64 * KiB)
    lord.allocate(big)
    lord.free(big)
    with lord.region("small") as r:
        t = u8(KiB)
        lord.allocate(t)
        lord.free(t)
    assert r.stats["cpu"]["peak"] == KiB
    assert lord.max_memory_allocated() == 64 * KiB
    assert lord.stats("cpu")["cpu"]["peak_allocated"] == 64 * KiB


def test_global_peak_reset_leaves_open_region_peak():
    lord = MemLord()
    with lord.region("r") as r:
        t = u8(8 * KiB)
        lord.allocate(t)
        lord.free(t)
        lord.reset_peak_memory_stats()
        assert lord.max_memory_allocated() == 0
    assert r.stats["cpu"]["peak_delta"] == 8 * KiB


def test_regions_across_threads_count_their_own_thread():
    lord = MemLord()
    results = {}
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        with lord.region(f"t{i}") as r:
            barrier.wait()
            for _ in range(50):
                t = u8((i + 1) * KiB)
                lord.allocate(t)
                lord.free(t)
            lord.allocate(u8(i * KiB + 1))
            barrier.wait()
        results[i] = r.stats["cpu"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i in range(4):
        s = results[i]
        assert s["delta"] == i * KiB + 1
        assert s["allocs"] == 51 and s["frees"] == 50
        assert s["peak_delta"] == max((i + 1) * KiB, i * KiB + 1)
    assert lord.memory_allocated() == sum(i * KiB + 1 for i in range(4))


def test_decorator_opens_a_region_per_call():
    lord = MemLord()

    @lord.region("make")
    def make(n: int) -> torch.Tensor:
        t = u8(n)
        lord.allocate(t)
        return t

    make(KiB)
    make(3 * KiB)
    agg = lord.regions()["make"]
    assert agg["count"] == 2
    assert plain(agg["devices"]["cpu"]) == {
        "total_delta": 4 * KiB,
        "avg_delta": 2 * KiB,
        "max_delta": 3 * KiB,
        "max_peak_delta": 3 * KiB,
    }
    assert agg["total_s"] > 0
    assert make.__name__ == "make"


def test_regions_clear():
    lord = MemLord()
    with lord.region("a"):
        pass
    assert set(lord.regions(clear=True)) == {"a"}
    assert lord.regions() == {}


def test_region_exits_on_exception_and_reentry_is_refused():
    lord = MemLord()
    r = lord.region("boom")
    with pytest.raises(KeyError):
        with r:
            lord.allocate(u8(KiB))
            raise KeyError("x")
    assert r.stats["cpu"]["delta"] == KiB
    with r:
        with pytest.raises(RuntimeError, match="already open"):
            r.__enter__()


def test_bad_arguments():
    lord = MemLord()
    with pytest.raises(TypeError, match="'name'"):
        lord.region(3)
    with pytest.raises(TypeError, match="'clear'"):
        lord.regions(clear=1)
    with pytest.raises(TypeError, match="'model'"):
        lord.track_modules("model")
    with pytest.raises(TypeError, match="'backward'"):
        lord.track_modules(nn.Linear(2, 2), backward="yes")
    with pytest.raises(TypeError, match="function"):
        lord.region("x")(5)
    assert lord.regions() == {}
    # a tracker's regions() checks clear= as the lord's does (1 used to clear it)
    model = nn.Linear(2, 2)
    with lord.track_modules(model) as tracker:
        model(torch.ones(1, 2))
    with pytest.raises(TypeError, match="'clear'"):
        tracker.regions(clear=1)
    assert tracker.regions()["Linear"]["count"] == 1


def test_hooked_conversion_counts_in_region():
    lord = MemLord()
    x = torch.zeros(256, dtype=torch.float32)  # 1 KiB
    with lord.hook_into_torch():
        with lord.region("cast") as r:
            y = x.double()  # 2 KiB, counted by the conversion hook
    assert r.stats["cpu"]["allocs"] == 1
    assert r.stats["cpu"]["delta"] == y.nbytes == 2 * KiB


# ---- module breakdown: a small transformer, forward and backward --------------------

T, D = 8, 16


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        scratch = torch.zeros(64, dtype=torch.uint8)  # 64 B made inside backward
        del scratch
        return g * 2


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)  # T*T = 64 B
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2)).masked_fill(mask, float("-inf")).softmax(-1)
        return self.out(a @ v)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attn()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(x)
        return x + _Scale.apply(self.mlp(x))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        pos = torch.arange(T, dtype=torch.float32)  # 4*T = 32 B, alive through the layers
        x = x + pos[:, None]
        for layer in self.layers:
            x = layer(x)
        return x


def test_track_modules_transformer_forward_backward():
    lord = MemLord()
    model = TinyTransformer()
    x = torch.randn(T, D, requires_grad=True)
    with lord.hook_into_python(), lord.track_modules(model) as tracker:
        model(x).sum().backward()
        model(x).sum().backward()
    assert not tracker.enabled
    regs = tracker.regions()
    # every module that was called (the ModuleList "layers" is only iterated)
    expected = {n or "TinyTransformer" for n, _ in model.named_modules() if n != "layers"}
    assert set(regs) == expected | {n + " (backward)" for n in expected}
    for name, agg in regs.items():
        assert agg["count"] == 2, name

    def cpu(name):
        return regs[name]["devices"].get("cpu")

    # forward: the position table (32 B) lives while each attention's mask (64 B) does
    assert plain(cpu("TinyTransformer")) == {
        "total_delta": 0,
        "avg_delta": 0,
        "max_delta": 0,
        "max_peak_delta": 96,
    }

    def grads(module):  # torch's bytes of the gradients of module's parameters
        return storage_bytes(*(p.grad for p in module.parameters()))

    for i in range(2):
        layer = model.layers[i]
        attn = cpu(f"layers.{i}.attn")
        assert attn["max_peak_delta"] == 64 and attn["total_delta"] == 0
        assert cpu(f"layers.{i}")["max_peak_delta"] == 64
        assert cpu(f"layers.{i}.attn.qkv") is None  # a Linear allocates nothing memlord sees
        # backward: each Linear's backward makes its parameters' gradients, at the first
        # call (track_modules watches the model's gradients; the second accumulates into
        # them in place); the 64 B scratch of _Scale.backward lands in the block, not in
        # its mlp
        for name, sub in (("attn.qkv", layer.attn.qkv), ("mlp.2", layer.mlp[2])):
            assert plain(cpu(f"layers.{i}.{name} (backward)")) == {
                "total_delta": grads(sub),
                "avg_delta": grads(sub) / 2,
                "max_delta": grads(sub),
                "max_peak_delta": grads(sub),
            }
        assert plain(cpu(f"layers.{i} (backward)")) == {
            "total_delta": grads(layer),
            "avg_delta": grads(layer) / 2,
            "max_delta": grads(layer),
            "max_peak_delta": grads(layer),
        }
        mlp = cpu(f"layers.{i}.mlp (backward)")
        assert mlp["total_delta"] == mlp["max_peak_delta"] == grads(layer.mlp)
    assert cpu("TinyTransformer (backward)")["total_delta"] == grads(model) == 2 * 8640
    # the lord's own aggregate saw the same regions
    assert lord.regions()["layers.0.attn"]["count"] == 2


def test_track_modules_under_autograd_grad_of_a_leaf_input(caplog):
    """A gradient penalty: torch.autograd.grad of a tracked model's output with respect to
    its leaf input (create_graph), then backward.  autograd.grad runs no leaf's gradient
    accumulator (torch refuses to say whether it would), so the backward region of a call
    whose input is that leaf closes at the end of that pass: every region closes, nothing
    is logged.  Both passes reach the calls' outputs (the gradient's graph goes through the
    forward's), so each call has two backward regions."""
    lord = MemLord()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    x = torch.ones(1, 2, requires_grad=True)
    with caplog.at_level("DEBUG", logger="memlord"), lord.track_modules(model) as tracker:
        (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        g.sum().backward()
    assert [r.getMessage() for r in caplog.records] == []
    regs = tracker.regions()
    assert {n: regs[n]["count"] for n in regs} == {
        "Sequential": 1,
        "0": 1,
        "1": 1,
        "Sequential (backward)": 2,
        "0 (backward)": 2,
        "1 (backward)": 2,
    }


def test_track_modules_disable_removes_hooks():
    lord = MemLord()
    model = nn.Sequential(nn.Linear(4, 4))
    tracker = lord.track_modules(model, backward=False)
    model(torch.randn(2, 4))
    tracker.disable()
    tracker.disable()  # twice is fine
    model(torch.randn(2, 4))
    assert tracker.regions()["0"]["count"] == 1
    assert set(tracker.regions()) == {"Sequential", "0"}
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_track_modules_forward_error_closes_regions():
    lord = MemLord()

    class Bad(nn.Module):
        def forward(self, x):
            raise ValueError("bad")

    model = nn.Sequential(Bad())
    with lord.track_modules(model) as tracker:
        with pytest.raises(ValueError):
            model(torch.randn(2))
        with lord.region("after") as r:
            lord.allocate(u8(KiB))
    assert r.stats["cpu"]["delta"] == KiB
    assert tracker.regions()["0"]["count"] == 1
    assert tracker.regions()["Sequential"]["count"] == 1


def test_many_regions_fold_into_the_aggregate():
    lord = MemLord()
    t = u8(KiB)
    for i in range(5000):
        with lord.region("loop"):
            if i % 2:
                lord.allocate(t)
    agg = lord.regions()["loop"]
    assert agg["count"] == 5000
    assert agg["devices"]["cpu"]["total_delta"] == 2500 * KiB
    assert agg["devices"]["cpu"]["avg_delta"] == KiB / 2


def test_lifetime_deaths_on_the_regions_thread_count_as_frees():
    lord = MemLord()
    with lord.hook_into_python():
        with lord.region("scratch") as r:
            t = torch.zeros(KiB, dtype=torch.uint8)  # a factory: counted, tracked
            del t  # its death credits the free, on this thread
    assert plain(r.stats["cpu"]) == {
        "delta": 0,
        "peak": KiB,
        "peak_delta": KiB,
        "allocs": 1,
        "frees": 1,
    }


def test_reset_inside_a_region_keeps_its_numbers():
    lord = MemLord()
    with lord.region("r") as r:
        lord.allocate(u8(2 * KiB))
        lord.reset()
        lord.allocate(u8(KiB))
    assert r.stats["cpu"]["delta"] == 3 * KiB
    assert r.stats["cpu"]["peak_delta"] == 3 * KiB
    assert lord.max_memory_allocated() == KiB


def test_region_dropped_while_open_stops_counting():
    lord = MemLord()
    r = lord.region("gen")
    r.__enter__()
    assert r.open
    del r  # never exited (an abandoned generator, say): closed when collected
    with lord.region("after") as after:
        lord.allocate(u8(KiB))
    assert after.stats["cpu"]["delta"] == KiB
    assert "gen" not in lord.regions()


def test_region_repr_and_type():
    import memlord

    lord = MemLord()
    r = lord.region("x")
    assert isinstance(r, memlord.Region)
    assert "open" not in repr(r)
    with r:
        assert "open" in repr(r)
    assert not r.open
    with pytest.raises(TypeError):
        memlord.Region()


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")
def test_region_stats_per_device():
    from conftest import fake_cuda

    lord = MemLord()
    g0, g1 = fake_cuda(1024, 0), fake_cuda(512, 1)  # 4 KiB on cuda:0, 2 KiB on cuda:1
    lord.allocate(g1)
    with lord.region("multi") as r:
        lord.allocate((u8(KiB), g0))
        lord.free(g1)
    assert plain(r.stats) == {
        "cpu": {"delta": KiB, "peak": KiB, "peak_delta": KiB, "allocs": 1, "frees": 0},
        "cuda:0": {
            "delta": 4 * KiB,
            "peak": 4 * KiB,
            "peak_delta": 4 * KiB,
            "allocs": 1,
            "frees": 0,
        },
        "cuda:1": {"delta": -2 * KiB, "peak": 2 * KiB, "peak_delta": 0, "allocs": 0, "frees": 1},
    }
    assert set(lord.regions()["multi"]["devices"]) == {"cpu", "cuda:0", "cuda:1"}


def test_regions_folded_while_threads_close_them():
    lord = MemLord()
    t = u8(16)
    stop = threading.Event()

    def work() -> None:
        for _ in range(3000):
            with lord.region("w"):
                lord.allocate(t)
                lord.free(t)

    def read() -> None:
        while not stop.is_set():
            lord.regions()

    reader = threading.Thread(target=read)
    reader.start()
    workers = [threading.Thread(target=work) for _ in range(4)]
    for th in workers:
        th.start()
    for th in workers:
        th.join()
    stop.set()
    reader.join()
    agg = lord.regions()["w"]
    assert agg["count"] == 12000
    assert plain(agg["devices"]["cpu"]) == {
        "total_delta": 0,
        "avg_delta": 0,
        "max_delta": 0,
        "max_peak_delta": 16,
    }
