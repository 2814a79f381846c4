"""The device memory API on MemLord (memory_allocated & co., memory_stats,
memory_summary, drift, resets, profile_memory): exact numbers on the CPU, and CUDA
compared with torch.cuda's own numbers (marked cuda)."""

from __future__ import annotations

import pytest
import torch

from memlord import MemLord

KiB = 1024


def u8(n: int, device: str = "cpu") -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


def test_cpu_ints_exact():
    lord = MemLord()
    a, b = u8(4 * KiB), u8(KiB)
    lord.allocate(a)
    lord.allocate(b)
    lord.free(a)
    assert lord.memory_allocated() == KiB
    assert lord.memory_allocated("cpu") == KiB
    assert lord.max_memory_allocated("cpu") == 5 * KiB
    # cpu has no cache: reserved == allocated, cached 0
    assert lord.memory_reserved("cpu") == KiB
    assert lord.memory_cached("cpu") == 0
    assert lord.max_memory_cached("cpu") == 0
    assert lord.drift("cpu") is None


def test_unseen_device_is_zero():
    lord = MemLord()
    assert lord.memory_allocated("cpu") == 0
    assert lord.max_memory_allocated() == 0
    assert lord.memory_reserved("cpu") == 0


def test_memory_stats_keys_and_values():
    lord = MemLord()
    a, b = u8(3 * KiB), u8(KiB)
    lord.allocate((a, b))
    lord.free(a)
    s = lord.memory_stats("cpu")
    cats = {k: s.pop(k) for k in list(s) if k.startswith("category.")}
    # allocate() counts under "other" (tests/unit/api/test_category_readers.py covers the rest)
    assert cats["category.other.current"] == KiB and cats["category.other.peak"] == 4 * KiB
    assert s == {
        "allocated_bytes": KiB,
        "peak_allocated": 4 * KiB,
        "cached_bytes": 0,
        "reserved_bytes": KiB,
        "peak_cached": 0,
        "freed_since_gc_bytes": 3 * KiB,
        "num_allocations": 2,
        "num_frees": 1,
        "num_gc_runs": 0,
        "allocator_allocated_bytes": None,
        "active_bytes": None,
        "inactive_split_bytes": None,
        "num_alloc_retries": None,
        "num_ooms": 0,  # memlord's own count: no OOM was seen
        "cache_hit_rate": None,
        "num_cache_hits": None,
        "num_cache_misses": None,
        "pending_free_bytes": 3 * KiB,  # deprecated name of freed_since_gc_bytes
    }
    everything = {**s, **cats}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # all devices: torch's initialised CUDA devices add their allocator's figures
        # (reserved is torch.cuda.memory_reserved, cached reserved minus allocated), though
        # the ledger counted nothing there; an earlier test may have left blocks allocated
        # (cuBLAS's workspaces: the H100's shuffled suite met 65 MiB of them here)
        gpus = range(torch.cuda.device_count())
        cached = sum(torch.cuda.memory_reserved(i) - torch.cuda.memory_allocated(i) for i in gpus)
        everything["cached_bytes"] = cached
        everything["reserved_bytes"] = KiB + sum(torch.cuda.memory_reserved(i) for i in gpus)
        everything["peak_cached"] = sum(torch.cuda.max_memory_reserved(i) for i in gpus)
    assert lord.memory_stats() == everything


# the statistics the device memory API's specification lists for memory_stats() (Genesis'
# device.memory_stats(): docs/api.md#the-device-memory-api names each of memlord's keys)
SPEC_STATS = (
    "allocated_bytes",
    "cached_bytes",
    "reserved_bytes",
    "inactive_split_bytes",
    "active_bytes",
    "cache_hit_rate",
    "num_allocations",
    "num_cache_hits",
    "num_cache_misses",
    "peak_allocated",
    "peak_cached",
)


