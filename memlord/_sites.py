"""Call sites: ids from the C core's site table, shown as ``file:line``.

A path under the current working directory is shown relative to it (``train.py:42``);
anything else keeps its absolute path.
"""

from __future__ import annotations

import os

from . import _core

_cache: dict[tuple[int, str], str] = {}


def site_location(site: int) -> tuple[str, int] | None:
    """(filename, line) of a site id, or None when unknown."""
    return _core._site(site) if site else None


def relative_path(filename: str, cwd: str | None = None) -> str:
    """filename relative to cwd when it lies under it, else unchanged."""
    if cwd is None:
        try:
            cwd = os.getcwd()
        except OSError:
            return filename
    if os.path.isabs(filename):
        prefix = cwd.rstrip(os.sep) + os.sep
        if filename.startswith(prefix):
            return filename[len(prefix) :]
    return filename


def site_text(site: int) -> str:
    """``file:line`` of a site id (``<unknown>:0`` when unknown)."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    key = (site, cwd)
    text = _cache.get(key)
    if text is None:
        loc = site_location(site)
        text = "<unknown>:0" if loc is None else f"{relative_path(loc[0], cwd)}:{loc[1]}"
        if len(_cache) > 65536:
            _cache.clear()
        _cache[key] = text
    return text
