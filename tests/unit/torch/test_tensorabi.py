"""Tensor metadata read through torch's stable C ABI agrees with torch's Python getters.

The hooks size every conversion result and every factory tensor in storage bytes: the bytes
of the storage a tensor views (sparse components summed, 0 for meta).  When the checks at
import pass, memlord reads them through libtorch's AOTInductor shim
(``aoti_torch_get_storage_size`` and friends) for objects whose type is exactly
``torch.Tensor`` or ``nn.Parameter``; anything else goes through ``Tensor.untyped_storage()``
and the storage's getters.
These tests compare the two ways on every kind of tensor the hooks can meet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import fake_cuda, fake_mode_cuda
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memlord import MemLord, _core

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


class Plain(torch.Tensor):
    """A subclass that overrides nothing: still read through the getters."""


def _sparse_bytes(t: torch.Tensor) -> int:
    if t.layout == torch.sparse_coo:
        parts = (t._indices(), t._values())
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = (t.crow_indices(), t.col_indices(), t.values())
    else:
        parts = (t.ccol_indices(), t.row_indices(), t.values())
    return sum({id(s): s.nbytes() for s in (p.untyped_storage() for p in parts)}.values())


def _cases():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype/beta/deprecation notes of some layouts
        base = torch.randn(4, 6)
        yield "float32", base, 96
        for dtype in (
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.complex64,
            torch.complex128,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.uint16,
            torch.uint32,
            torch.uint64,
            torch.chalf,
        ):
            t = torch.zeros(5, 3, dtype=dtype)
            yield str(dtype), t, 15 * t.element_size()
        yield "0-d", torch.tensor(2.5), 4
        yield "empty", torch.empty(0, 7), 0
        yield "transposed", base.t(), 96
        yield "slice", base[1:3, ::2], 96  # the storage it views
        # views with no elements: no data pointer of their own, their storage has one
        yield "empty view at the end", torch.empty(3)[3:], 12
        yield "empty view at the start", torch.empty(3)[0:0], 12
        yield "expanded", torch.randn(1, 3).expand(100, 3), 12  # storage bytes, not numel
        yield "channels_last", torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), 480
        yield "meta", torch.empty(1000, device="meta"), 0
        yield "parameter", nn.Parameter(torch.randn(7)), 28
        yield "subclass", torch.randn(3).as_subclass(Plain), 12
        yield "cuda-like:1", fake_cuda(10, 1), 40
        yield "zero strides", torch.empty_strided((10**6,), (0,)), 4
        with FakeTensorMode():
            fake = torch.empty(10, device=fake_mode_cuda())
        yield "fake cuda", fake, 0  # a meta storage
        yield "qint8", torch.quantize_per_tensor(torch.randn(10), 0.1, 0, torch.qint8), 10
        yield "mkldnn", torch.randn(4, 4).to_mkldnn(), 64
        yield "nested", torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), 20
        dense = torch.tensor([[0.0, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]] * 2)
        for name, sparse in (
            ("coo", dense.to_sparse()),
            ("csr", dense.to_sparse_csr()),
            ("csc", dense.to_sparse_csc()),
            ("bsr", dense.to_sparse_bsr((2, 2))),
            ("bsc", dense.to_sparse_bsc((2, 2))),
        ):
            yield name, sparse, _sparse_bytes(sparse)


CASES = list(_cases())


@pytest.fixture
def restore_abi():
    previous = _core._tensor_abi()["enabled"]
    yield
    _core._tensor_abi(previous)


def test_valid_on_this_torch():
    info = _core._tensor_abi()
    assert set(info) == {"valid", "enabled"}
    if sys.platform.startswith("linux") and TORCH_VERSION >= (2, 10):
        # torch 2.10 made the at::Tensor the first field of a torch.Tensor object, and the
        # shim has every function memlord needs since before then: the checks must pass.
        assert info["valid"] is True
        assert info["enabled"] is (os.environ.get("MEMLORD_TENSOR_ABI") != "0")


@pytest.mark.parametrize(("name", "t", "nbytes"), CASES, ids=[c[0] for c in CASES])
def test_both_ways_agree(name, t, nbytes, restore_abi):
    device = str(t.device)
    _core._tensor_abi(True)
    fast = _core._tensor_meta(t)
    _core._tensor_abi(False)
    slow = _core._tensor_meta(t)
    assert fast == slow, name
    assert fast[:2] == (device, nbytes), name
    if t.layout == torch.strided and t.device.type != "meta" and not t.is_nested and nbytes:
        # the base of the storage, for views too (an offset into it is undone)
        assert fast[2] == t.untyped_storage().data_ptr(), name


def test_switch_and_bad_input(restore_abi):
    valid = _core._tensor_abi()["valid"]
    assert _core._tensor_abi(False) == {"valid": valid, "enabled": False}
    assert _core._tensor_abi(True) == {"valid": valid, "enabled": valid}
    assert _core._tensor_abi(None)["enabled"] is valid
    before = _core._tensor_abi()
    with pytest.raises(TypeError, match="enabled must be a bool or None"):
        _core._tensor_abi(1)
    with pytest.raises(TypeError, match="at most 1 argument"):
        _core._tensor_abi(True, False)
    assert _core._tensor_abi() == before
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        _core._tensor_meta([1, 2])


def test_environment_switches_it_off():
    code = "from memlord import _core; print(_core._tensor_abi()['enabled'])"
    env = dict(os.environ, MEMLORD_TENSOR_ABI="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
    assert out.stderr == ""


def test_hooks_count_the_same_both_ways(restore_abi):
    """A realistic mix of casts, moves to meta and factories: identical ledgers."""
    results = []
    for on in (True, False):
        _core._tensor_abi(on)
        lord = MemLord(auto_gc_bytes=None)
        keep = []
        with lord.hook_into_torch(), lord.hook_into_python():
            x = torch.randn(128, 64)
            keep += [x.half(), x.double(), x.to(torch.bfloat16), x.to("meta")]
            p = nn.Parameter(torch.zeros(33, dtype=torch.int16), requires_grad=False)
            keep += [p.float(), torch.ones(17, dtype=torch.int8).clone()]
            del keep[1]
        results.append((lord.stats(), lord.allocated("cpu"), lord.freed("cpu")))
    assert results[0] == results[1]
    assert results[0][1][0] > 0


@pytest.mark.parametrize(
    ("env", "expected"), [("1", "in use"), ("0", "off (MEMLORD_TENSOR_ABI=0)")]
)
def test_info_reports_the_reader(env, expected):
    if not _core._tensor_abi()["valid"]:
        expected = "not usable"
    out = subprocess.run(
        [sys.executable, "-m", "memlord", "--info"],
        env=dict(os.environ, MEMLORD_TENSOR_ABI=env),
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"tensor metadata through torch's stable C ABI: {expected}\n" in out.stdout
    assert out.stderr == ""
