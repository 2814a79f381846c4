"""The Chrome trace format's rules, checked on a trace memlord wrote (Perfetto and
chrome://tracing read it): the event kinds, their fields, and slices nesting on each
thread."""

from __future__ import annotations

from collections import defaultdict


def validate_trace(data: dict) -> list[dict]:
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in {"M", "C", "X", "i"}, e
        assert isinstance(e["pid"], int) and isinstance(e.get("tid", 0), int)
        assert isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "C":
            assert e["args"] and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in e["args"].values()
            )
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in {"g", "p", "t"}
        if e["ph"] == "M":
            assert e["name"] in {"process_name", "thread_name", "process_sort_index"}, e
            if e["name"] == "process_sort_index":
                assert isinstance(e["args"]["sort_index"], int), e
            else:
                assert isinstance(e["args"]["name"], str), e
    # every process is named once (a process's tracks are its pid's: two processes with
    # one pid would share them)
    named = [e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(named) == len(set(named)), f"a pid named twice: {sorted(named)}"
    assert {e["pid"] for e in events} <= set(named), "an event of a process never named"
    # slices nest properly on each thread (a thread is a tid of a pid)
    by_tid = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_tid[e["pid"], e["tid"]].append(e)
    for slices in by_tid.values():
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in slices:
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-6, f"{e['name']} overlaps its parent"
            stack.append(end)
    return events
