"""The depth of the Python stack, for tests that recurse to the recursion limit."""

from __future__ import annotations

import sys


def frame_depth() -> int:
    """How many Python frames are below (and including) the caller's."""
    f, n = sys._getframe(1), 0
    while f is not None:
        f, n = f.f_back, n + 1
    return n
