"""What a program sees of a call, to compare a run with memlord's hooks against a bare
one: its exception's type name and message, or its result."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def error_of(call: Callable[[], Any]) -> list[str]:
    """call()'s exception as [type name, message]; the call must raise."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the observation of an error
        return [type(e).__name__, str(e)]
    raise AssertionError("expected an error")


def outcome(call: Callable[[], Any], describe: Callable[[Any], Any] = lambda x: x) -> list[Any]:
    """["ok", describe(result)] of call(), or its exception as [type name, message]."""
    try:
        return ["ok", describe(call())]
    except Exception as e:  # noqa: BLE001 - the observation of an error
        return [type(e).__name__, str(e)]
