"""The reuse plan's interval assignment against brute force on small random cases.

For storages of one size, the plan needs exactly as many buffers as the most storages
alive at once (the optimum: no plan can use fewer), which a brute-force search over
every assignment confirms; for mixed sizes every plan is valid (no two members of a
buffer overlap in time, a buffer holds its largest member) and never worse than giving
each storage its own buffer, and never better than the brute-force optimum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memlord import LifetimeAnalyzer
from memlord._lifetimes import assign_buffers, max_overlap

intervals = st.lists(st.tuples(st.integers(0, 12), st.integers(1, 6)), min_size=1, max_size=7).map(
    lambda xs: [(b, b + d) for b, d in xs]
)


def _overlap(a, b) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _partitions(items):
    """Every set partition of ``items``."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def _best(spans, sizes) -> tuple[int, int]:
    """(fewest buffers, fewest bytes) over every valid grouping, by brute force."""
    fewest, least = len(spans), sum(sizes)
    for part in _partitions(list(range(len(spans)))):
        if all(
            not _overlap(spans[i], spans[j])
            for group in part
            for i, j in itertools.combinations(group, 2)
        ):
            fewest = min(fewest, len(part))
            least = min(least, sum(max(sizes[i] for i in g) for g in part))
    return fewest, least


def _valid(spans, sizes, buffer_of, buffer_bytes) -> None:
    for i, j in itertools.combinations(range(len(spans)), 2):
        if buffer_of[i] == buffer_of[j]:
            assert not _overlap(spans[i], spans[j]), (i, j)
    for i, b in enumerate(buffer_of):
        assert buffer_bytes[b] >= sizes[i]
    for b in range(len(buffer_bytes)):  # a buffer is its largest member, no more
        assert buffer_bytes[b] == max(sizes[i] for i in range(len(spans)) if buffer_of[i] == b)


@settings(max_examples=200, deadline=None)
@given(intervals)
def test_same_size_plan_is_the_maximum_overlap_and_optimal(spans):
    birth = np.array([s[0] for s in spans], np.int64)
    death = np.array([s[1] for s in spans], np.int64)
    size = np.full(len(spans), 64, np.int64)
    buffer_of, buffer_bytes = assign_buffers(birth, death, size)
    _valid(spans, size.tolist(), buffer_of.tolist(), buffer_bytes.tolist())
    fewest, least = _best(spans, size.tolist())
    assert len(buffer_bytes) == max_overlap(birth, death) == fewest
    assert int(buffer_bytes.sum()) == least


@settings(max_examples=200, deadline=None)
@given(intervals, st.data())
def test_mixed_size_plan_is_valid_and_bounded(spans, data):
    sizes = data.draw(
        st.lists(st.sampled_from([16, 48, 64, 256]), min_size=len(spans), max_size=len(spans))
    )
    birth = np.array([s[0] for s in spans], np.int64)
    death = np.array([s[1] for s in spans], np.int64)
    buffer_of, buffer_bytes = assign_buffers(birth, death, np.array(sizes, np.int64))
    _valid(spans, sizes, buffer_of.tolist(), buffer_bytes.tolist())
    _fewest, least = _best(spans, sizes)
    assert least <= int(buffer_bytes.sum()) <= sum(sizes)
    assert len(buffer_bytes) >= max_overlap(birth, death)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 4)), min_size=1, max_size=6))
def test_analyzer_plan_of_recorded_usage_is_the_maximum_overlap(uses):
    """Same-size tensors used over step ranges: the analyzer's plan equals the most alive
    at once among the storages that begin and end inside the window."""
    a = LifetimeAnalyzer()
    tensors = [torch.empty(16) for _ in uses]
    last = max(b + d for b, d in uses) + 1
    for step in range(last + 1):
        live = [t for t, (b, d) in zip(tensors, uses, strict=True) if b <= step <= b + d]
        a.record_usage(step, live)
    plan = a.compute_reuse_plan()
    spans = [(b, b + d + 1) for b, d in uses]
    birth = np.array([s[0] for s in spans], np.int64)
    death = np.array([s[1] for s in spans], np.int64)
    assert plan.bytes_before == 64 * len(uses)
    assert len(plan) == max_overlap(birth, death)
    assert plan.bytes_after == 64 * max_overlap(birth, death)
    groups = plan.groups()
    assert sorted(i for g in groups for i in g) == list(range(len(uses)))


def test_empty_and_touching_lifetimes():
    buffer_of, sizes = assign_buffers(*(np.empty(0, np.int64),) * 3)
    assert buffer_of.shape == (0,) and sizes.shape == (0,)
    # [0, 2) then [2, 4): one ends as the other begins, so they share
    b, s = assign_buffers(np.array([0, 2]), np.array([2, 4]), np.array([8, 8]))
    assert b.tolist() == [0, 0] and s.tolist() == [8]
    # a bigger storage grows a free buffer rather than opening a second one
    b, s = assign_buffers(np.array([0, 2]), np.array([2, 4]), np.array([8, 32]))
    assert b.tolist() == [0, 0] and s.tolist() == [32]
    assert max_overlap(np.empty(0, np.int64), np.empty(0, np.int64)) == 0


@pytest.mark.parametrize("n", [1, 5])
def test_plan_counts(n):
    birth = np.arange(n, dtype=np.int64)
    death = birth + n
    b, s = assign_buffers(birth, death, np.full(n, 4, np.int64))
    assert len(s) == n == max_overlap(birth, death)
