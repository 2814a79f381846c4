"""A table of wrong inputs across the public API.

Each one raises a clear TypeError or ValueError whose message names the argument (and, for
objects given to allocate/free, the offending type and its position), and leaves every counter,
hotspot and the threshold exactly as they were.
"""

import re

import numpy as np
import pytest
import torch
from conftest import fake_cuda, snapshot
from torch import nn

from memlord import MemLord, format_bytes

T = torch.empty(10)
A = np.zeros(10)
M = nn.Linear(2, 2)


class NotATensor:
    pass


# (id, callable(lord), exception, regexes the message must match)
CASES = [
    # --- allocate / free: unsupported objects, bare and inside sequences
    ("alloc-str", lambda L: L.allocate("x"), TypeError, [r"\bstr\b", r"\bobj\b"]),
    ("alloc-None", lambda L: L.allocate(None), TypeError, [r"NoneType", r"\bobj\b"]),
    ("alloc-int", lambda L: L.allocate(5), TypeError, [r"\bint\b", r"\bobj\b"]),
    ("alloc-float", lambda L: L.allocate(3.5), TypeError, [r"\bfloat\b", r"\bobj\b"]),
    ("alloc-dict", lambda L: L.allocate({"w": T}), TypeError, [r"\bdict\b", r"\bobj\b"]),
    ("alloc-set", lambda L: L.allocate({1}), TypeError, [r"\bset\b", r"\bobj\b"]),
    ("alloc-object", lambda L: L.allocate(NotATensor()), TypeError, [r"NotATensor", r"\bobj\b"]),
    ("alloc-type", lambda L: L.allocate(int), TypeError, [r"\btype\b", r"\bobj\b"]),
    ("alloc-gen", lambda L: L.allocate(x for x in [T]), TypeError, [r"generator", r"\bobj\b"]),
    ("alloc-storage", lambda L: L.allocate(T.untyped_storage()), TypeError, [r"Storage", r"obj"]),
    ("alloc-tuple-str", lambda L: L.allocate((T, M, "x")), TypeError, [r"\bstr\b", r"obj\[2\]"]),
    ("alloc-tuple-None", lambda L: L.allocate((None, T)), TypeError, [r"NoneType", r"obj\[0\]"]),
    ("alloc-list-nested", lambda L: L.allocate([T, [A]]), TypeError, [r"\blist\b", r"obj\[1\]"]),
    ("alloc-nested-tuple", lambda L: L.allocate([A, M, (T,)]), TypeError, [r"tuple", r"obj\[2\]"]),
    ("alloc-list-dict", lambda L: L.allocate([T, A, {}]), TypeError, [r"\bdict\b", r"obj\[2\]"]),
    ("free-str", lambda L: L.free("x"), TypeError, [r"\bstr\b", r"\bobj\b"]),
    ("free-None", lambda L: L.free(None), TypeError, [r"NoneType", r"\bobj\b"]),
    ("free-bytes", lambda L: L.free(b"\0" * 8), TypeError, [r"\bbytes\b", r"\bobj\b"]),
    ("free-tuple-int", lambda L: L.free((T, 1)), TypeError, [r"\bint\b", r"obj\[1\]"]),
    ("free-nested", lambda L: L.free([(T, A)]), TypeError, [r"tuple", r"obj\[0\]"]),
    ("free-fake-then-bad", lambda L: L.free([fake_cuda(9, 1), 0.5]), TypeError, [r"obj\[1\]"]),
    # --- thresholds
    ("gc-bool", lambda L: L.set_auto_gc(True), TypeError, [r"auto_gc_bytes"]),
    ("gc-float", lambda L: L.set_auto_gc(1.5), TypeError, [r"auto_gc_bytes"]),
    ("gc-nan", lambda L: L.set_auto_gc(float("nan")), TypeError, [r"auto_gc_bytes"]),
    ("gc-str", lambda L: L.set_auto_gc("big"), ValueError, [r"auto_gc_bytes"]),
    ("gc-empty-str", lambda L: L.set_auto_gc(""), ValueError, [r"auto_gc_bytes"]),
    ("gc-bytes", lambda L: L.set_auto_gc(b"auto"), TypeError, [r"auto_gc_bytes"]),
    ("gc-list", lambda L: L.set_auto_gc([1]), TypeError, [r"auto_gc_bytes"]),
    ("gc-negative", lambda L: L.set_auto_gc(-1), ValueError, [r"auto_gc_bytes"]),
    ("gc-2**63", lambda L: L.set_auto_gc(2**63), ValueError, [r"auto_gc_bytes"]),
    ("gc-huge", lambda L: L.set_auto_gc(10**30), ValueError, [r"auto_gc_bytes"]),
    ("ctor-bool", lambda L: MemLord(auto_gc_bytes=False), TypeError, [r"auto_gc_bytes"]),
    ("ctor-float", lambda L: MemLord(auto_gc_bytes=1e9), TypeError, [r"auto_gc_bytes"]),
    ("ctor-str", lambda L: MemLord(auto_gc_bytes="AUTO!"), ValueError, [r"auto_gc_bytes"]),
    ("ctor-negative", lambda L: MemLord(auto_gc_bytes=-4096), ValueError, [r"auto_gc_bytes"]),
    ("ctor-huge", lambda L: MemLord(auto_gc_bytes=2**64), ValueError, [r"auto_gc_bytes"]),
    ("ctor-tensor", lambda L: MemLord(auto_gc_bytes=T), TypeError, [r"auto_gc_bytes"]),
    # --- device selections
    ("dev-int", lambda L: L.allocated(0), TypeError, [r"device"]),
    ("dev-float", lambda L: L.freed(1.0), TypeError, [r"device"]),
    ("dev-list", lambda L: L.stats(["cuda", 0]), TypeError, [r"device"]),
    ("dev-bytes", lambda L: L.top_alloc_site(b"cuda"), TypeError, [r"device"]),
    ("dev-tensor", lambda L: L.top_free_site(T), TypeError, [r"device"]),
    ("dev-gpu", lambda L: L.allocated("gpu"), ValueError, [r"device"]),
    ("dev-colon", lambda L: L.allocated("cuda:"), ValueError, [r"device"]),
    ("dev-negative", lambda L: L.freed("cuda:-1"), ValueError, [r"device"]),
    ("dev-letter", lambda L: L.stats("cuda:x"), ValueError, [r"device"]),
    ("dev-empty", lambda L: L.top_alloc_site(""), ValueError, [r"device"]),
    ("dev-two-colons", lambda L: L.top_free_site("cuda:1:2"), ValueError, [r"device"]),
    ("dev-kw-gpu", lambda L: L.allocated(device="gpu:0"), ValueError, [r"device"]),
    # --- format_bytes
    ("fmt-negative", lambda L: format_bytes(-1), ValueError, []),
    ("fmt-float", lambda L: format_bytes(1.0), TypeError, []),
    ("fmt-None", lambda L: format_bytes(None), TypeError, []),
    ("fmt-str", lambda L: format_bytes("1024"), TypeError, []),
]


