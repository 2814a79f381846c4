"""Device selection for allocated()/freed()/stats()/top_*_site(): every form, and malformed ones."""

import pytest
import torch
from conftest import fake_cuda

from memlord import format_bytes


@pytest.fixture
def populated(lord):
    """cpu 20 B, cuda:0 400 B, cuda:1 4000 B allocated; then 8 B of cpu, 40 B of cuda:1 freed."""
    lord.allocate([torch.empty(5), fake_cuda(100, 0), fake_cuda(1000, 1)])
    lord.free(torch.empty(2))
    lord.free(fake_cuda(10, 1))
    return lord


ALLOCATED = {"cpu": 12, "cuda:0": 400, "cuda:1": 3960}
FREED = {"cpu": 8, "cuda:0": 0, "cuda:1": 40}

SELECTIONS = [
    (None, ["cpu", "cuda:0", "cuda:1"]),
    ("cpu", ["cpu"]),
    (torch.device("cpu"), ["cpu"]),
    ("cuda", ["cuda:0", "cuda:1"]),
    (torch.device("cuda"), ["cuda:0", "cuda:1"]),
    ("cuda:0", ["cuda:0"]),
    ("cuda:1", ["cuda:1"]),
    (torch.device("cuda", 1), ["cuda:1"]),
    (torch.device("cuda:0"), ["cuda:0"]),
    ("cuda:7", []),  # a valid device this lord never saw
    (torch.device("cuda", 3), []),
    ("xpu", []),  # a valid type this lord never saw
    ("mps", []),
]


def _ids(sel):
    return repr(sel)


@pytest.mark.parametrize(("sel", "devs"), SELECTIONS, ids=[_ids(s) for s, _ in SELECTIONS])
def test_allocated_and_freed_by_selection(populated, sel, devs):
    want_a = sum(ALLOCATED[d] for d in devs)
    want_f = sum(FREED[d] for d in devs)
    assert populated.allocated(sel) == (want_a, format_bytes(want_a))
    assert populated.freed(sel) == (want_f, format_bytes(want_f))


@pytest.mark.parametrize(("sel", "devs"), SELECTIONS, ids=[_ids(s) for s, _ in SELECTIONS])
def test_stats_by_selection(populated, sel, devs):
    st = populated.stats(sel)
    assert sorted(st) == sorted(devs)
    for d in devs:
        assert st[d]["allocated"] == ALLOCATED[d]
        assert st[d]["freed"] == FREED[d]


def test_device_keyword_argument(populated):
    assert populated.allocated(device="cuda:1")[0] == 3960
    assert populated.freed(device=torch.device("cpu"))[0] == 8
    assert set(populated.stats(device="cuda")) == {"cuda:0", "cuda:1"}


def test_no_argument_equals_none(populated):
    assert populated.allocated() == populated.allocated(None)
    assert populated.freed() == populated.freed(None)
    assert populated.stats() == populated.stats(None)


def test_results_are_tuple_of_int_and_str(populated):
    for sel in (None, "cpu", "cuda", "cuda:1"):
        for r in (populated.allocated(sel), populated.freed(sel)):
            assert type(r) is tuple and len(r) == 2
            assert type(r[0]) is int and type(r[1]) is str


MALFORMED_TYPE = [0, 1, 1.0, ["cpu"], ("cuda", 0), b"cpu", {"cpu": 1}, object()]


def _stable_id(value) -> str:
    """A parametrize id that is the same in every process (pytest-xdist's workers must
    collect the same ids): the repr, except for a bare object, whose repr is an address."""
    return "object()" if type(value) is object else repr(value)


MALFORMED_VALUE = ["gpu", "cuda:", "cuda:-1", "cuda:x", "", "cuda:1:2", "cpu:", ":0", "cuda 0"]
QUERIES = ["allocated", "freed", "stats", "top_alloc_site", "top_free_site"]


@pytest.mark.parametrize("method", QUERIES)
@pytest.mark.parametrize("bad", MALFORMED_TYPE, ids=_stable_id)
def test_malformed_device_type_raises_type_error(populated, method, bad):
    before = populated.stats()
    with pytest.raises(TypeError, match="device"):
        getattr(populated, method)(bad)
    assert populated.stats() == before


@pytest.mark.parametrize("method", QUERIES)
@pytest.mark.parametrize("bad", MALFORMED_VALUE, ids=repr)
def test_malformed_device_string_raises_value_error(populated, method, bad):
    before = populated.stats()
    with pytest.raises(ValueError, match="device"):
        getattr(populated, method)(bad)
    assert populated.stats() == before


@pytest.mark.parametrize("method", [*QUERIES, "device_memory", "memory_stats"])
@pytest.mark.parametrize("index", [200, 253, 254])
def test_torch_device_whose_index_torch_wrapped_names_the_argument(populated, method, index):
    """torch keeps a device index in 8 bits: torch.device("cuda", 200) has index -56 (its
    repr says 65480). memlord refuses it as it refuses "cuda:-1", with a ValueError that
    names the argument and the index (it said "memlord: device index -56 out of range")."""
    dev = torch.device("cuda", index)
    if dev.index is None or 0 <= dev.index <= 253:
        pytest.skip(f"this torch keeps torch.device('cuda', {index}) as index {dev.index}")
    before = populated.stats()
    expected = f"argument 'device': expected a device index from 0 to 253, got index {dev.index}"
    with pytest.raises(ValueError, match=expected):
        getattr(populated, method)(dev)
    assert populated.stats() == before


def test_selection_sees_new_devices_as_they_appear(lord):
    assert lord.allocated("cuda") == (0, "0 B")
    lord.allocate(fake_cuda(5, 2))
    assert lord.allocated("cuda") == (20, "20 B")
    assert lord.allocated("cuda:2") == (20, "20 B")
    assert lord.allocated("cuda:1") == (0, "0 B")
