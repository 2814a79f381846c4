"""Regions by category: a region's stats, lord.regions() and track_modules() split each
device's delta and peak by the category the events carried, checked against the bytes
torch says the tensors made inside hold."""

from __future__ import annotations

import torch

from memlord import CATEGORIES, MemLord


def nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))


def check_sums(dev_stats: dict) -> None:
    cats = dev_stats["categories"]
    assert set(cats) <= set(CATEGORIES)
    assert sum(c["delta"] for c in cats.values()) == dev_stats["delta"]
    assert sum(c["at_peak"] for c in cats.values()) == dev_stats["peak_delta"]
    assert all(c["peak_delta"] >= max(c["delta"], 0) for c in cats.values())


def test_a_forward_region_counts_its_outputs_as_activations():
    lord = MemLord()
    m, x = model(), torch.randn(32, 64)
    with lord.hook_into_python(ops=True), torch.no_grad():
        with lord.region("forward") as r:
            out = m(x)
        cpu = r.stats["cpu"]
        check_sums(cpu)
        assert list(cpu["categories"]) == ["activation"]
        act = cpu["categories"]["activation"]
        assert act["delta"] == nbytes(out) == 32 * 16 * 4
        # the highest point: the first Linear's output and the ReLU's, both 32x128 floats
        hidden = torch.empty(32, 128)
        assert act["peak_delta"] == act["at_peak"] == 2 * nbytes(hidden) == cpu["peak_delta"]


def test_a_backward_region_counts_the_gradients_it_makes_as_gradients():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        m, x = model(), torch.randn(32, 64)
        loss = m(x).square().sum()
        with lord.region("backward") as r:
            loss.backward()
        cpu = r.stats["cpu"]
        check_sums(cpu)
        # made in backward as temporaries, the gradients among them become gradients when
        # accumulated, in the region as in the ledger; the other temporaries died inside
        grads = sum(nbytes(p.grad) for p in m.parameters())
        assert cpu["categories"]["gradient"]["delta"] == grads
        assert cpu["categories"]["temporary"]["delta"] == 0
        assert lord.stats("cpu")["cpu"]["categories"]["gradient"] == grads
        # what backward freed is the activations the forward saved
        assert cpu["categories"]["activation"]["delta"] < 0


def test_allocate_in_a_region_is_other_and_untouched_categories_are_absent():
    lord = MemLord()
    a = torch.empty(1000, dtype=torch.uint8)
    with lord.region("r") as r:
        lord.allocate(a)
        lord.free(a)
    assert r.stats["cpu"]["categories"] == {
        "other": {"delta": 0, "peak_delta": 1000, "at_peak": 1000}
    }
    with lord.region("empty") as r2:
        pass
    assert r2.stats == {}


def test_regions_and_track_modules_aggregate_by_category():
    lord = MemLord()
    m, x = model(), torch.randn(32, 64)
    with lord.hook_into_python(ops=True), lord.track_modules(m) as tracker:
        for _ in range(2):
            with lord.region("step"):
                out = m(x)
                out.sum().backward()
                m.zero_grad()
    mods = tracker.regions()
    first = mods["0"]["devices"]["cpu"]["categories"]
    # the first Linear's forward leaves its output (saved for the ReLU's backward)
    assert first == {
        "activation": {
            "total_delta": 2 * nbytes(torch.empty(32, 128)),
            "max_delta": nbytes(torch.empty(32, 128)),
            "max_peak_delta": nbytes(torch.empty(32, 128)),
        }
    }
    assert mods["2"]["devices"]["cpu"]["categories"]["activation"]["max_delta"] == nbytes(out)
    bwd = mods["Sequential (backward)"]["devices"]["cpu"]
    assert "temporary" in bwd["categories"]
    step = lord.regions()["step"]["devices"]["cpu"]
    assert sum(c["total_delta"] for c in step["categories"].values()) == step["total_delta"]
