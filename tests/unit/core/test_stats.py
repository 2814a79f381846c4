"""stats(), peaks, reset() and repr()."""

import numpy as np
import torch
from conftest import ZERO_STATS, _cuda_like, counters, fake_cuda
from torch import nn

from memlord import MemLord


def test_empty_lord_has_no_devices(lord):
    assert lord.stats() == {}
    assert lord.allocated() == (0, "0 B")
    assert lord.freed() == (0, "0 B")


def test_only_devices_seen_appear(lord):
    lord.allocate(torch.empty(1))
    assert list(lord.stats()) == ["cpu"]
    lord.free(fake_cuda(1, 1))
    assert set(lord.stats()) == {"cpu", "cuda:1"}


def test_full_counter_walkthrough(lord):
    a, b = torch.empty(25), torch.empty(50)  # 100 B, 200 B
    lord.allocate(a)
    lord.allocate(b)
    assert counters(lord.stats()["cpu"]) == dict(
        ZERO_STATS, allocated=300, allocated_total=300, peak_allocated=300, allocs=2
    )
    lord.free(b)
    lord.allocate(a)
    assert counters(lord.stats()["cpu"]) == dict(
        ZERO_STATS,
        allocated=200,
        freed=200,
        allocated_total=400,
        freed_total=200,
        peak_allocated=300,
        allocs=3,
        frees=1,
    )
    lord.allocate([a, b])
    assert lord.stats()["cpu"]["peak_allocated"] == 500
    lord.free([a, b, a[1:]])
    lord.free([a, b])  # clamps at zero
    assert counters(lord.stats()["cpu"]) == dict(
        ZERO_STATS,
        allocated=0,
        freed=800,
        allocated_total=700,
        freed_total=800,
        peak_allocated=500,
        allocs=5,
        frees=5,
    )
    # what allocate() counts is "other" (it knows no more of it)
    assert lord.stats()["cpu"]["category_peaks"]["other"] == 500


def test_peak_is_per_device(lord):
    lord.allocate(fake_cuda(100, 0))
    lord.allocate(torch.empty(10))
    lord.free(fake_cuda(100, 0))
    lord.allocate(fake_cuda(50, 1))
    s = lord.stats()
    assert s["cuda:0"]["peak_allocated"] == 400 and s["cuda:0"]["allocated"] == 0
    assert s["cuda:1"]["peak_allocated"] == 200
    assert s["cpu"]["peak_allocated"] == 40


def test_allocs_and_frees_count_storages(lord):
    m = nn.Linear(3, 3)  # two storages
    lord.allocate([m, np.zeros(3), np.zeros(3)[1:]])  # two more distinct: arrays differ
    assert lord.stats()["cpu"]["allocs"] == 4
    lord.free(m)
    assert lord.stats()["cpu"]["frees"] == 2


def test_stats_returns_fresh_copies(lord):
    lord.allocate(torch.empty(4))
    s = lord.stats()
    s["cpu"]["allocated"] = 999
    s["bogus"] = {}
    assert lord.stats()["cpu"]["allocated"] == 16
    assert "bogus" not in lord.stats()


def test_reset_clears_everything_but_threshold():
    lord = MemLord(auto_gc_bytes=1 << 30)
    t = torch.empty(100)
    lord.allocate([t, fake_cuda(3, 0)])
    lord.free(t)
    lord.reset()
    assert lord.allocated() == (0, "0 B")
    assert lord.freed() == (0, "0 B")
    for dev, st in lord.stats().items():
        assert st == ZERO_STATS, dev
    assert lord.top_alloc_site() is None and lord.top_free_site() is None
    assert lord.auto_gc_bytes == 1 << 30
    # counting starts over, peaks included
    lord.allocate(torch.empty(1))
    assert lord.stats()["cpu"]["peak_allocated"] == 4
    assert lord.stats()["cpu"]["allocated_total"] == 4


def test_reset_on_empty_lord(lord):
    lord.reset()
    lord.reset()
    assert lord.allocated() == (0, "0 B")


def test_lords_are_independent():
    a, b = MemLord(auto_gc_bytes=None), MemLord(auto_gc_bytes=None)
    a.allocate(torch.empty(10))
    assert b.stats() == {}
    b.free(torch.empty(10))
    assert a.freed() == (0, "0 B")
    assert a.allocated()[0] == 40


def test_repr_names_each_device(lord):
    r0 = repr(lord)
    assert isinstance(r0, str) and r0
    lord.allocate([torch.empty(256), fake_cuda(3, 0), fake_cuda(4, 1)])
    r = repr(lord)
    for dev in ("cpu", "cuda:0", "cuda:1"):
        assert dev in r
    assert "1 KiB" in r  # the cpu row shows human-readable bytes
    assert len(r.splitlines()) <= 12
    assert str(lord) == r or "cpu" in str(lord)


def test_many_devices(lord):
    for i in range(16):
        lord.allocate(fake_cuda(i + 1, i))
    s = lord.stats()
    assert len(s) == 16
    assert lord.allocated("cuda")[0] == 4 * sum(range(1, 17))
    assert lord.allocated("cuda:15")[0] == 64


def test_big_numbers(lord, tmp_path):
    # a 1 TiB storage over a sparse file (no memory behind it): counters are 64-bit
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(2**40)
    mapped = np.memmap(path, dtype=np.uint8, mode="r+", shape=(2**40,))
    big = _cuda_like(torch.from_numpy(mapped), 0)
    lord.allocate(big)
    lord.allocate(big)
    assert lord.allocated("cuda:0") == (2**41, "2 TiB")
    del big, mapped


def test_bench_noop_accepts_anything_and_changes_nothing(lord):
    lord.allocate(torch.empty(3))
    before = lord.stats()
    assert lord._bench_noop() is None
    assert lord._bench_noop(1, "x", torch.empty(2), key=None) is None
    assert lord.stats() == before
