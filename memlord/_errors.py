"""Helpers for the messages of argument errors."""

from __future__ import annotations


def type_name(value: object) -> str:
    """The name of ``value``'s type for an error message: ``int``, ``numpy.bool`` (a bare
    ``bool`` would read as the type that was asked for)."""
    cls = type(value)
    module = getattr(cls, "__module__", "builtins")
    name = getattr(cls, "__qualname__", cls.__name__)
    return name if module == "builtins" else f"{module}.{name}"
