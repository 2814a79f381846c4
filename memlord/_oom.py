"""Out-of-memory errors: seen, counted, explained (``lord.watch_oom()``) and recovered
from (``memlord.retry_on_oom``, ``@memlord.oom_retry``).

Where an OOM is seen:

- an error leaving the outermost memlord hook on a thread (a conversion, a factory, an
  operator with ``hook_into_python(ops=True)``): the C core offers it to
  :func:`_hook_error` with the error still pending, and the caller gets the same error
  afterwards, whatever happens here;
- on CUDA, torch's OOM observer (``torch._C._cuda_attach_out_of_memory_observer``),
  called by the caching allocator once it gives up, before the error is raised, on the
  allocating thread, with the allocator's lock released: :func:`_observer`.  It tells
  the C core (``_core._oom_claim()``) so that the hook the error then leaves does not
  report it twice.

Each OOM is counted once in every lord that sees the program (the lords with hooks on,
and the lords watching): ``stats()[dev]["ooms"]``, an ``oom`` event in the ring, and one
INFO record on the ``memlord`` logger.  Each lord watching writes a post-mortem
(:mod:`memlord.report._postmortem`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from . import _core
from ._bytes import human_bytes
from ._events import EVENT_SOURCES

logger = logging.getLogger("memlord")

#: post-mortems one process writes at most, unless a watch says otherwise
DEFAULT_LIMIT = 5

_SOURCE = {name: code for code, name in enumerate(EVENT_SOURCES)}
_OOM_TEXT = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
)
_CPU_BYTES = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
_CUDA_BYTES = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB|TiB|PiB)")
_CUDA_GPU = re.compile(r"GPU (\d+) has a total capacity")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50}


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error: torch's ``OutOfMemoryError`` (CUDA,
    and any backend raising it), Python's ``MemoryError``, or a ``RuntimeError`` whose
    message says an allocator could not allocate (the CPU allocator's "can't allocate
    memory", "not enough memory"; MPS's and XPU's "out of memory")."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    try:
        text = str(error).lower()
    except Exception:  # noqa: BLE001 - an error whose str() fails is not ours to judge
        return False
    return any(t in text for t in _OOM_TEXT)


def describe(error: BaseException) -> dict[str, Any]:
    """What the error's message tells: ``device`` (a str), ``bytes`` (the failed request,
    or None when the message does not say), ``type`` and ``message`` (its first line)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001
        text = ""
    nbytes: int | None = None
    device = "cpu"
    m = _CPU_BYTES.search(text)
    if m:
        nbytes = int(m.group(1))
    # the backend's own words first: torch.OutOfMemoryError is any caching allocator's
    # (XPU's too); a CUDA call that failed for memory (cudaMalloc inside a library, a
    # context or a workspace) is torch.AcceleratorError "CUDA error: out of memory"
    if "MPS backend out of memory" in text:
        device = "mps"
    elif "XPU out of memory" in text:
        g = _CUDA_GPU.search(text)  # XPU's message names its device as CUDA's does
        device = f"xpu:{g.group(1)}" if g else "xpu"
    elif (
        isinstance(error, torch.OutOfMemoryError)
        or "CUDA out of memory" in text
        or "CUDA error: out of memory" in text
    ):
        g = _CUDA_GPU.search(text)
        if g:
            device = f"cuda:{g.group(1)}"
        else:
            try:
                device = f"cuda:{torch.cuda.current_device()}"
            except Exception:  # noqa: BLE001 - no CUDA here: say only "cuda"
                device = "cuda"
    if device != "cpu":
        c = _CUDA_BYTES.search(text)
        if c and nbytes is None:
            nbytes = int(float(c.group(1)) * _UNITS[c.group(2)])
    first = text.strip().splitlines()[0] if text.strip() else ""
    return {"device": device, "bytes": nbytes, "type": type(error).__name__, "message": first}


def _what(what: Any, source: str) -> str | None:
    """A name for the hooked call or operator: ``torch.empty``, ``Tensor.to``,
    ``aten.mm.default``."""
    if what is None:
        return None
    if source == "op":
        return str(what)
    name = getattr(what, "__name__", None) or str(what)
    if source == "factory":
        return f"torch.{name}"
    if source == "convert":
        return f"Tensor.{name}"
    return str(name)


def _user_stack(limit: int = 16) -> list[dict[str, Any]]:
    """The Python frames of this thread outside memlord and torch, innermost last."""
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    tdir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    frames: list[dict[str, Any]] = []
    f: FrameType | None = sys._getframe(1)
    while f is not None and len(frames) < limit:
        name = f.f_code.co_filename
        if not (name.startswith(here) or name.startswith(tdir)):
            frames.append({"file": name, "line": f.f_lineno, "function": f.f_code.co_name})
        f = f.f_back
    frames.reverse()
    return frames