def test_memory_stats_has_every_statistic_the_specification_lists():
    lord = MemLord()
    lord.allocate(u8(KiB))
    for s in (lord.memory_stats(), lord.memory_stats("cpu"), MemLord().memory_stats("cuda")):
        missing = [k for k in SPEC_STATS if k not in s]
        assert not missing, missing
    s = lord.memory_stats("cpu")
    # cpu has no caching allocator: no request was served by a cache or missed it
    assert s["num_cache_hits"] is None and s["num_cache_misses"] is None


def test_cache_hits_and_misses_are_the_caching_allocators_requests(monkeypatch):
    """On an initialised CUDA device (torch.cuda as a one-GPU host sees it: a CPU has no
    CUDA to initialise; the cuda test below compares with the real allocator), a miss is a
    request the allocator served with a new segment (segment.all.allocated), a hit one the
    cache served (allocation.all.allocated minus those), so cache_hit_rate is
    hits / (hits + misses)."""
    from conftest import fake_cuda

    ts = {"allocation.all.allocated": 10, "segment.all.allocated": 3}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "memory_stats", lambda device=None: dict(ts))
    for name in ("memory_reserved", "memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(cuda, name, lambda device=None: 0)
    lord = MemLord(auto_gc_bytes=None)
    lord.allocate(fake_cuda(100, 0))
    s = lord.memory_stats("cuda:0")
    assert (s["num_cache_hits"], s["num_cache_misses"]) == (7, 3)
    assert s["cache_hit_rate"] == pytest.approx(7 / 10)
    assert lord.memory_stats("cpu")["num_cache_hits"] is None
    # before the allocator served any request: no hit yet, a rate of 0, so the device
    # memory-stats spec's own checkpoint (f"{stats['cache_hit_rate']:.1%} hit rate",
    # printed before anything is allocated) works as the spec shows
    ts.update({"allocation.all.allocated": 0, "segment.all.allocated": 0})
    s = lord.memory_stats("cuda:0")
    assert (s["num_cache_hits"], s["num_cache_misses"], s["cache_hit_rate"]) == (0, 0, 0.0)
    assert f"{s['cache_hit_rate']:.1%} hit rate" == "0.0% hit rate"


class BusyLord(MemLord):
    """A lord whose ledger changes right after each of its stats() reads, as when another
    thread allocates between two reads of one memory_stats() call."""

    busy = False

    def stats(self, device=None):
        out = super().stats(device)
        if self.busy:
            self.allocate(u8(KiB))  # a new tensor each time: the ledger grows
        return out


def test_memory_stats_is_one_reading_of_the_ledger():
    """memory_stats() is one reading: its figures agree with each other even when other
    threads allocate while it runs (cpu: reserved equals allocated, the categories add up
    to allocated); memory_summary()'s row and category block agree likewise."""
    lord = BusyLord(auto_gc_bytes=None)
    lord.allocate(u8(KiB))
    lord.busy = True
    s = lord.memory_stats("cpu")
    assert s["reserved_bytes"] == s["allocated_bytes"]
    assert s["category.other.current"] == s["allocated_bytes"]
    text = lord.memory_summary("cpu")
    lord.busy = False
    row = next(r for r in text.splitlines() if r.startswith("cpu "))
    other = next(r for r in text.splitlines() if r.strip().startswith("other"))
    # columns: device (10 wide), then allocated, peak, reserved (12 each); a category
    # line: two spaces, the name (24 wide), then current (12)
    allocated, reserved = row[10:22].strip(), row[34:46].strip()
    assert allocated == reserved, text
    assert other[26:38].strip() == allocated, text


def test_reset_peak_keeps_live_bytes():
    lord = MemLord()
    a, b = u8(8 * KiB), u8(KiB)
    lord.allocate((a, b))
    lord.free(a)
    assert lord.max_memory_allocated() == 9 * KiB
    lord.reset_peak_memory_stats("cpu")
    assert lord.max_memory_allocated() == KiB
    assert lord.memory_allocated() == KiB
    assert lord.stats("cpu")["cpu"]["allocs"] == 2  # counters kept
    lord.allocate(u8(2 * KiB))
    assert lord.max_memory_allocated() == 3 * KiB


def test_reset_memory_stats_zeroes_counters():
    lord = MemLord()
    a, b = u8(8 * KiB), u8(KiB)
    lord.allocate((a, b))
    lord.free(a)
    lord.reset_memory_stats()
    s = lord.memory_stats("cpu")
    assert s["allocated_bytes"] == KiB
    assert s["peak_allocated"] == KiB
    assert s["num_allocations"] == 0 and s["num_frees"] == 0 and s["num_gc_runs"] == 0
    assert s["freed_since_gc_bytes"] == 8 * KiB  # the auto-GC counter is kept
    st = lord.stats("cpu")["cpu"]
    assert st["allocated_total"] == 0 and st["freed_total"] == 0


def test_reset_of_other_device_leaves_cpu():
    lord = MemLord()
    lord.allocate(u8(8 * KiB))
    lord.free(u8(8 * KiB))
    lord.reset_peak_memory_stats("cuda:0")  # nothing there: cpu untouched
    assert lord.max_memory_allocated("cpu") == 8 * KiB


def test_memory_summary_names_each_column():
    lord = MemLord()
    lord.allocate(u8(1536))
    text = lord.memory_summary()
    assert "cpu" in text and "1.5 KiB" in text
    for col in ("allocated", "peak", "reserved", "cached", "backend alloc", "drift"):
        assert col in text
    assert "n/a" in text  # cpu: the backend does not say
    fresh = MemLord().memory_summary()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # torch's initialised CUDA devices have a row (the backend's side) before the ledger
        # counts anything on them
        rows = [r.split()[0] for r in fresh.splitlines() if r[:5] == "cuda:" and " by " not in r]
        assert rows == [f"cuda:{i}" for i in range(torch.cuda.device_count())], fresh
    else:
        assert "(no device seen)" in fresh


def test_empty_cache_cpu_is_a_noop():
    lord = MemLord()
    lord.allocate(u8(KiB))
    lord.empty_cache()
    lord.empty_cache("cpu")
    assert lord.memory_allocated() == KiB


def test_profile_memory_peak_leaves_global_peak():
    lord = MemLord()
    big = u8(16 * KiB)
    lord.allocate(big)
    lord.free(big)
    assert lord.max_memory_allocated() == 16 * KiB
    lord.allocate(u8(KiB))
    with lord.profile_memory() as prof:
        t = u8(2 * KiB)
        lord.allocate(t)
        lord.free(t)
    assert prof.peak_memory() == 3 * KiB
    assert prof.peak_memory("cpu") == 3 * KiB
    assert lord.max_memory_allocated() == 16 * KiB  # untouched
    text = prof.memory_summary()
    assert "cpu" in text and "+0 B" in text and "3 KiB" in text and "2 KiB" in text


def test_profile_memory_untouched_device_reports_live_bytes():
    lord = MemLord()
    lord.allocate(u8(KiB))
    with lord.profile_memory() as prof:
        pass
    assert prof.peak_memory() == KiB
    assert "nothing allocated" in prof.memory_summary()


def test_profile_memory_read_before_its_block_is_an_error_not_live_bytes():
    """A profile measures its block: before the block is entered there is no peak to
    report (the live bytes it gave back were no measurement of anything), so reading it
    says the profile has not started, and changes nothing."""
    lord = MemLord()
    lord.allocate(u8(KiB))
    prof = lord.profile_memory()
    for read in (prof.peak_memory, lambda: prof.peak_memory("cpu"), prof.memory_summary):
        with pytest.raises(RuntimeError, match=r"has not started.*with lord.profile_memory"):
            read()
    with prof:
        t = u8(2 * KiB)
        lord.allocate(t)
        assert prof.peak_memory() == 3 * KiB  # inside the block: the peak so far
        lord.free(t)
    assert prof.peak_memory() == 3 * KiB
    assert "2 KiB" in prof.memory_summary()


@pytest.mark.parametrize(
    "name",
    [
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "memory_cached",
        "max_memory_cached",
        "memory_stats",
        "memory_summary",
        "drift",
        "empty_cache",
        "reset_peak_memory_stats",
        "reset_memory_stats",
    ],
)
def test_bad_device_raises_and_changes_nothing(name):
    lord = MemLord()
    big = u8(4 * KiB)
    lord.allocate(big)
    lord.free(big)
    before = lord.stats()
    with pytest.raises(TypeError, match="device"):
        getattr(lord, name)(3.5)
    with pytest.raises(ValueError, match="device"):
        getattr(lord, name)("nodevice:0")
    assert lord.stats() == before


# ---- CUDA: against torch.cuda's own numbers ------------------------------------------


@pytest.mark.cuda
def test_cuda_reserved_cached_drift_against_torch():
    torch.cuda.synchronize()
    lord = MemLord(auto_gc_bytes=None)
    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    untracked = torch.empty(1 << 21, dtype=torch.uint8, device="cuda:0")
    lord.allocate(t)
    assert lord.memory_allocated("cuda:0") == 1 << 20
    assert lord.memory_reserved("cuda:0") == torch.cuda.memory_reserved(0)
    assert lord.memory_cached("cuda:0") == torch.cuda.memory_reserved(
        0
    ) - torch.cuda.memory_allocated(0)
    assert lord.max_memory_cached("cuda:0") == torch.cuda.max_memory_reserved(0)
    assert lord.drift("cuda:0") == torch.cuda.memory_allocated(0) - (1 << 20)
    assert lord.drift("cuda:0") >= untracked.nbytes
    s = lord.memory_stats("cuda:0")
    ts = torch.cuda.memory_stats(0)
    assert s["allocator_allocated_bytes"] == ts["allocated_bytes.all.current"]
    assert s["active_bytes"] == ts["active_bytes.all.current"]
    assert s["inactive_split_bytes"] == ts["inactive_split_bytes.all.current"]
    assert s["num_alloc_retries"] == ts["num_alloc_retries"]
    assert s["num_ooms"] == ts["num_ooms"]
    assert s["cache_hit_rate"] == pytest.approx(
        1 - ts["segment.all.allocated"] / ts["allocation.all.allocated"]
    )
    assert s["num_cache_misses"] == ts["segment.all.allocated"]
    assert s["num_cache_hits"] == ts["allocation.all.allocated"] - ts["segment.all.allocated"]
    assert "cuda:0" in lord.memory_summary()
    del untracked


@pytest.mark.cuda
def test_cuda_empty_cache_and_peak_reset():
    lord = MemLord(auto_gc_bytes=None)
    t = torch.empty(1 << 22, dtype=torch.uint8, device="cuda:0")
    lord.allocate(t)
    lord.free(t)
    del t
    assert lord.memory_cached("cuda:0") > 0
    lord.empty_cache("cuda:0")
    assert lord.memory_cached("cuda:0") == torch.cuda.memory_reserved(
        0
    ) - torch.cuda.memory_allocated(0)
    lord.reset_peak_memory_stats("cuda:0")
    assert lord.max_memory_allocated("cuda:0") == 0
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")
def test_per_device_selection_and_sums():
    from conftest import fake_cuda

    lord = MemLord(auto_gc_bytes=None)
    lord.allocate((u8(KiB), fake_cuda(256, 0), fake_cuda(512, 1)))  # 1 KiB, 1 KiB, 2 KiB
    assert lord.memory_allocated() == 4 * KiB
    assert lord.memory_allocated("cuda") == 3 * KiB
    assert lord.max_memory_allocated("cuda:1") == 2 * KiB
    assert lord.memory_stats("cuda")["num_allocations"] == 2
    lord.reset_peak_memory_stats("cuda:1")
    assert lord.max_memory_allocated() == 4 * KiB  # nothing was freed: peaks are live bytes
    text = lord.memory_summary()
    assert "cuda:0" in text and "cuda:1" in text and "cpu" in text
