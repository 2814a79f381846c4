"""Where the dispatch mode (``hook_into_python(ops=True)``) cannot be invisible, and what bounds it.

Three rows of the transparency corpus (test_transparency.py) differ from bare torch in its
``ops`` mode, because torch treats *every* dispatch mode so (the corpus holds such a row to
what a do-nothing dispatch mode observes, or marks it xfail where even that differs); these
tests hold memlord to the least that any dispatch mode costs:

* ``jit_trace_conversions``: torch's Python dispatch hands a mode a JIT wrapped-number
  tensor as a Python number, which the operator then rejects. A do-nothing
  ``TorchDispatchMode`` sees exactly the same; memlord adds nothing to it.
* ``conversions_at_the_recursion_limit``: torch runs Python per operator under a mode
  (``OpOverload.__hash__``) and calls the mode and the operator through CPython's call
  machinery, each call counting against the recursion limit. memlord's mode costs at most
  4 levels; a do-nothing Python mode costs dozens.
* ``hop_error_traceback``: an error raised inside a higher-order operator's subgraph (a
  torch.cond branch) carries the frames torch adds when any dispatch mode runs the
  operator it was handed (it calls it again); memlord adds none of its own.
"""

from __future__ import annotations

import sys

import test_transparency as corpus
import torch
from support.recursion import frame_depth
from torch.utils._python_dispatch import TorchDispatchMode

from memlord import MemLord


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def under_ops(fn):
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        return fn()


def test_jit_trace_under_ops_is_what_any_dispatch_mode_gets():
    row = corpus.ROWS["jit_trace_conversions"][0]
    bare = corpus.observe(row)
    with PassThrough():
        any_mode = corpus.observe(row)
    ops = under_ops(lambda: corpus.observe(row))
    assert ops == any_mode
    assert any_mode != bare  # torch's own limitation, still real
    assert any_mode[:2] == ["raise", "RuntimeError"] and "Expected a value of type" in any_mode[2]


def deepest(call):
    """The deepest recursion below this frame at whose bottom call() still runs."""

    def down(n):
        return call() if n == 0 else down(n - 1)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(frame_depth() + 100)
    try:
        for n in range(120):
            try:
                down(n)
            except RecursionError:
                return n
    finally:
        sys.setrecursionlimit(limit)
    raise AssertionError("no recursion error at 120 levels")


def test_recursion_cost_of_the_mode_is_a_few_levels():
    t = torch.arange(6.0)
    calls = (t.half, lambda: torch.zeros(2), lambda: t * 2, lambda: t.sum())
    bare = [deepest(c) for c in calls]
    ops = under_ops(lambda: [deepest(c) for c in calls])
    with PassThrough():
        python_mode = [deepest(c) for c in calls]
    for b, o, p in zip(bare, ops, python_mode, strict=True):
        assert b - 4 <= o <= b
        assert p < o  # any Python mode costs more than memlord's


#: the frames torch adds when a dispatch mode runs a higher-order operator it was handed
#: (with the mode off the stack): the operator's call again, down to its dense kernel
HOP_REDISPATCH = [["__call__", "cond.py"], ["__call__", "_ops.py"], ["dispatch", "_ops.py"]]


_HOP_FRAMES = """
import json, sys
sys.path[:0] = [{here!r}]
import test_transparency as corpus
from memlord import MemLord
bare = corpus.hop_error_frames()
with MemLord(auto_gc_bytes=None).hook_into_python(ops=True):
    ops = corpus.hop_error_frames()
print(json.dumps([bare, ops]))
"""


def test_hop_error_traceback_under_ops_is_torchs_redispatch_and_nothing_of_memlords():
    """An error raised inside torch.cond's branch, under ops=True: bare torch's traceback
    with the frames torch adds for any dispatch mode that runs the operator (it calls it
    again), and none of memlord's: memlord calls the operator and the branch from C.

    In a process of its own: once a cond has failed under a dispatch mode with no rule
    for it (the corpus's do-nothing mode, test_transparency.py's reference_under_a_mode),
    torch runs every later eager cond through dynamo, bare too, with other frames: this
    test failed after the corpus's ``hop_error_traceback`` row in one process."""
    import json
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(corpus.__file__))
    proc = subprocess.run(
        [sys.executable, "-c", _HOP_FRAMES.format(here=here)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    bare, ops = json.loads(proc.stdout.splitlines()[-1])
    at = bare.index(["cond_op_dense", "cond.py"])
    assert ops == bare[:at] + HOP_REDISPATCH + bare[at:]
    assert ops[0] == "IndexError"
