"""The post-mortem names the cuBLAS/cuBLASLt workspaces among the allocator's untracked
blocks (issue 28): torch keeps one per handle (or device) and stream through the caching
allocator, no tensor's storage, 32 MiB each on Hopper. They are named by their size,
computed from the environment and the device's compute capability as torch's
``CublasHandlePool.cpp`` computes it; nothing is read from torch's handles, nothing is
allocated or released.

The sizes follow the format cuBLAS documents for ``CUBLAS_WORKSPACE_CONFIG``
(``:SIZE:COUNT`` pairs, SIZE in KiB) and torch's reproducibility notes (``:4096:8`` and
``:16:8``). On a GPU, tests/unit/platform/test_oom_cuda.py and test_post_mortem_cuda.py
hold the named bytes to what ``torch._C._cuda_clearCublasWorkspaces()`` releases."""

from __future__ import annotations

import pytest

from memlord._bytes import format_bytes
from memlord.report._postmortem import attribute_blocks, library_workspace_sizes, render_html

MIB = 1 << 20


CUBLAS, LT, BOTH = "cuBLAS workspace", "cuBLASLt workspace", "cuBLAS/cuBLASLt workspace"


@pytest.mark.parametrize(
    ("major", "env", "want"),
    [
        # Hopper and Blackwell: 32 MiB; cuBLASLt's own (older torch): 1 MiB
        (9, {}, {32 * MIB: CUBLAS, MIB: LT}),
        (10, {}, {32 * MIB: CUBLAS, MIB: LT}),
        (12, {}, {32 * MIB: CUBLAS, MIB: LT}),
        # before Hopper, ":4096:2:16:8": two 4 MiB buffers and eight of 16 KiB
        (8, {}, {8 * MIB + 128 * 1024: CUBLAS, MIB: LT}),
        (9, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, {32 * MIB: CUBLAS, MIB: LT}),
        (9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {128 * 1024: CUBLAS, MIB: LT}),
        # a value torch cannot parse: its default
        (9, {"CUBLAS_WORKSPACE_CONFIG": "lots"}, {32 * MIB: CUBLAS, MIB: LT}),
        (8, {"CUBLASLT_WORKSPACE_SIZE": "4096"}, {8 * MIB + 128 * 1024: CUBLAS, 4 * MIB: LT}),
        (9, {"CUBLASLT_WORKSPACE_SIZE": "32768"}, {32 * MIB: BOTH}),
        (9, {"CUBLASLT_WORKSPACE_SIZE": "many"}, {32 * MIB: CUBLAS, MIB: LT}),
        # cuBLASLt told to share cuBLAS's workspace: no size of its own
        (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, {32 * MIB: CUBLAS}),
        (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, {32 * MIB: CUBLAS, MIB: LT}),
        (None, {}, {}),  # no device: nothing named
    ],
)
def test_workspace_sizes_as_torch_computes_them(major, env, want):
    assert library_workspace_sizes(major, env) == want


def _seg(address, blocks):
    return {
        "device": 0,
        "address": address,
        "total_size": sum(b["size"] for b in blocks),
        "stream": 0,
        "segment_type": "large",
        "blocks": blocks,
    }


def _blk(size, address, requested=None, state="active_allocated"):
    return {
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "address": address,
        "frames": [],
    }


def test_untracked_blocks_of_a_workspace_size_are_named_and_counted_apart():
    base = 0x7F00_0000_0000
    ws = 32 * MIB
    segments = [
        _seg(base, [_blk(ws, base)]),  # a workspace
        _seg(base + ws, [_blk(ws, base + ws)]),  # another (a second handle or stream)
        _seg(base + 2 * ws, [_blk(ws, base + 2 * ws, requested=ws - 100)]),  # a tensor's
        _seg(base + 3 * ws, [_blk(4 * MIB, base + 3 * ws)]),  # tracked
        _seg(base + 4 * ws, [_blk(ws, base + 4 * ws, state="inactive")]),  # cached, free
        _seg(base + 5 * ws, [_blk(2 * MIB, base + 5 * ws)]),  # nobody's
        _seg(base + 6 * ws, [_blk(MIB, base + 6 * ws)]),  # cuBLASLt's
    ]
    storages = [(base + 3 * ws, 4 * MIB, "0.weight")]
    got = attribute_blocks(
        segments, storages, 0, top=10, library_sizes=library_workspace_sizes(9, {})
    )
    allocated = 3 * ws + 4 * MIB + 2 * MIB + MIB
    assert got["allocated"] == allocated
    assert got["attributed"] == 4 * MIB
    assert got["untracked"] == allocated - 4 * MIB  # unchanged meaning: not a tracked storage
    lib = got["library_workspaces"]
    assert lib["bytes"] == 2 * ws + MIB
    assert lib["by_name"] == {
        CUBLAS: {"bytes": 2 * ws, "blocks": 2},
        LT: {"bytes": MIB, "blocks": 1},
    }
    assert lib["sizes"] == {str(MIB): LT, str(ws): CUBLAS}
    assert got["explained"] == 4 * MIB + 2 * ws + MIB
    assert got["explained_fraction"] == pytest.approx((4 * MIB + 2 * ws + MIB) / allocated)
    assert got["unexplained"] == ws + 2 * MIB
    named = {b["address"]: b["library"] for b in got["untracked_blocks"]}
    assert named == {
        base: CUBLAS,
        base + ws: CUBLAS,
        base + 2 * ws: None,  # asked for fewer bytes: a tensor's block, rounded up
        base + 5 * ws: None,
        base + 6 * ws: LT,
    }
    # without sizes (ROCm, an unknown device) nothing is named
    plain = attribute_blocks(segments, storages, 0)
    assert plain["library_workspaces"]["bytes"] == 0 and plain["unexplained"] == plain["untracked"]


def test_the_page_shows_the_workspaces_and_what_is_left():
    base = 0x7F00_0000_0000
    ws = 32 * MIB
    seg = attribute_blocks(
        [_seg(base, [_blk(ws, base)]), _seg(base + ws, [_blk(MIB, base + ws)])],
        [],
        0,
        library_sizes={ws: BOTH},
    )
    doc = {
        "schema": "memlord.oom/1",
        "time": "2026-11-26T00:00:00+00:00",
        "pid": 1,
        "host": "h",
        "request": {"device": "cuda:0", "bytes": 1},
        "devices": {"cuda:0": {"segments": seg}},
        "notes": [],
    }
    page = render_html(doc)
    assert "of which cuBLAS/cuBLASLt workspace (by size)" in page
    # memlord's byte formatter, as everywhere in the report
    assert f"{format_bytes(ws)} in 1 blocks" in page
    assert f"<th>unexplained</th><td>{format_bytes(MIB)}</td>" in page
