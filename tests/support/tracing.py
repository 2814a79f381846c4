"""Deterministic interruptions: a trace function (``sys.settrace``) that runs an action
once, at one line of one function, standing in for a signal handler or a finalizer that
could run there."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import CodeType
from typing import Any


def line_of(fn: Callable[..., Any], needle: str) -> tuple[CodeType, int]:
    """fn's code and the number of its first line holding needle."""
    lines, start = inspect.getsourcelines(fn)
    return fn.__code__, start + next(i for i, text in enumerate(lines) if needle in text)


def run_at(code: CodeType, line: int, action: Callable[[], None]) -> Callable[..., Any]:
    """A trace function that runs action once, when code's frame reaches line; its
    ``fired`` list holds True once it has."""
    fired: list[bool] = []

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(True)
            action()
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code is code else None

    tracer.fired = fired  # type: ignore[attr-defined]
    return tracer
