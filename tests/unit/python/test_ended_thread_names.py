"""An export names each thread its events and regions carry, by the name Python's
threading gave it, also when the thread has ended by then (before, an ended thread was
``thread <ident>``): memlord records a thread's name the first time it stamps the
thread's ident on an event or a region.  The reference is the thread's own
``threading.Thread.name``."""

from __future__ import annotations

import threading

import pytest
import torch

from memlord import MemLord
from memlord.report._lord import profile_from_lord


def _ended_thread(name, work):
    seen = {}

    def run():
        seen["ident"] = threading.get_ident()
        work()

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    assert not t.is_alive()
    return seen["ident"], t.name


@pytest.mark.parametrize("what", ["events", "region", "both"])
def test_an_ended_threads_spans_and_events_keep_its_name(what):
    lord = MemLord(auto_gc_bytes=None)
    if what != "region":
        lord.record_events(64)
    keep = []

    def work():
        t = torch.empty(256, dtype=torch.uint8)
        keep.append(t)
        if what == "events":
            lord.allocate(t)
        else:
            with lord.region("worker step"):
                if what == "both":
                    lord.allocate(t)

    ident, name = _ended_thread("data-worker-7", work)
    doc = profile_from_lord(lord)
    assert doc.metadata["threads"][str(ident)] == name == "data-worker-7"
    if what != "events":
        (span,) = [s for s in doc.regions if s.name == "worker step"]
        assert span.thread == ident
    if what != "region":
        assert ident in set(doc.events["thread"].tolist())
    lord.record_events(0)


def test_a_renamed_live_thread_shows_its_name_now():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(16)
    lord.allocate(torch.empty(8))
    me = threading.current_thread()
    old = me.name
    try:
        me.name = "renamed main"
        doc = profile_from_lord(lord)
        assert doc.metadata["threads"][str(threading.get_ident())] == "renamed main"
    finally:
        me.name = old
        lord.record_events(0)


def test_the_namer_must_be_callable_and_a_refused_one_changes_nothing():
    """``_core._set_thread_namer`` refuses what is not callable (TypeError naming ``fn``),
    and memlord's namer stays: a thread seen after it is still named."""
    from memlord import _core
    from memlord.lord import THREAD_NAMES

    with pytest.raises(TypeError, match="argument 'fn' must be callable or None, not int"):
        _core._set_thread_namer(3)
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(64)
    keep = []

    def work():
        keep.append(torch.empty(8))
        lord.allocate(keep[-1])  # an event stamped with the thread's ident

    ident, name = _ended_thread("named-after-refusal", work)
    assert THREAD_NAMES.get(ident) == name
    lord.record_events(0)
