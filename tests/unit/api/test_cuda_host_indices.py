"""A counted CUDA index that torch does not have on this host.

memlord counts by device key; a tensor may report an index that the host lacks (a
stand-in, a model built on a larger host, FakeTensorMode), and auto-GC is decided per
index. torch's allocator functions raise for such an index ("Invalid device argument"),
and ``torch.cuda.device(i)`` raises "invalid device ordinal". memlord's device memory API
answers None (or the ledger) for it and auto-GC releases nothing for it: never an error.

On a CPU-only machine torch.cuda cannot be initialised, so the first group runs against
``one_gpu_host``: torch.cuda's state functions answer as on a host with one initialised
GPU, and its allocator functions raise for any other index exactly as torch does. That
stands in only for what no CPU has; the ``cuda`` tests below do the same on a real GPU.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import fake_cuda

from memlord import MemLord

ALLOCATOR_KEYS = (
    "allocator_allocated_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "num_alloc_retries",
)


class OneGpuHost:
    """torch.cuda as a host with one initialised GPU sees it: what was called, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def _check(self, name: str, index) -> None:
        self.calls.append((name, index))
        if index not in (None, 0):  # memlord passes ints; None is the current device
            raise RuntimeError("Invalid device argument : did you call init?")

    def install(self, mp: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        mp.setattr(cuda, "is_available", lambda: True)
        mp.setattr(cuda, "is_initialized", lambda: True)
        mp.setattr(cuda, "device_count", lambda: 1)
        for name, value in (
            ("memory_reserved", 8192),
            ("memory_allocated", 4096),
            ("max_memory_reserved", 16384),
        ):
            mp.setattr(cuda, name, self._answer(name, value))
        mp.setattr(cuda, "memory_stats", self._answer("memory_stats", {}))
        mp.setattr(cuda, "reset_peak_memory_stats", self._answer("reset_peak", None))
        mp.setattr(cuda, "reset_accumulated_memory_stats", self._answer("reset_acc", None))
        mp.setattr(cuda, "empty_cache", lambda: self.calls.append(("empty_cache", None)))

        host = self

        class device:  # torch.cuda.device(i) for an index the host lacks
            def __init__(self, index):
                host.calls.append(("device", index))
                if index != 0:
                    raise RuntimeError("CUDA error: invalid device ordinal")

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        mp.setattr(cuda, "device", device)

    def _answer(self, name, value):
        def fn(device=None):
            self._check(name, device)
            return value

        return fn


@pytest.fixture
def one_gpu_host(monkeypatch):
    host = OneGpuHost()
    host.install(monkeypatch)
    return host


@pytest.fixture
def unraisable(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_memory_api_answers_for_an_index_torch_lacks(one_gpu_host):
    lord = MemLord(auto_gc_bytes=None)
    t = fake_cuda(100, 1)  # 400 B counted on cuda:1, which this host does not have
    lord.allocate(t)
    stats = lord.memory_stats("cuda")  # cuda:0 (torch's) and cuda:1 (counted)
    assert stats["allocated_bytes"] == 400
    assert all(stats[k] is None for k in ALLOCATOR_KEYS)
    one = lord.memory_stats("cuda:1")
    assert one["allocated_bytes"] == 400 and one["cache_hit_rate"] is None
    assert all(one[k] is None for k in ALLOCATOR_KEYS)
    # cuda:1 has no allocator here: its reserved bytes are the ledger's, its cache 0
    assert lord.memory_reserved("cuda:1") == 400
    assert lord.memory_cached("cuda:1") == 0
    assert lord.max_memory_cached("cuda:1") == 0
    assert lord.drift("cuda:1") is None and lord.drift("cuda") is None
    assert "cuda:1" in lord.memory_summary()
    lord.reset_peak_memory_stats("cuda")
    lord.reset_memory_stats("cuda")
    lord.empty_cache("cuda:1")
    # torch was asked about cuda:0 only, and nothing entered a device
    assert {index for _, index in one_gpu_host.calls} <= {0, None}
    assert ("device", 1) not in one_gpu_host.calls
    # the index torch has still answers from torch's allocator
    assert lord.memory_reserved("cuda:0") == 8192
    assert lord.drift("cuda:0") == 4096
    lord.free(t)


def test_auto_gc_for_an_index_torch_lacks_releases_nothing(one_gpu_host, unraisable):
    lord = MemLord(auto_gc_bytes=1)
    t = fake_cuda(100, 1)
    lord.allocate(t)
    lord.free(t)  # crosses the threshold on cuda:1
    assert lord.stats()["cuda:1"]["gc_runs"] == 1
    assert unraisable == []  # nothing raised inside the core
    assert ("device", 1) not in one_gpu_host.calls
    assert ("empty_cache", None) not in one_gpu_host.calls


def test_auto_gc_for_torchs_index_releases_every_device_without_entering_one(
    one_gpu_host, unraisable, caplog
):
    lord = MemLord(auto_gc_bytes=1)
    t = fake_cuda(100, 0)
    lord.allocate(t)
    with caplog.at_level(logging.INFO, logger="memlord"):
        lord.free(t)
    # the record names the device that triggered the run and says every device's cache went
    (line,) = [r.getMessage() for r in caplog.records if "[auto_gc]" in r.getMessage()]
    assert line.startswith("[auto_gc] cuda:0 ")
    assert line.endswith(
        "cache released of every CUDA device (torch.cuda.empty_cache; triggered by cuda:0)"
    )
    assert lord.stats()["cuda:0"]["gc_runs"] == 1
    assert unraisable == []
    # empty_cache releases every device's cache; entering a device first changes nothing
    assert one_gpu_host.calls.count(("empty_cache", None)) == 1
    assert not any(name == "device" for name, _ in one_gpu_host.calls)


# --------------------------------------------------------------------------- a real GPU


@pytest.mark.cuda
def test_real_gpu_memory_api_for_an_index_torch_lacks(unraisable):
    torch.empty(1, device="cuda")  # initialise
    missing = torch.cuda.device_count()
    lord = MemLord(auto_gc_bytes=1)
    t = fake_cuda(100, missing)
    lord.allocate(t)
    stats = lord.memory_stats("cuda")
    assert stats["allocated_bytes"] >= 400
    assert all(stats[k] is None for k in ALLOCATOR_KEYS)
    assert lord.drift(f"cuda:{missing}") is None
    assert lord.memory_reserved(f"cuda:{missing}") == 400
    before = torch.cuda.current_device()
    lord.free(t)  # auto-GC for the missing index: releases nothing, raises nothing
    assert lord.stats()[f"cuda:{missing}"]["gc_runs"] == 1
    assert torch.cuda.current_device() == before
    assert unraisable == []
