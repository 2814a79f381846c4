"""Leaks of op outputs are found (hook_into_python(ops=True)).

A training loop that keeps every step's output (``history.append(out.detach())``) or a
forward hook that caches outputs holds memory that no factory made: only the operators did.
With ops=True, ``growth()`` names the line whose memory grows at every step, and
``leak_check()`` lists what was born in its block and is still alive, with that line.
The sizes are checked against torch's own storage sizes.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

from memlord import MemLord

HERE = os.path.basename(__file__)


def line_of(marker: str) -> str:
    src, first = inspect.getsourcelines(inspect.getmodule(line_of))
    for i, text in enumerate(src):
        if marker in text and "line_of(" not in text:
            return f"{HERE}:{max(first, 1) + i}"
    raise AssertionError(marker)


@pytest.fixture
def lord():
    lord = MemLord()
    hooks = lord.hook_into_python(ops=True)
    try:
        yield lord
    finally:
        hooks.disable()


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return model, torch.randn(8, 32)


def site_text(site: str | None) -> str:
    return os.path.basename(site.rsplit(":", 1)[0]) + ":" + site.rsplit(":", 1)[1] if site else ""


def test_growth_names_the_line_of_an_output_kept_every_step(lord):
    model, x = model_and_data()
    history = []
    for _ in range(6):
        out = model(x)  # LEAK-HISTORY
        history.append(out.detach())
        out.sum().backward()
        lord.step()
    grown = lord.growth(3)
    assert grown, "no growing site found"
    top = grown[0]
    assert site_text(top["site"]) == line_of("# LEAK-HISTORY")
    per_step = history[0].untyped_storage().nbytes()
    steps = top["bytes"]
    assert [steps[i + 1] - steps[i] for i in range(3)] == [per_step] * 3


def test_leak_check_names_a_forward_hook_that_caches_outputs(lord):
    model, x = model_and_data()
    cache = []
    model[0].register_forward_hook(lambda m, args, out: cache.append(out))
    model(x)  # warm-up: nothing of it is kept but the first cached output
    with lord.leak_check() as check:
        for _ in range(3):
            y = model(x)  # LEAK-HOOK
            del y
    leaked = check.leaked
    cached = {t.untyped_storage().data_ptr() for t in cache[1:]}
    assert len(cached) == 3
    by_site = check.by_site()
    site, info = next(iter(by_site.items()))
    assert site_text(site) == line_of("# LEAK-HOOK")
    assert info["bytes"] == sum(t.untyped_storage().nbytes() for t in cache[1:])
    assert info["count"] == 3
    assert {e["category"] for e in leaked} == {"activation"}


def test_without_ops_the_same_leak_is_invisible():
    """The reason for ops=True: factories and conversions never see an op's output."""
    lord = MemLord()
    with lord.hook_into_python():
        model, x = model_and_data()
        cache = []
        with lord.leak_check() as check:
            for _ in range(3):
                cache.append(model(x))
        assert check.leaked == []
