"""The memory API's readers of the ledger by category: memory_stats()'s
``category.<name>.*`` keys, memory_summary()'s per-category block and
lord.categories(), on a real training step with ``ops=True``, checked against what torch
itself says the parameters, gradients and optimizer state hold."""

from __future__ import annotations

import pytest
import torch

import memlord
from memlord import CATEGORIES, MemLord


def storages_bytes(tensors) -> int:
    """Bytes of the distinct storages of tensors, from torch (the outside reference)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.fixture
def trained():
    """A lord with ops=True over two AdamW steps of a small model, stopped right after
    the backward of a third (gradients live)."""
    torch.manual_seed(0)
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16)
        )
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(32, 64)
        for _ in range(2):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        model(x).square().sum().backward()
        yield lord, model, opt, x


def test_categories_match_torch_and_add_up(trained):
    lord, model, opt, x = trained
    params = list(model.parameters())
    cats = lord.categories("cpu")
    assert list(cats) == list(CATEGORIES)
    assert cats["parameter"]["current"] == storages_bytes(params)
    assert cats["gradient"]["current"] == storages_bytes(p.grad for p in params)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert cats["optimizer_state"]["current"] == storages_bytes(state)
    assert cats["input"]["current"] + cats["other"]["current"] + cats["activation"][
        "current"
    ] >= storages_bytes([x])
    # they add up to the device's live bytes, and at the peak to its peak
    st = lord.stats("cpu")["cpu"]
    assert sum(c["current"] for c in cats.values()) == st["allocated"]
    assert sum(c["at_peak"] for c in cats.values()) == st["peak_allocated"]
    assert all(c["peak"] >= max(c["current"], c["at_peak"]) for c in cats.values())
    # AdamW's step made temporaries of optimizer state beyond its exp_avg/exp_avg_sq
    assert cats["optimizer_state"]["peak"] >= cats["optimizer_state"]["current"]


def test_memory_stats_category_keys_are_stats(trained):
    lord = trained[0]
    ms = lord.memory_stats("cpu")
    st = lord.stats("cpu")["cpu"]
    for cat in CATEGORIES:
        assert ms[f"category.{cat}.current"] == st["categories"][cat]
        assert ms[f"category.{cat}.peak"] == st["category_peaks"][cat]
        assert ms[f"category.{cat}.at_peak"] == st["peak_categories"][cat]
    assert sum(ms[f"category.{c}.current"] for c in CATEGORIES) == ms["allocated_bytes"]
    assert sum(ms[f"category.{c}.at_peak"] for c in CATEGORIES) == ms["peak_allocated"]
    # every selector answers the same keys; a device never seen answers zeros
    none = lord.memory_stats("cuda:0")
    assert all(none[f"category.{c}.{k}"] == 0 for c in CATEGORIES for k in ("current", "peak"))
    assert lord.categories("cuda:0") == {
        c: {"current": 0, "peak": 0, "at_peak": 0} for c in CATEGORIES
    }


def test_memory_summary_has_a_category_block_without_zero_rows(trained):
    lord = trained[0]
    text = lord.memory_summary("cpu")
    block = text.split("cpu by category", 1)[1].splitlines()
    names = [line.split()[0] for line in block[1:] if line.startswith("  ")]
    cats = lord.categories("cpu")
    assert names == [c for c in CATEGORIES if any(cats[c].values())]
    assert {"parameter", "gradient", "optimizer_state"} <= set(names)
    assert "loaded" not in names and "buffer" not in names
    row = next(line for line in block if line.split()[:1] == ["parameter"])
    assert memlord.format_bytes(cats["parameter"]["current"]) in row


def test_no_category_block_when_nothing_is_counted():
    assert "by category" not in MemLord().memory_summary()


def test_categories_rejects_a_bad_device_naming_it():
    lord = MemLord()
    with pytest.raises(TypeError, match="argument 'device'"):
        lord.categories(3.5)
    with pytest.raises(ValueError, match="device"):
        lord.categories("nodevice:0")


def test_profile_memory_summary_splits_the_block_by_category():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        m, x = torch.nn.Linear(64, 64), torch.randn(8, 64)
        with lord.profile_memory() as p:
            y = m(x).relu()
    cats = p.stats["cpu"]["categories"]
    assert list(cats) == ["activation"]
    assert cats["activation"]["delta"] == y.untyped_storage().nbytes()
    block = p.memory_summary().split("cpu by category", 1)[1].splitlines()
    assert block[1].split()[0] == "activation"
    assert ("+" + memlord.format_bytes(y.nbytes)) in block[1]
