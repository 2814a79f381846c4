"""lord.device_memory(device): system RAM for cpu, the CUDA driver for cuda:i,
a short cache for the built-in source, a user capacity source, no threads."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

from memlord import MemLord

pytestmark = pytest.mark.filterwarnings(
    "ignore:Accessing the data pointer of FakeTensor:UserWarning"
)

MiB = 1024**2


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, rest = line.split(":", 1)
            out[name] = int(rest.split()[0]) * 1024
    return out


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="needs /proc/meminfo")
def test_cpu_matches_proc_meminfo():
    lord = MemLord()
    total, used, pct = lord.device_memory("cpu")
    info = meminfo()
    assert total == info["MemTotal"]
    expected_used = info["MemTotal"] - info["MemAvailable"]
    # memory moves between the two reads: allow 256 MiB or 5% of RAM
    assert abs(used - expected_used) <= max(256 * MiB, total // 20)
    assert 0 < used <= total
    assert pct == pytest.approx(used * 100 / total)
    assert 0.0 < pct <= 100.0


def test_cpu_spellings_agree():
    lord = MemLord()
    a = lord.device_memory("cpu")
    assert lord.device_memory(torch.device("cpu"))[0] == a[0]
    assert lord.device_memory("cpu:0")[0] == a[0]
    assert lord.device_memory(device="cpu")[0] == a[0]


@pytest.mark.parametrize(
    "arg,exc,fragment",
    [
        ("cuda", ValueError, "index"),
        (torch.device("cuda"), ValueError, "index"),
        ("bogus", ValueError, "device"),
        ("cuda:-1", ValueError, "device"),
        (None, TypeError, "device"),
        (0, TypeError, "device"),
    ],
)
def test_bad_device_argument(arg, exc, fragment):
    with pytest.raises(exc, match=fragment):
        MemLord().device_memory(arg)


def test_wrong_type_is_not_told_none_would_do():
    """device_memory() needs one device: its TypeError for a wrong type must not list None
    among the accepted values, as the queries' message does (repro r16)."""
    lord = MemLord()
    for arg in (0, 1.5, ["cpu"]):
        with pytest.raises(TypeError, match="argument 'device'") as err:
            lord.device_memory(arg)
        assert "None" not in str(err.value) and "'cpu'" in str(err.value), err.value
        assert type(arg).__name__ in str(err.value)