# ---- watches ------------------------------------------------------------------------------

_lock = threading.RLock()
_watches: list[OOMWatch] = []
_serial = itertools.count(1)  # post-mortems numbered per process
_written = 0  # post-mortems this process wrote
_local = threading.local()  # .busy: handling an OOM; .last: (error id, message, paths)
_observer_attached = False
_observer_queued = False  # waiting for CUDA's initialisation


class OOMWatch:
    """What ``lord.watch_oom()`` returns: while enabled, every out-of-memory error the lord
    sees writes a post-mortem (JSON, and HTML and a memory_viz pickle beside it) into
    ``path``.  A context manager; ``disable()`` stops it (idempotent)."""

    def __init__(self, lord: Any, path: Path | None, html: bool, top: int, limit: int):
        self._lord = weakref.ref(lord)
        self.path = path
        self.html = html
        self.top = top
        self.limit = limit
        self.written: list[dict[str, str]] = []  # one {"json", "html", "pickle"} per OOM
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def lord(self) -> Any:
        return self._lord()

    def disable(self) -> None:
        with _lock:
            self._enabled = False
            if self in _watches:
                _watches.remove(self)

    def __enter__(self) -> OOMWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "on" if self._enabled else "off"
        where = str(self.path) if self.path is not None else "the working directory"
        return (
            f"<OOMWatch {state}: post-mortems to {where}, html={self.html}, top={self.top}, "
            f"{len(self.written)} written, limit {self.limit}>"
        )

    def _directory_and_stem(self, stem: str) -> tuple[Path, str]:
        if self.path is None:
            return Path.cwd(), stem
        if self.path.suffix.lower() == ".json" and not self.path.is_dir():
            if not self.written and not self.path.exists():
                return self.path.parent, self.path.stem
            return self.path.parent, f"{self.path.stem}-{stem.rsplit('-', 1)[-1]}"
        return self.path, stem

    def _write(self, request: dict[str, Any]) -> dict[str, str] | None:
        global _written
        lord = self._lord()
        if lord is None or not self._enabled:
            return None
        with _lock:
            if _written >= self.limit:
                return None
            _written += 1
            n = next(_serial)
        from .report import _postmortem

        try:
            doc = _postmortem.build_post_mortem([lord], request, top=self.top)
            paths = None
            for _ in range(100):  # a name a process of the same pid left: the next n
                directory, stem = self._directory_and_stem(_postmortem.default_stem(n))
                directory.mkdir(parents=True, exist_ok=True)
                try:
                    paths = _postmortem.write_post_mortem(doc, str(directory), stem, html=self.html)
                    break
                except FileExistsError:
                    with _lock:
                        n = next(_serial)
            if paths is None:
                raise FileExistsError(f"no free post-mortem name in {directory}")
        except Exception as e:  # noqa: BLE001 - the OOM error must reach the caller untouched
            with _lock:
                _written -= 1
            logger.warning("could not write the OOM post-mortem to %s: %s", self.path or ".", e)
            return None
        self.written.append(paths)
        return paths


def watch_of(lord: Any) -> OOMWatch | None:
    """The enabled watch of ``lord``, or None."""
    with _lock:
        for w in _watches:
            if w.lord is lord:
                return w
    return None


