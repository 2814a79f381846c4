"""DEBUG lines of events lifetime tracking counts: a factory's result, a
conversion counted by a lord that tracks conversions, an ``nn.Parameter``'s storage and a
module's parameters show the tensor's dtype and shape, as explicit and hooked-conversion
lines do (docs/api.md#logs); an event of several tensors and a death show none."""

from __future__ import annotations

import re

import torch
from conftest import here

from memlord._sites import relative_path

HERE = relative_path(__file__)


def _lines(memlog, tag):
    return [ln for ln in memlog.text().splitlines() if tag in ln]


def test_factory_lines_show_dtype_and_shape(lord, memlog, monkeypatch):
    with lord.hook_into_python():
        monkeypatch.setenv("DEBUG", "1")
        a = torch.zeros(3, 5, dtype=torch.float64)
        line = here() - 1
        b = torch.empty_like(a, dtype=torch.int32)
        c = a.clone()
        monkeypatch.delenv("DEBUG")
    out = memlog.text()
    expect = f"[allocate] (factory) cpu +120 B (1 storage) float64[3, 5] at {HERE}:{line};"
    assert expect in out, out
    assert f"(factory) cpu +60 B (1 storage) int32[3, 5] at {HERE}:{line + 2};" in out, out
    assert f"(factory) cpu +120 B (1 storage) float64[3, 5] at {HERE}:{line + 3};" in out, out
    del a, b, c


def test_tracked_conversion_and_parameter_lines_show_dtype_and_shape(lord, memlog, monkeypatch):
    with lord.hook_into_python(enable_deep_autowrap=True), lord.hook_into_torch():
        t = torch.ones(4, 8)
        monkeypatch.setenv("DEBUG", "1")
        h = t.to(torch.float16)
        line = here() - 1
        layer = torch.nn.Linear(3, 2)
        monkeypatch.delenv("DEBUG")
    out = memlog.text()
    assert f"(hook) cpu +64 B (1 storage) float16[4, 8] at {HERE}:{line};" in out, out
    assert re.search(r"\(factory\) cpu \+24 B \(1 storage\) float32\[2, 3\] at ", out), out
    assert re.search(r"\(factory\) cpu \+8 B \(1 storage\) float32\[2\] at ", out), out
    del t, h, layer


def test_death_lines_name_no_tensor(lord, memlog, monkeypatch):
    with lord.hook_into_python():
        t = torch.zeros(10)
        monkeypatch.setenv("DEBUG", "1")
        del t
        torch.zeros(1)  # a safe point: the death's line is written by then
        monkeypatch.delenv("DEBUG")
    frees = _lines(memlog, "[free] (del)")
    assert frees and all("float32" not in ln for ln in frees), frees