def test_bad_call_shapes():
    lord = MemLord()
    with pytest.raises(TypeError):
        lord.device_memory()
    with pytest.raises(TypeError):
        lord.device_memory("cpu", "cpu")
    with pytest.raises(TypeError, match="dev"):
        lord.device_memory(dev="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_unreadable_device_gives_nones():
    lord = MemLord()
    assert lord.device_memory("cuda:0") == (None, None, None)
    assert lord.device_memory("cuda:7") == (None, None, None)
    assert lord.device_memory("meta:0") == (None, None, None)


def test_built_in_read_is_cached_briefly():
    lord = MemLord()
    # two reads in a row share the cached answer (retry: a read may straddle the 50 ms)
    assert any(lord.device_memory("cpu") is lord.device_memory("cpu") for _ in range(5))
    first = lord.device_memory("cpu")
    time.sleep(0.08)
    assert lord.device_memory("cpu") is not first


def test_capacity_source_override_and_restore():
    calls = []

    def source(device):
        calls.append(device)
        return {"cpu": (1000, 250), "cuda:1": (4000, 4000)}.get(device)

    lord = MemLord()
    builtin_total = lord.device_memory("cpu")[0]
    assert lord.capacity_source is None
    lord.set_capacity_source(source)
    assert lord.capacity_source is source
    assert lord.device_memory("cpu") == (1000, 250, 25.0)
    assert lord.device_memory("cpu") == (1000, 250, 25.0)
    assert lord.device_memory("cuda:1") == (4000, 4000, 100.0)
    assert lord.device_memory(torch.device("cuda", 2)) == (None, None, None)
    assert calls == ["cpu", "cpu", "cuda:1", "cuda:2"]  # called every time: no cache
    lord.set_capacity_source(None)
    assert lord.capacity_source is None
    assert lord.device_memory("cpu")[0] == builtin_total
    assert len(calls) == 4


def test_capacity_source_rejects_non_callables():
    lord = MemLord()

    def source(device):
        return (10, 1)

    lord.set_capacity_source(source)
    for bad in (5, "cpu", (10, 1)):
        with pytest.raises(TypeError, match="source"):
            lord.set_capacity_source(bad)
        assert lord.capacity_source is source
    assert lord.device_memory("cpu") == (10, 1, 10.0)


def test_capacity_source_errors_propagate():
    lord = MemLord()

    def raising(device):
        raise KeyError(device)

    lord.set_capacity_source(raising)
    with pytest.raises(KeyError):
        lord.device_memory("cpu")
    for bad, exc in [
        ([10, 1], TypeError),
        ((10,), TypeError),
        ((10, 1, 2), TypeError),
        ((10.0, 1), TypeError),
        ((10, True), TypeError),
        ((0, 0), ValueError),
        ((10, 11), ValueError),
        ((-10, 1), ValueError),
    ]:
        lord.set_capacity_source(lambda d, bad=bad: bad)
        with pytest.raises(exc, match="capacity source"):
            lord.device_memory("cpu")


def test_capacity_source_is_released():
    import gc
    import weakref

    class Source:
        def __call__(self, device):
            return None

    src = Source()
    lord = MemLord()
    lord.set_capacity_source(src)
    src.lord = lord  # a cycle through the lord
    ref = weakref.ref(src)
    del src, lord
    gc.collect()
    assert ref() is None


def test_no_new_threads():
    lord = MemLord(auto_gc_strategy={(0, 101): {"metric": "max", "threshold": {"bytes": 1}}})
    threads, tasks = threading.active_count(), task_count()
    for _ in range(3):
        for _ in range(2000):
            lord.device_memory("cpu")
        time.sleep(0.08)  # past the cache, so reads happen again
    for _ in range(100):
        lord.allocate(torch.empty(16))  # policy check on cpu
    assert threading.active_count() == threads
    assert task_count() == tasks


def test_device_memory_is_cheap_when_cached():
    """Loose in-test bound (the benchmark holds the 2x target)."""
    lord = MemLord()
    dm, noop = lord.device_memory, lord._bench_noop
    dm("cpu")

    def best(fn):
        times = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(2000):
                fn("cpu")
            times.append(time.perf_counter_ns() - t0)
        return min(times)

    best(dm), best(noop)  # warm
    assert best(dm) <= 5 * best(noop)


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_matches_mem_get_info():
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    lord = MemLord()
    total, used, pct = lord.device_memory("cuda:0")
    free_t, total_t = torch.cuda.mem_get_info(0)
    assert total == total_t
    assert abs(used - (total_t - free_t)) <= 64 * MiB
    assert pct == pytest.approx(used * 100 / total)
    assert lord.device_memory(torch.device("cuda", 0))[0] == total


@pytest.mark.cuda
def test_band_driven_gc_on_cuda(memlog, monkeypatch):
    monkeypatch.delenv("DEBUG", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    torch.empty(1, device="cuda:0")
    current = torch.cuda.current_device()
    lord = MemLord(
        auto_gc_strategy={(0, 101): {"metric": "freed", "threshold": {"bytes": 32 * MiB}}}
    )
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    lord.allocate(t)
    assert lord.stats("cuda:0")["cuda:0"]["gc_runs"] == 0
    reserved = torch.cuda.memory_reserved(0)
    lord.free(t)
    del t
    assert lord.stats("cuda:0")["cuda:0"]["gc_runs"] == 1
    assert torch.cuda.memory_reserved(0) <= reserved
    assert torch.cuda.current_device() == current
    out = memlog.text()
    m = re.search(r"\[auto_gc\] cuda:0 band=\[0, 101\) used=([\d.]+)% metric=freed", out)
    assert m is not None, out
    assert 0.0 < float(m.group(1)) <= 100.0


@pytest.mark.cuda
def test_percent_band_on_cuda_uses_driver_capacity():
    torch.empty(1, device="cuda:0")
    total = MemLord().device_memory("cuda:0")[0]
    lord = MemLord(
        auto_gc_strategy={(0, 101): {"metric": "allocated", "threshold": {"percent": 0.01}}}
    )
    need = int(total * 0.0001) + 1
    small = torch.empty(need // 4, dtype=torch.uint8, device="cuda:0")
    lord.allocate(small)
    assert lord.stats("cuda:0")["cuda:0"]["gc_runs"] == 0
    big = torch.empty(need, dtype=torch.uint8, device="cuda:0")
    lord.allocate(big)
    assert lord.stats("cuda:0")["cuda:0"]["gc_runs"] == 1