def watch_oom(
    lord: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    html: bool = True,
    top: int = 20,
    limit: int = DEFAULT_LIMIT,
) -> OOMWatch:
    """``lord.watch_oom()``: see :class:`OOMWatch` and docs/oom.md."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"watch_oom(): argument 'path' must be None, a str or an os.PathLike, not "
            f"{type(path).__name__}"
        )
    if not isinstance(html, bool):
        raise TypeError(f"watch_oom(): argument 'html' must be a bool, not {type(html).__name__}")
    if isinstance(top, bool) or not isinstance(top, int):
        raise TypeError(f"watch_oom(): argument 'top' must be an int, not {type(top).__name__}")
    if top < 1:
        raise ValueError(f"watch_oom(): argument 'top' must be >= 1, got {top}")
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"watch_oom(): argument 'limit' must be an int, not {type(limit).__name__}")
    if limit < 0:
        raise ValueError(f"watch_oom(): argument 'limit' must be >= 0, got {limit}")
    where = None if path is None else Path(os.path.abspath(os.fspath(path)))
    with _lock:
        for w in _watches:
            if w.lord is lord:  # one watch per lord: a second call updates it
                w.path, w.html, w.top, w.limit = where, html, top, limit
                return w
        w = OOMWatch(lord, where, html, top, limit)
        _watches.append(w)
    _attach_observer()
    return w


# ---- seeing an OOM ------------------------------------------------------------------------


def _attach_observer() -> None:
    """torch's CUDA OOM observer, attached once per process (torch has no way to detach
    one): it does nothing while no lord is hooked or watching.  torch hands an observer
    to the device allocators that exist, which are made when CUDA initialises: before
    that the attachment waits for the initialisation (``torch.cuda._lazy_call``)."""
    global _observer_queued
    if _observer_attached or _observer_queued:
        return
    if getattr(torch._C, "_cuda_attach_out_of_memory_observer", None) is None:
        return
    try:
        if not torch.cuda.is_available():
            return
        if torch.cuda.is_initialized():
            _attach_now()
        else:
            _observer_queued = True
            torch.cuda._lazy_call(_attach_now)
    except Exception as e:  # noqa: BLE001 - post-mortems then come from the hooks only
        logger.warning("could not attach to torch's CUDA OOM observer: %s", e)


def _attach_now() -> None:
    global _observer_attached
    if _observer_attached:
        return
    try:
        # a CUDA build's function, left out of torch._C's stubs
        torch._C._cuda_attach_out_of_memory_observer(_observer)  # type: ignore[attr-defined]
        _observer_attached = True
    except Exception as e:  # noqa: BLE001 - e.g. the cudaMallocAsync backend has none
        logger.warning("could not attach to torch's CUDA OOM observer: %s", e)


def _observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """torch's CUDA OOM observer: the allocator gave up on ``alloc`` bytes on ``device``."""
    try:
        if not _watches and not _core._hooked_lords():
            return
        _core._oom_claim()  # the hook the error leaves next does not report it again
        request = {
            "device": f"cuda:{device}",
            "bytes": int(alloc),
            "what": None,
            "source": "allocator",
            "error": None,
            "cuda": {"device_allocated": int(device_allocated), "device_free": int(device_free)},
        }
        _seen(request, _SOURCE["allocator"], None)
    except Exception as e:  # noqa: BLE001 - never raise into torch's allocator
        logger.warning("memlord: the OOM observer failed: %s", e)


def _hook_error(error: BaseException, what: Any, source: int) -> None:
    """The C core's handler (``_core._set_oom_handler``): ``error`` left the outermost
    hooked call of this thread and is still pending; it continues to the caller after."""
    if getattr(_local, "busy", False) or not is_oom(error):
        return
    info = describe(error)
    src = EVENT_SOURCES[source] if 0 <= source < len(EVENT_SOURCES) else "explicit"
    request = {
        "device": info["device"],
        "bytes": info["bytes"],
        "what": _what(what, src),
        "source": src,
        "error": f"{info['type']}: {info['message']}",
        "cuda": None,
    }
    _seen(request, source, error)


def _seen(request: dict[str, Any], source: int, error: BaseException | None) -> None:
    _local.busy = True
    try:
        stack = _user_stack()
        request.setdefault("stack", stack)
        request.setdefault("site", f"{stack[-1]['file']}:{stack[-1]['line']}" if stack else None)
        request.setdefault("time", time.time())
        t = threading.current_thread()
        request.setdefault("thread", {"id": threading.get_ident(), "name": t.name})
        with _lock:
            watches = [w for w in _watches if w.enabled and w.lord is not None]
        lords = list(_core._hooked_lords())
        for w in watches:
            if not any(lord is w.lord for lord in lords):
                lords.append(w.lord)
        try:
            dev = torch.device(request["device"])
        except Exception:  # noqa: BLE001
            dev = torch.device("cpu")
        nbytes = request["bytes"] if request["bytes"] is not None else -1
        for lord in lords:
            try:
                request.setdefault("regions", list(lord._open_regions()) or None)
                lord._record_oom(dev, nbytes, source)
            except Exception as e:  # noqa: BLE001
                logger.warning("could not count the OOM in %r: %s", lord, e)
        written: list[str] = []
        for w in watches:
            paths = w._write(request)
            if paths:
                written.append(paths["json"])
        if logger.isEnabledFor(logging.INFO):
            size = human_bytes(request["bytes"]) if request["bytes"] is not None else "? bytes"
            where = f" at {request['site']}" if request.get("site") else ""
            by = f" by {request['what']}" if request.get("what") else ""
            pm = f"; post-mortem: {', '.join(written)}" if written else ""
            logger.info(
                "[oom] out of memory on %s: %s requested%s%s%s",
                request["device"],
                size,
                by,
                where,
                pm,
                extra={"color": "31"},
            )
        if error is not None:
            _local.last = (id(error), str(error), written)
        else:
            _local.last_observed = written
    finally:
        _local.busy = False


def post_mortems_of(error: BaseException) -> list[str]:
    """The post-mortems written for ``error`` on this thread (the JSON paths), if any."""
    last = getattr(_local, "last", None)
    if last is not None and last[0] == id(error):
        try:
            if last[1] == str(error):
                return list(last[2])
        except Exception:  # noqa: BLE001
            return []
    observed = getattr(_local, "last_observed", None)
    if observed and isinstance(error, torch.OutOfMemoryError):
        return list(observed)
    return []


