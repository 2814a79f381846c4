"""A wrong call of any public method of MemLord names ``MemLord.<method>()``, the class
users know, never one of the private mixins the methods are written in
(``MemoryAPIMixin.memory_stats() takes ...``); CPython's own argument errors are the
reference: they name the function's ``__qualname__``.
"""

from __future__ import annotations

import inspect
import re

import pytest

from memlord import MemLord

_PUBLIC = sorted(name for name in dir(MemLord) if not name.startswith("_"))


def _functions(name):
    attr = inspect.getattr_static(MemLord, name)
    if isinstance(attr, (staticmethod, classmethod)):
        return [attr.__func__]
    if isinstance(attr, property):
        return [f for f in (attr.fget, attr.fset, attr.fdel) if f is not None]
    if inspect.isfunction(attr):
        return [attr]
    return []  # the C core's methods and getters


@pytest.mark.parametrize("name", _PUBLIC)
def test_a_wrong_call_names_memlord_not_a_mixin(name):
    lord = MemLord(auto_gc_bytes=None)
    method = getattr(lord, name)
    if not callable(method):
        return
    for args, kwargs in (((), {"no_such_argument": 1}), (tuple(range(12)), {})):
        with pytest.raises(TypeError) as info:
            method(*args, **kwargs)
        message = str(info.value)
        assert "Mixin" not in message, message
        assert f"{name}()" in message, message
        owners = re.findall(rf"(\w+)\.{name}\(", message)
        assert set(owners) <= {"MemLord"}, message


@pytest.mark.parametrize("name", _PUBLIC)
def test_every_public_python_method_is_qualified_as_memlord(name):
    for fn in _functions(name):
        assert fn.__qualname__ == f"MemLord.{name}", fn.__qualname__
        co_qualname = getattr(fn.__code__, "co_qualname", None)  # CPython >= 3.11
        assert co_qualname in (None, f"MemLord.{name}"), co_qualname