@pytest.fixture
def busy_lord():
    """A lord with state on three devices, hotspots and a threshold, for 'unchanged' checks."""
    lord = MemLord(auto_gc_bytes=1 << 40)
    lord.allocate([T, A, M, fake_cuda(100, 0), fake_cuda(200, 1)])
    lord.free([T, fake_cuda(50, 1)])
    return lord


def test_table_is_big_enough():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "call", "exc", "patterns"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(busy_lord, name, call, exc, patterns):
    before = snapshot(busy_lord)
    with pytest.raises(exc) as info:
        call(busy_lord)
    assert type(info.value) is exc
    msg = str(info.value)
    assert msg
    for pat in patterns:
        assert re.search(pat, msg), f"{pat!r} not in {msg!r}"
    assert snapshot(busy_lord) == before


def test_wrong_argument_counts():
    lord = MemLord(auto_gc_bytes=None)
    for call in (
        lambda: lord.allocate(),
        lambda: lord.allocate(T, T),
        lambda: lord.free(),
        lambda: lord.set_auto_gc(),
        lambda: lord.allocated("cpu", "cpu"),
        lambda: lord.reset(1),
        lambda: MemLord(1, 2),
        lambda: MemLord(bogus=1),
        lambda: format_bytes(),
    ):
        with pytest.raises(TypeError):
            call()
    assert lord.stats() == {}


def test_bad_input_after_good_input_in_one_call_applies_nothing():
    lord = MemLord(auto_gc_bytes=4)  # a fake-cuda free would GC if anything were applied
    good = [fake_cuda(10, 0), T, A, M]
    with pytest.raises(TypeError):
        lord.free([*good, object()])
    with pytest.raises(TypeError):
        lord.allocate((*good, "tail"))
    assert lord.stats() == {}
    assert lord.top_alloc_site() is None and lord.top_free_site() is None


def test_bad_input_prints_nothing_under_debug(monkeypatch, capsys):
    lord = MemLord(auto_gc_bytes=None)
    monkeypatch.setenv("DEBUG", "1")
    with pytest.raises(TypeError):
        lord.allocate((T, "x"))
    with pytest.raises(TypeError):
        lord.free([T, None])
    out = capsys.readouterr().out
    for tag in ("[allocate]", "[free]", "[allocate-summary]", "[free-summary]"):
        assert tag not in out
