"""A region's bytes by category follow a storage's category as it changes inside the
region, as the ledger's do: a gradient is born a temporary of backward and becomes a
gradient when accumulated, a factory's tensor becomes a parameter when wrapped in
nn.Parameter. The region said "temporary" for the gradients its own step made (and so
did the pytest plugin's categories, which are the test region's). The reference is the
tensors' own storages."""

from __future__ import annotations

import torch
from torch import nn

from memlord import MemLord


def _nbytes(*tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_a_steps_gradients_are_gradients_in_its_region():
    torch.manual_seed(0)
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        model = nn.Linear(256, 256)
        x = torch.randn(8, 256)
        with lord.region("step"):
            model(x).sum().backward()
    cats = lord.regions()["step"]["devices"]["cpu"]["categories"]
    grads = _nbytes(model.weight.grad, model.bias.grad)
    assert cats["gradient"]["total_delta"] == grads
    assert cats["gradient"]["max_peak_delta"] == grads
    assert cats.get("temporary", {}).get("total_delta", 0) == 0


def test_a_parameter_made_in_a_region_is_a_parameter_there():
    lord = MemLord()
    with lord.hook_into_python(ops=True), lord.region("build"):
        model = nn.Linear(64, 32)
    cats = lord.regions()["build"]["devices"]["cpu"]["categories"]
    assert cats["parameter"]["total_delta"] == _nbytes(model.weight, model.bias)
    assert sum(c["total_delta"] for c in cats.values()) == _nbytes(model.weight, model.bias)


def test_the_split_at_the_peak_adds_up_to_the_peak_and_names_the_gradients():
    """The region object's own stats (what the pytest plugin reads): the categories at
    the region's peak add up to its peak delta, the gradients accumulated by then among
    them (the peak is reached while backward makes the first layer's weight gradient, a
    temporary until it is accumulated: the last layer's are gradients by then)."""
    torch.manual_seed(0)
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
        with lord.region("step") as region:
            model(torch.randn(4, 128)).sum().backward()
            last = _nbytes(model[2].weight.grad, model[2].bias.grad)
            grads = _nbytes(*(p.grad for p in model.parameters()))
    st = region.stats["cpu"]
    at_peak = {k: v["at_peak"] for k, v in st["categories"].items() if v["at_peak"]}
    assert sum(at_peak.values()) == st["peak_delta"]
    assert last <= at_peak["gradient"] <= grads
    assert st["categories"]["gradient"]["delta"] == grads
