"""Call sites: ids from the C core's site table, shown as ``file:line``.

A site is a short call stack: the innermost frame outside torch and memlord and, when
that frame is library code (site-packages, the standard library), the user's own frame
further out.  Its text is ``file:line``, or ``user.py:12 via lib/file.py:110`` when the
allocation happened in a library called from the user's line.

A path under the current working directory is shown relative to it (``train.py:42``);
anything else keeps its absolute path.
"""

from __future__ import annotations

import os
import sys
import sysconfig

from . import _core

_cache: dict[tuple[int, str], str] = {}

#: joins the user's line and the library line of a site's text
VIA = " via "


def library_paths() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefixes, parts) of library file names: the standard library's directories and
    frozen modules; any path inside a ``site-packages`` or ``dist-packages`` folder."""
    prefixes = {"<frozen "}
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            prefixes.add(os.path.abspath(path).rstrip(os.sep) + os.sep)
    base = getattr(sys, "_stdlib_dir", None)
    if base:
        prefixes.add(os.path.abspath(base).rstrip(os.sep) + os.sep)
    parts = tuple(f"{os.sep}{d}{os.sep}" for d in ("site-packages", "dist-packages"))
    return tuple(sorted(prefixes)), parts


def site_location(site: int) -> tuple[str, int] | None:
    """(filename, line) of a site id's innermost frame, or None when unknown."""
    return _core._site(site) if site else None


def site_stack(site: int) -> list[tuple[str, int, str, bool]]:
    """The frames a site id keeps, innermost first: ``(filename, line, function name,
    is_user)``; the user's frame, when known, is the last.  Empty when unknown."""
    got = _core._site_stack(site) if site else None
    return [] if got is None else list(got[0])


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


def _text(site: int, cwd: str) -> str:
    frames = site_stack(site)
    if not frames:
        return "<unknown>:0"
    inner = f"{relative_path(frames[0][0], cwd)}:{frames[0][1]}"
    user = frames[-1]
    if len(frames) == 1 or not user[3]:
        return inner
    return f"{relative_path(user[0], cwd)}:{user[1]}{VIA}{inner}"


def site_text(site: int) -> str:
    """``file:line`` of a site id (``<unknown>:0`` when unknown); ``user.py:12 via
    lib/file.py:110`` when the innermost frame is library code called from the user's
    line."""
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = ""
    key = (site, cwd)
    text = _cache.get(key)
    if text is None:
        text = _text(site, cwd)
        if len(_cache) > 65536:
            _cache.clear()
        _cache[key] = text
    return text


def site_frames(site: int) -> list[dict[str, object]]:
    """The frames of a site id as torch's memory snapshots list them, innermost first:
    ``{"filename", "line", "name"}`` (paths relative to the working directory when under
    it)."""
    return [
        {"filename": relative_path(f), "line": ln, "name": nm} for f, ln, nm, _u in site_stack(site)
    ]
