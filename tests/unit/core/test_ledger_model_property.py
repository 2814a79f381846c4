"""Property-based: random allocate/free/reset/set_auto_gc/queries against a Python model.

The model is the contract of allocate()/free() in a few lines: per call, storages dedup by
(pointer, nbytes, device) (conftest.expected_storages); allocated clamps at zero; freed and
freed_total add the full bytes; after a free, every device the call touched that has a cache
(not cpu) and whose freed reached the threshold resets freed and counts a GC run; reset clears
every counter and site and keeps the threshold. Fake-cuda tensors on cuda:0/cuda:1 run the GC
paths on the CPU.
"""

import numpy as np
import torch
from conftest import (
    ZERO_STATS,
    counters,
    cuda_device_count,
    expected_storages,
    fake_cuda,
    here,
    scaled,
)
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from memlord import MemLord, format_bytes
from memlord._sites import relative_path

HERE = relative_path(__file__)  # sites are shown relative to the working directory

CACHED_TYPES = {"cuda", "xpu", "mps", "npu"}


def _auto_value():
    n = cuda_device_count()
    if n == 0:
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) // 3


AUTO = _auto_value()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.out = nn.Linear(4, 20, bias=False)
        self.out.weight = self.emb.weight
        self.shared = nn.Linear(4, 4)
        self.again = self.shared
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _pool():
    t1 = torch.empty(10)
    t2 = torch.empty(33, dtype=torch.float64)
    a = np.zeros(50, dtype=np.uint8)
    m = Tied()
    return [
        t1,
        t1[2:],
        t2,
        t2.view(3, 11),
        nn.Parameter(torch.empty(7)),
        m,
        m.emb.weight,
        m.shared,
        a,
        a[5:],
        a[::3],
        np.zeros(3, dtype=np.float64),
        torch.empty(0),
        torch.empty(5, device="meta"),
        torch.eye(4).to_sparse_csr(),
        torch.eye(3).to_sparse(),
        fake_cuda(100, 0),
        fake_cuda(37, 0),
        fake_cuda(250, 1),
        fake_cuda(11, 1),
        fake_cuda(11, 1, dtype=torch.float64),
    ]


POOL = _pool()
SELECTIONS = [
    None,
    "cpu",
    "cuda",
    "cuda:0",
    "cuda:1",
    "cuda:2",
    "xpu",
    torch.device("cuda", 1),
    torch.device("cpu"),
    torch.device("cuda"),
]

objects = st.tuples(
    st.lists(st.integers(0, len(POOL) - 1), min_size=0, max_size=4),
    st.sampled_from(["bare", "tuple", "list"]),
)
thresholds = st.one_of(
    st.none(), st.just(0), st.integers(1, 3000), st.integers(1, 2**63 - 1), st.just("auto")
)


def _build(spec):
    idxs, shape = spec
    items = [POOL[i] for i in idxs]
    if shape == "bare" and items:
        return items[0]
    return tuple(items) if shape == "tuple" else items


def _selected(dev, sel):
    if sel is None:
        return True
    s = str(sel)
    if ":" in s:
        return dev == s
    return dev.split(":")[0] == s


class LordMachine(RuleBasedStateMachine):
    @initialize(threshold=thresholds)
    def start(self, threshold):
        self.lord = MemLord(auto_gc_bytes=threshold)
        self.threshold = self._model_threshold(threshold)
        self.model = {}
        self.alloc_site = {}  # device -> cumulative bytes at ALLOC_LINE
        self.free_site = {}

    @staticmethod
    def _model_threshold(value):
        if value == "auto":
            return AUTO
        return value or None

    def _dev(self, dev):
        return self.model.setdefault(dev, dict(ZERO_STATS))

    @rule(spec=objects)
    def allocate(self, spec):
        obj = _build(spec)
        self.lord.allocate(obj)
        for dev, n in expected_storages(obj):
            d = self._dev(dev)
            d["allocated"] += n
            d["allocated_total"] += n
            d["allocs"] += 1
            d["peak_allocated"] = max(d["peak_allocated"], d["allocated"])
            self.alloc_site[dev] = self.alloc_site.get(dev, 0) + n

    @rule(spec=objects)
    def free(self, spec):
        obj = _build(spec)
        self.lord.free(obj)
        touched = set()
        for dev, n in expected_storages(obj):
            d = self._dev(dev)
            d["allocated"] = max(0, d["allocated"] - n)
            d["freed"] += n
            d["freed_total"] += n
            d["frees"] += 1
            self.free_site[dev] = self.free_site.get(dev, 0) + n
            touched.add(dev)
        for dev in touched:
            d = self.model[dev]
            if (
                dev.split(":")[0] in CACHED_TYPES
                and self.threshold is not None
                and d["freed"] >= self.threshold
            ):
                d["freed"] = 0
                d["gc_runs"] += 1
                event(f"auto-GC on {dev}")

    @rule(spec=objects)
    def allocate_then_free_same(self, spec):
        self.allocate(spec)
        self.free(spec)

    @rule()
    def reset(self):
        self.lord.reset()
        self.model.clear()
        self.alloc_site.clear()
        self.free_site.clear()

    @rule(value=thresholds)
    def set_auto_gc(self, value):
        self.lord.set_auto_gc(value)
        self.threshold = self._model_threshold(value)

    @rule(sel=st.sampled_from(SELECTIONS))
    def query(self, sel):
        devs = [d for d in self.model if _selected(d, sel)]
        want_a = sum(self.model[d]["allocated"] for d in devs)
        want_f = sum(self.model[d]["freed"] for d in devs)
        assert self.lord.allocated(sel) == (want_a, format_bytes(want_a))
        assert self.lord.freed(sel) == (want_f, format_bytes(want_f))
        got = {d: counters(entry) for d, entry in self.lord.stats(sel).items()}
        for d in set(got) | set(devs):
            assert got.get(d, ZERO_STATS) == self.model.get(d, ZERO_STATS), d
        assert all(_selected(d, sel) for d in got)
        for top, table, line in (
            (self.lord.top_alloc_site(sel), self.alloc_site, ALLOC_LINE),
            (self.lord.top_free_site(sel), self.free_site, FREE_LINE),
        ):
            cands = {d: n for d, n in table.items() if _selected(d, sel) and n > 0}
            if not cands:
                assert top is None
                continue
            dev, site, nbytes = top
            assert nbytes == max(cands.values())
            assert cands.get(str(dev)) == nbytes
            assert site == f"{HERE}:{line}"

    @precondition(lambda self: hasattr(self, "lord"))
    @invariant()
    def counters_match_model(self):
        got = {d: counters(entry) for d, entry in self.lord.stats().items()}
        for d in set(got) | set(self.model):
            assert got.get(d, ZERO_STATS) == self.model.get(d, ZERO_STATS), d
        total_a = sum(s["allocated"] for s in self.model.values())
        assert self.lord.allocated() == (total_a, format_bytes(total_a))
        assert self.lord.auto_gc_bytes == self.threshold


# The call lines the sites must name (the rules call lord.allocate/free on these lines).
def _line_of(stmt):
    with open(__file__) as f:
        return next(i for i, ln in enumerate(f, 1) if ln.strip() == stmt)


ALLOC_LINE = _line_of("self.lord.allocate(obj)")
FREE_LINE = _line_of("self.lord.free(obj)")
assert here() > FREE_LINE > ALLOC_LINE > 0

LordMachine.TestCase.settings = settings(
    max_examples=scaled(150),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLordMachine = LordMachine.TestCase