# ---- recovery -----------------------------------------------------------------------------


def _check_retry_args(
    fname: str,
    attempts: object,
    backoff: object,
    max_backoff: object,
    on_retry: object,
    shrink: object,
) -> None:
    if isinstance(attempts, bool) or not isinstance(attempts, int):
        raise TypeError(
            f"{fname}(): argument 'attempts' must be an int, not {type(attempts).__name__}"
        )
    if attempts < 1:
        raise ValueError(f"{fname}(): argument 'attempts' must be >= 1, got {attempts}")
    for name, v in (("backoff", backoff), ("max_backoff", max_backoff)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(
                f"{fname}(): argument '{name}' must be a number of seconds, not {type(v).__name__}"
            )
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"{fname}(): argument '{name}' must be finite and >= 0, got {v!r}")
    for name, v in (("on_retry", on_retry), ("shrink", shrink)):
        if v is not None and not callable(v):
            raise TypeError(
                f"{fname}(): argument '{name}' must be callable or None, not {type(v).__name__}"
            )


def release_memory() -> None:
    """What a retry does between attempts: credit memlord's deferred frees (after their
    CUDA events complete), collect cycles, and return the allocator's cached blocks."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a broken context: the collection still helps
            pass
    _core._hooks_poll()
    gc.collect()
    if cuda:
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass


def retry_on_oom(
    fn: Callable[..., Any],
    /,
    *args: Any,
    attempts: int = 3,
    backoff: float = 0.5,
    max_backoff: float = 8.0,
    on_retry: Callable[[int, dict[str, Any]], Any] | None = None,
    shrink: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]] | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)``; on an out-of-memory error, release and try again, up
    to ``attempts`` runs in all.  See docs/oom.md#recovery."""
    if not callable(fn):
        raise TypeError(f"retry_on_oom(): argument 'fn' must be callable, not {type(fn).__name__}")
    _check_retry_args("retry_on_oom", attempts, backoff, max_backoff, on_retry, shrink)
    attempt = 0
    while True:
        attempt += 1
        failed: BaseException | None = None
        # what an earlier OOM on this thread left: matched by id, its dead error's id may
        # be a new error's (post_mortems_of), so only this attempt's record may answer
        _local.last = _local.last_observed = None
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if not is_oom(e):
                raise
            failed = e
        # Out of the except block: the failed call's frames are no longer the
        # exception being handled.  On the last attempt the error is raised again;
        # before that, only its summary is kept, and its traceback (which holds
        # the failed call's frames and their tensors) is dropped.
        summary = describe(failed)
        summary["attempt"] = attempt
        summary["post_mortems"] = post_mortems_of(failed)
        if attempt >= attempts:
            note = f"memlord: out of memory on all {attempts} attempts of retry_on_oom"
            if summary["post_mortems"]:
                note += f"; post-mortem: {', '.join(summary['post_mortems'])}"
            _add_note(failed, note)
            raise failed
        failed.__traceback__ = None
        failed = None
        release_memory()
        delay = min(float(max_backoff), float(backoff) * (2 ** (attempt - 1)))
        if delay > 0:
            time.sleep(delay)
        if on_retry is not None:
            on_retry(attempt, summary)
        if shrink is not None:
            new = shrink(args, kwargs)
            if not (isinstance(new, tuple) and len(new) == 2 and isinstance(new[1], dict)):
                raise TypeError(
                    "retry_on_oom(): argument 'shrink' must return (args, kwargs), a "
                    f"sequence and a dict, not {type(new).__name__}"
                )
            args, kwargs = tuple(new[0]), dict(new[1])


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: the attribute 3.11's add_note keeps them in
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            try:
                # BaseException has __notes__ in typeshed from 3.11 on (mypy may check as 3.10)
                error.__notes__ = notes  # type: ignore[attr-defined,unused-ignore]
            except Exception:  # noqa: BLE001
                return
        notes.append(note)


def oom_retry(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    attempts: int = 3,
    backoff: float = 0.5,
    max_backoff: float = 8.0,
    on_retry: Callable[[int, dict[str, Any]], Any] | None = None,
    shrink: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]] | None = None,
) -> Any:
    """The decorator form of :func:`retry_on_oom`: ``@oom_retry`` or
    ``@oom_retry(attempts=5, ...)``."""
    _check_retry_args("oom_retry", attempts, backoff, max_backoff, on_retry, shrink)

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"oom_retry(): argument 'fn' must be callable, not {type(f).__name__}")

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return retry_on_oom(
                f,
                *args,
                attempts=attempts,
                backoff=backoff,
                max_backoff=max_backoff,
                on_retry=on_retry,
                shrink=shrink,
                **kwargs,
            )

        return wrapper

    return decorate if fn is None else decorate(fn)


_core._set_oom_handler(_hook_error)
