"""memory_stats() names the bytes freed since the last auto-GC 'freed_since_gc_bytes'
('pending_free_bytes' would read as frees waiting for a CUDA event, what the torch hooks'
pending() reports). The deprecated 'pending_free_bytes' stays for a release: equal to the
new key, reading it warns (DeprecationWarning), and the result is still a dict."""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch

from memlord import MemLord

KiB = 1024


def _stats():
    lord = MemLord(auto_gc_bytes=None)
    a = torch.empty(3 * KiB, dtype=torch.uint8)
    b = torch.empty(KiB, dtype=torch.uint8)
    lord.allocate((a, b))
    lord.free(a)
    return lord, lord.memory_stats("cpu")


def test_new_key_holds_the_bytes_freed_since_the_last_auto_gc():
    lord, s = _stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s["freed_since_gc_bytes"] == 3 * KiB == lord.freed("cpu")[0]
        assert s.get("freed_since_gc_bytes") == 3 * KiB
        assert s["allocated_bytes"] == KiB


def test_old_key_warns_on_read_and_equals_the_new():
    _, s = _stats()
    with pytest.warns(DeprecationWarning, match="freed_since_gc_bytes") as rec:
        value = s["pending_free_bytes"]
    assert value == s["freed_since_gc_bytes"]
    assert rec[0].filename == __file__  # points at the reader's line
    with pytest.warns(DeprecationWarning, match="pending_free_bytes"):
        assert s.get("pending_free_bytes") == 3 * KiB


def test_result_is_still_a_plain_dict_to_use():
    _, s = _stats()
    assert isinstance(s, dict)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = dict(s)
        assert "pending_free_bytes" in s and plain["pending_free_bytes"] == 3 * KiB
        assert json.loads(json.dumps(s)) == plain
        assert pickle.loads(pickle.dumps(s)) == plain
        assert s == plain and {**s} == plain
        with pytest.raises(KeyError):
            s["no such key"]


def test_every_read_of_the_old_key_warns_at_the_readers_line():
    """pop, setdefault and popitem read the key as [] and get do: each warns the same way,
    pointing at the reader's line, and returns what a plain dict's would."""
    reads = {
        "pop": lambda s: s.pop("pending_free_bytes"),
        "pop with a default": lambda s: s.pop("pending_free_bytes", None),
        "setdefault": lambda s: s.setdefault("pending_free_bytes", 0),
        "popitem": lambda s: s.popitem()[1],
        "a copy's []": lambda s: s.copy()["pending_free_bytes"],
    }
    for what, read in reads.items():
        _, s = _stats()
        if what == "popitem":  # the last key is the one popitem reads
            value = dict.pop(s, "pending_free_bytes")
            dict.__setitem__(s, "pending_free_bytes", value)
        plain = dict(s)
        with pytest.warns(DeprecationWarning, match="freed_since_gc_bytes") as rec:
            value = read(s)
        assert value == 3 * KiB == plain["pending_free_bytes"], what
        assert rec[0].filename == __file__, what


def test_reads_of_other_keys_do_not_warn():
    _, s = _stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.pop("freed_since_gc_bytes") == 3 * KiB
        assert s.pop("no such key", 5) == 5
        assert s.setdefault("allocated_bytes", 0) == KiB
        assert s.copy() == s and isinstance(s.copy(), dict)
        del s["pending_free_bytes"]  # a removal unread: no warning
        while s:
            s.popitem()
