"""Several processes on one host: publishing (``lord.publish()``), reading the records
(``python -m memlord top``) and the memory-pressure protocol (``lord.request_memory``,
``lord.on_pressure``).  See docs/ranks.md#several-processes-on-one-host.

The runtime directory (per user, mode 0700: another user's processes never see or
write it): ``$MEMLORD_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/memlord``, else
``/dev/shm/memlord-<uid>``, else ``<tmp>/memlord-<uid>``.  In it:

- one record per publishing lord, ``<pid>-<n>.rec``: a memory-mapped file of a fixed
  size (``_core._publish_layout()``).  The C core's publish sink writes the per-device
  counters as the ledger changes (no Python on that path); this module writes the rest
  (pid, start time, name, rank, heartbeat, region, site, reserved bytes, the request
  and what was given back) through ``lord._publish_write``.  A sequence counter, odd
  while a write is inside, lets a reader in another process retry instead of reading
  a torn record.  A record whose pid is gone, or belongs to a process started at
  another time (a reused pid), is ignored and removed by the next reader;
- ``pressure``: 8 bytes that a requester changes to wake the cooperating publishers.
  Each publisher's heartbeat thread looks at it every 50 ms and, when it changed,
  schedules the release on the main thread (``Py_AddPendingCall``: it runs between two
  bytecodes, like a signal handler, never inside an allocator or a hook).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import _core
from ._core import CATEGORIES

logger = logging.getLogger("memlord")

LAYOUT = _core._publish_layout()
SIZE = LAYOUT["size"]
# Python's part of a record, at LAYOUT["py"]
_PY = struct.Struct("<qQiiqii128s64s128sQ16sqqQqq")
_PY_FIELDS = (
    "pid",
    "start",
    "rank",
    "world",
    "heartbeat_ns",
    "cooperate",
    "interval_ms",
    "name",
    "region",
    "site",
    "req_seq",
    "req_dev",
    "req_bytes",
    "req_deadline_ns",
    "served",
    "released",
    "last_release_ns",
)
assert _PY.size <= LAYOUT["py_size"]
_DEV = struct.Struct(f"<IIqqq{LAYOUT['ncat']}qq16s")
assert _DEV.size == LAYOUT["dev_size"]
_HEAD = struct.Struct("<QIIQ")  # magic, version, size, seq

_OFF = ("", "0", "false", "no", "off")
HEARTBEAT_S = 0.5
MAIN_WAIT_S = 0.25
POLL_S = 0.05


# ---- the runtime directory -----------------------------------------------------------------


def runtime_dir(create: bool = True) -> Path:
    """The per-user directory of the records (see the module's docstring)."""
    env = os.environ.get("MEMLORD_RUNTIME_DIR")
    if env:
        base = Path(env)
    else:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
            base = Path(xdg) / "memlord"
        elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
            base = Path(f"/dev/shm/memlord-{os.getuid()}")
        else:
            base = Path(tempfile.gettempdir()) / f"memlord-{os.getuid()}"
    if create:
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
    if base.exists():
        st = base.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(
                f"memlord: {base} must belong to this user and be private (mode 0700): "
                "another user's records are never read or written"
            )
    return base


def proc_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or
    None when there is no such process."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("utf-8", "replace")


def _fit(text: str, n: int) -> bytes:
    raw = text.encode("utf-8", "replace")[: n - 1]
    while raw:  # never cut a character in two
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:
            raw = raw[:-1]
    return raw


# ---- reading -----------------------------------------------------------------------------


def decode(data: bytes) -> dict[str, Any] | None:
    """A record's fields, or None when the bytes are not a complete record."""
    if len(data) < SIZE:
        return None
    magic, version, size, _seq = _HEAD.unpack_from(data, 0)
    if magic != LAYOUT["magic"] or version != LAYOUT["version"] or size != SIZE:
        return None
    py = dict(zip(_PY_FIELDS, _PY.unpack_from(data, LAYOUT["py"]), strict=True))
    devices = []
    for i in range(LAYOUT["ndev"]):
        code, used, live, peak, ooms, *rest = _DEV.unpack_from(
            data, LAYOUT["devs"] + i * LAYOUT["dev_size"]
        )
        if not used:
            continue
        cats, reserved, name = rest[: LAYOUT["ncat"]], rest[-2], rest[-1]
        devices.append(
            {
                "device": _cstr(name) or _device_name(code),
                "live": live,
                "peak": peak,
                "reserved": None if reserved < 0 else reserved,
                "ooms": ooms,
                "categories": {c: cats[k] for k, c in enumerate(CATEGORIES) if cats[k]},
            }
        )
    request = None
    if py["req_seq"]:
        request = {
            "device": _cstr(py["req_dev"]),
            "bytes": py["req_bytes"],
            "deadline_ns": py["req_deadline_ns"],
            "seq": py["req_seq"],
        }
    return {
        "pid": py["pid"],
        "start": py["start"],
        "name": _cstr(py["name"]),
        "rank": None if py["rank"] < 0 else py["rank"],
        "world_size": None if py["world"] < 0 else py["world"],
        "heartbeat_age_s": max(0.0, (time.time_ns() - py["heartbeat_ns"]) / 1e9)
        if py["heartbeat_ns"]
        else None,
        "cooperate": bool(py["cooperate"]),
        "region": _cstr(py["region"]) or None,
        "site": _cstr(py["site"]) or None,
        "devices": devices,
        "request": request,
        "served": py["served"],
        "released_bytes": py["released"],
        "last_release_ns": py["last_release_ns"] or None,
    }


_names: dict[int, str] = {}


def _device_name(code: int) -> str:
    """A device key's name, read by this process's core (device type codes are torch's,
    the same in every process)."""
    if code not in _names:
        try:
            _names[code] = str(_core.Lord()._device_name(code))
        except Exception:  # noqa: BLE001
            _names[code] = f"device#{code}"
    return _names[code]


def read_record(path: Path | str, tries: int = 2000) -> dict[str, Any] | None:
    """One consistent copy of a record (retrying while a writer is inside), or None.
    First one read of the file between two reads of its sequence counter (three system
    calls); under a busy writer, copies of the mapped bytes, which take well under a
    microsecond each.

    The counter is read on its own before the copy, never taken from the copy: the
    kernel copies a file's bytes with string instructions, whose loads may be done in any
    order, so the counter inside a copy can be newer than fields the same copy read
    before it (a record whose categories and live bytes came from two writes, about one
    read in 500,000 under a writer as busy as it can be)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    seq = LAYOUT["seq"]
    try:
        try:
            s1 = os.pread(fd, 8, seq)
            data = os.pread(fd, SIZE, 0)
            s2 = os.pread(fd, 8, seq)
        except OSError:
            return None
        if len(data) == SIZE and len(s1) == 8 and s1 == s2 and not s1[0] & 1:
            return decode(data)
        try:
            mm = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
    finally:
        os.close(fd)
    try:
        for i in range(tries):
            s1 = struct.unpack_from("<Q", mm, seq)[0]
            data = mm[:SIZE]
            s2 = struct.unpack_from("<Q", mm, seq)[0]
            if s1 == s2 and not s1 & 1:
                return decode(data)
            if i >= 100:
                time.sleep(0.0001)
        return None
    finally:
        mm.close()


def read_all(directory: Path | None = None, *, clean: bool = True) -> list[dict[str, Any]]:
    """Every live publisher's record in the runtime directory; records of processes that
    are gone (or of a reused pid) are removed when ``clean``."""
    directory = directory if directory is not None else runtime_dir(create=False)
    out = []
    try:
        listed = os.listdir(directory)
    except OSError:
        return []
    names = sorted(p for p in listed if p.endswith(".rec"))
    starts: dict[int, int | None] = {}
    base = os.fspath(directory)
    if clean:
        # a record a killed publisher left half made (before its rename)
        for name in listed:
            if name.startswith(".") and name.endswith(".tmp"):
                path = os.path.join(base, name)
                ident = _ident(path)
                if ident is not None and _stale_file(Path(path)):
                    _remove_if_same(path, ident)
    for name in names:
        path = os.path.join(base, name)
        ident = _ident(path)  # what is judged below, before it is read
        rec = read_record(path)
        if rec is not None and rec["pid"] not in starts:
            starts[rec["pid"]] = proc_start(rec["pid"])
        alive = rec is not None and starts[rec["pid"]] == rec["start"]
        if rec is None or not alive:
            if clean and ident is not None and (rec is not None or _stale_file(Path(path))):
                _remove_if_same(path, ident)
            continue
        rec["path"] = path
        out.append(rec)
    return out


def _ident(path: str) -> tuple[int, int] | None:
    """The file at path (device, inode), or None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remove_if_same(path: str, ident: tuple[int, int]) -> None:
    """Remove the file at path if it is still the one a reader judged dead (ident).

    A process given the dead one's pid (pids are reused) publishes under the same name,
    replacing the file by a rename: removing by name after the judgement could remove
    that live record.  So the file is first renamed to a name of this process's own
    (atomic), and removed only if it is the one judged; another is linked back (a link
    never replaces a file that took the name meanwhile)."""
    grave = os.path.join(
        os.path.dirname(path), f".{os.getpid()}-grave{next(_serial)}.tmp"
    )  # readers remove it once this process is gone, should it stay
    try:
        os.rename(path, grave)
    except OSError:
        return  # already removed, or not ours to move
    with contextlib.suppress(OSError):
        if _ident(grave) != ident:
            os.link(grave, path)
    with contextlib.suppress(OSError):
        os.unlink(grave)


def _stale_file(path: Path) -> bool:
    """An unreadable or half-made record (``<pid>-<n>.rec``, ``.<pid>-<n>.tmp``) whose pid
    (from its name) no longer runs."""
    try:
        pid = int(path.name.lstrip(".").split("-", 1)[0])
    except ValueError:
        return False
    return proc_start(pid) is None


# ---- publishing --------------------------------------------------------------------------

_serial = itertools.count(1)
_publishers: list[Publisher] = []
_lock = threading.RLock()


def _default_name() -> str:
    argv = [os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"]
    return " ".join(argv + list(sys.argv[1:]))[:127]


def _rank() -> tuple[int, int]:
    """(rank, world size), or (-1, -1): memlord/_ranks.py's answer, the one definition."""
    from ._ranks import rank_info

    info = rank_info()
    return info.get("rank", -1), info.get("world_size", -1)


class Publisher:
    """What ``lord.publish()`` returns: while enabled, this lord's memory is readable by
    other processes of the same user on the host (``python -m memlord top``).  A context
    manager; ``disable()`` removes the record (idempotent)."""

    def __init__(self, lord: Any, name: str | None, cooperate: bool) -> None:
        self._lord = weakref.ref(lord)
        self.name = name if name is not None else _default_name()
        self.cooperate = cooperate
        # the fields of the Python part of the record (_PY_FIELDS), by name
        self._state: dict[str, Any] = {
            "pid": os.getpid(),
            "start": proc_start(os.getpid()) or 0,
            "rank": -1,
            "world": -1,
            "heartbeat_ns": time.time_ns(),
            "cooperate": int(cooperate),
            "interval_ms": int(HEARTBEAT_S * 1000),
            "name": _fit(self.name, 128),
            "region": b"",
            "site": b"",
            "req_seq": 0,
            "req_dev": b"",
            "req_bytes": 0,
            "req_deadline_ns": 0,
            "served": 0,
            "released": 0,
            "last_release_ns": 0,
        }
        self._state_lock = threading.RLock()
        self._served: set[tuple[int, int]] = set()
        self._epoch = b""
        self._stop = threading.Event()
        directory = runtime_dir()
        n = next(_serial)
        self.path = directory / f"{os.getpid()}-{n}.rec"
        tmp = directory / f".{os.getpid()}-{n}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            # this pid's and serial's name: left half made by a dead process that had this
            # pid (pids are reused), which no reader has removed yet
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        try:
            lord._publish_attach(self._mm)
            self._write()
            self._heartbeat()
            os.rename(tmp, self.path)  # readers never see a record half made
        except BaseException:
            lord._publish_attach(None)
            self._mm.close()
            tmp.unlink(missing_ok=True)
            raise
        self._enabled = True
        self._thread = threading.Thread(target=self._run, name="memlord-publish", daemon=True)
        self._thread.start()

    # -- state -----------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def lord(self) -> Any:
        return self._lord()

    def __repr__(self) -> str:
        state = "on" if self._enabled else "off"
        coop = ", cooperating" if self.cooperate else ""
        return f"<Publisher {state}: {self.name!r} at {self.path}{coop}>"

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def disable(self) -> None:
        with _lock:
            if not self._enabled:
                return
            self._enabled = False
            if self in _publishers:
                _publishers.remove(self)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        lord = self._lord()
        if lord is not None:
            lord._publish_attach(None)
        try:
            self._mm.close()
        except BufferError:  # still exported: the lord died without detaching
            pass
        try:
            self.path.unlink()
        except OSError:
            pass

    def _forget_in_child(self) -> None:
        """After os.fork(), in the child: the record is the parent's."""
        self._enabled = False
        lord = self._lord()
        if lord is not None:
            lord._publish_attach(None)

    # -- writing ---------------------------------------------------------------------

    def _write(self) -> None:
        lord = self._lord()
        if lord is None:
            return
        with self._state_lock:
            data = _PY.pack(*(self._state[f] for f in _PY_FIELDS))
        lord._publish_write(LAYOUT["py"], data)

    def _heartbeat(self) -> None:
        lord = self._lord()
        if lord is None:
            return
        rank, world = _rank()
        try:
            region = lord._innermost_region() or ""
        except Exception:  # noqa: BLE001
            region = ""
        try:
            top = lord.top_alloc_site()
            site = f"{top[1]} ({top[0]})" if top else ""
        except Exception:  # noqa: BLE001
            site = ""
        with self._state_lock:
            self._state.update(
                rank=rank,
                world=world,
                heartbeat_ns=time.time_ns(),
                region=_fit(region, 64),
                site=_fit(site, 128),
            )
        self._write()
        # the device slots' names and CUDA's reserved bytes (Python's part of each slot)
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        for i in range(LAYOUT["ndev"]):
            off = LAYOUT["devs"] + i * LAYOUT["dev_size"]
            code, used = struct.unpack_from("<II", self._mm, off)
            if not used:
                continue
            name = lord._device_name(code)
            reserved = -1
            if cuda and name.startswith("cuda"):
                try:
                    index = int(name.split(":")[1]) if ":" in name else 0
                    reserved = torch.cuda.memory_reserved(index)
                except Exception:  # noqa: BLE001
                    reserved = -1
            lord._publish_write(
                off + LAYOUT["dev.reserved"], struct.pack("<q16s", reserved, _fit(name, 16))
            )

    def _run(self) -> None:
        last_beat = time.monotonic()
        while not self._stop.wait(POLL_S):
            if self._lord() is None:  # the lord died without disable(): its record goes
                self.disable()
                return
            try:
                if self.cooperate and self._pressure_changed():
                    self._schedule_serve()
                if time.monotonic() - last_beat >= HEARTBEAT_S:
                    last_beat = time.monotonic()
                    self._heartbeat()
            except Exception as e:  # noqa: BLE001 - the thread outlives a failed beat
                if not self._enabled:
                    return
                logger.debug("memlord publish heartbeat: %s", e)

    def _schedule_serve(self) -> None:
        """Serve on the main thread at its next bytecode; a main thread that runs no
        Python for MAIN_WAIT_S (blocked in I/O, a sleep, a long C call) is not waited
        for: this thread serves, under the GIL."""
        _served_event.clear()
        if _core._pending_call(_serve_requests) and _served_event.wait(MAIN_WAIT_S):
            return
        _serve_requests()

    def _pressure_changed(self) -> bool:
        try:
            with open(runtime_dir(create=False) / "pressure", "rb") as f:
                epoch = f.read(8)
        except OSError:
            return False
        changed = epoch != self._epoch
        self._epoch = epoch
        return changed and epoch != b""

    # -- the pressure protocol --------------------------------------------------------

    def _set_request(self, device: str, nbytes: int, deadline_ns: int) -> None:
        with self._state_lock:
            self._state.update(
                req_seq=time.time_ns(),
                req_dev=_fit(device, 16),
                req_bytes=nbytes,
                req_deadline_ns=deadline_ns,
            )
        self._write()

    def _clear_request(self) -> None:
        with self._state_lock:
            self._state.update(req_seq=0, req_dev=b"", req_bytes=0, req_deadline_ns=0)
        self._write()

    def _serve(self, requests: list[dict[str, Any]]) -> None:
        lord = self._lord()
        if lord is None or not self._enabled:
            return
        for req in requests:
            key = (req["pid"], req["request"]["seq"])
            if key in self._served:
                continue
            self._served.add(key)
            device, nbytes = req["request"]["device"], req["request"]["bytes"]
            before = _held(lord, device)
            try:
                lord.empty_cache(device)
            except Exception as e:  # noqa: BLE001
                logger.debug("memlord pressure: empty_cache(%s): %s", device, e)
            for fn in list(_callbacks_of(lord)):
                try:
                    fn(device, nbytes)
                except Exception:  # noqa: BLE001 - one callback's bug stops no other
                    logger.exception("memlord: an on_pressure callback failed")
            released = max(0, before - _held(lord, device))
            with self._state_lock:
                self._state["served"] += 1
                self._state["released"] += released
                self._state["last_release_ns"] = time.time_ns()
            self._write()
            logger.info(
                "[pressure] pid %d asked for %d bytes on %s: released %d bytes",
                req["pid"],
                nbytes,
                device,
                released,
            )


def _held(lord: Any, device: str) -> int:
    """What this process holds on device now: reserved on CUDA, live bytes elsewhere."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            return int(torch.cuda.memory_reserved(torch.device(device)))
        except Exception:  # noqa: BLE001
            pass
    try:
        return int(lord.allocated(device)[0])
    except Exception:  # noqa: BLE001
        return 0


_served_event = threading.Event()


def _serve_requests() -> None:
    """On the main thread, between two bytecodes (a pending call), or on the heartbeat
    thread when the main thread runs no Python: serve the requests of the other
    publishers that this process has not served yet (each once)."""
    _served_event.set()
    with _serve_lock:
        _serve_requests_locked()


_serve_lock = threading.Lock()


def _serve_requests_locked() -> None:
    with _lock:
        mine = [p for p in _publishers if p.enabled and p.cooperate]
    if not mine:
        return
    now = time.time_ns()
    pid = os.getpid()
    requests = [
        r
        for r in read_all(clean=False)
        if r["request"] is not None and r["pid"] != pid and r["request"]["deadline_ns"] > now
    ]
    for p in mine:
        p._serve(requests)


def publish(lord: Any, name: str | None = None, *, cooperate: bool | None = None) -> Publisher:
    """``lord.publish()``: see :class:`Publisher` and docs/ranks.md.  ``cooperate=None``
    keeps what the lord's record says (a new record: False)."""
    if name is not None and not isinstance(name, str):
        raise TypeError(
            f"publish(): argument 'name' must be a str or None, not {type(name).__name__}"
        )
    if cooperate is not None and not isinstance(cooperate, bool):
        raise TypeError(
            "publish(): argument 'cooperate' must be a bool or None, not "
            f"{type(cooperate).__name__}"
        )
    with _lock:
        for p in _publishers:
            if p.lord is lord and p.enabled:  # one record per lord: a second call updates it
                if name is not None:
                    p.name = name
                    with p._state_lock:
                        p._state["name"] = _fit(name, 128)
                if cooperate is not None:  # a rename does not stop it cooperating
                    p.cooperate = cooperate
                    with p._state_lock:
                        p._state["cooperate"] = int(cooperate)
                p._write()
                return p
        p = Publisher(lord, name, bool(cooperate))
        _publishers.append(p)
    return p


def cooperate_from_env() -> bool:
    """``MEMLORD_COOPERATE=1``: a publishing lord answers other processes' requests."""
    return os.environ.get("MEMLORD_COOPERATE", "").strip().lower() not in _OFF


def publish_from_env(lord: Any) -> None:
    """``MEMLORD_PUBLISH=1``: a lord that turns hooks on publishes (cooperating with
    ``MEMLORD_COOPERATE=1``).  Never raises: publishing is an aid."""
    value = os.environ.get("MEMLORD_PUBLISH", "")
    if value.strip().lower() in _OFF:
        return
    if publisher_of(lord) is not None:
        return
    try:
        publish(lord, cooperate=cooperate_from_env())
    except Exception as e:  # noqa: BLE001
        logger.warning("MEMLORD_PUBLISH: could not publish: %s", e)


def publisher_of(lord: Any) -> Publisher | None:
    with _lock:
        for p in _publishers:
            if p.lord is lord and p.enabled:
                return p
    return None


_PressureFn = TypeVar("_PressureFn", bound=Callable[[str, int], object])


def on_pressure(lord: Any, fn: _PressureFn) -> _PressureFn:
    """``lord.on_pressure(fn)``: ``fn(device, nbytes)`` runs when another process asks
    for memory and this lord publishes with ``cooperate=True``.  Returns ``fn`` (usable
    as a decorator)."""
    if not callable(fn):
        raise TypeError(f"on_pressure(): argument 'fn' must be callable, not {type(fn).__name__}")
    with _lock:
        _callbacks_of(lord).append(fn)
    return fn


_lord_callbacks: weakref.WeakKeyDictionary[Any, list[Callable[[str, int], object]]] = (
    weakref.WeakKeyDictionary()
)


def _callbacks_of(lord: Any) -> list[Callable[[str, int], object]]:
    cbs = _lord_callbacks.get(lord)
    if cbs is None:
        cbs = _lord_callbacks[lord] = []
    return cbs


def free_bytes(device: torch.device) -> int | None:
    """What the device can give now: the driver's free memory (CUDA), or the kernel's
    ``MemAvailable`` (cpu)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _device_present(device: torch.device) -> bool:
    """Whether this process has the device (a CUDA one: a driver and that index)."""
    if device.type != "cuda":
        return True
    try:
        if not torch.cuda.is_available():
            return False
        return device.index is None or device.index < torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - torch could not say: it may be there
        return True


def _bump_pressure() -> None:
    path = runtime_dir() / "pressure"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, struct.pack("<Q", time.time_ns() ^ (os.getpid() << 40)), 0)
    finally:
        os.close(fd)


#: the longest wait a request's deadline records, about 126 years: the deadline is an
#: int64 of ns since the epoch, which ends in 2262
_MAX_RECORDED_WAIT_S = 4e9


def request_memory(lord: Any, device: Any, nbytes: int, *, timeout: float = 10.0) -> bool:
    """``lord.request_memory(device, nbytes, timeout=10.0)``: ask the cooperating
    publishers on this host to give memory back on ``device``; True once the device's
    free memory reaches ``nbytes``, False at the timeout."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            "request_memory(): argument 'device' must be a str or torch.device, not "
            f"{type(device).__name__}"
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"request_memory(): argument 'device': {e}") from None
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(
            f"request_memory(): argument 'nbytes' must be an int, not {type(nbytes).__name__}"
        )
    if not 0 <= nbytes < 2**63:  # the record holds an int64
        raise ValueError(
            f"request_memory(): argument 'nbytes' must be >= 0 and < 2**63, got {nbytes}"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"request_memory(): argument 'timeout' must be seconds, not {type(timeout).__name__}"
        )
    if not timeout >= 0 or timeout == float("inf"):
        raise ValueError(
            f"request_memory(): argument 'timeout' must be finite and >= 0, got {timeout!r}"
        )
    if dev.type == "cpu":
        name = "cpu"  # torch's one CPU device, as the ledger names it ("cpu:0" too)
    elif dev.index is not None:
        name = str(dev)
    elif dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        # the device free_bytes() reads: torch.cuda.mem_get_info's current device
        name = f"cuda:{torch.cuda.current_device()}"
    else:
        name = f"{dev.type}:0"
    deadline = time.monotonic() + float(timeout)
    free = free_bytes(dev)
    if free is not None and free >= nbytes:
        return True
    if free is None and not _device_present(dev):
        # its free memory can never be read here, so never seen to reach nbytes: no
        # request, no process woken for nothing
        return False
    own = publisher_of(lord)
    temporary = own is None
    if own is None:
        own = publish(lord, cooperate=False)
    try:
        # any finite timeout is valid; a longer one is recorded as the longest that fits
        wait_ns = int(min(float(timeout), _MAX_RECORDED_WAIT_S) * 1e9)
        own._set_request(name, nbytes, time.time_ns() + wait_ns)
        _bump_pressure()
        while True:
            free = free_bytes(dev)
            if free is not None and free >= nbytes:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
    finally:
        if temporary:
            own.disable()
        else:
            own._clear_request()


def _after_fork_in_child() -> None:
    with _lock:
        for p in _publishers:
            p._forget_in_child()
        _publishers.clear()


def _at_exit() -> None:
    with _lock:
        publishers = list(_publishers)
    for p in publishers:
        try:
            p.disable()
        except Exception:  # noqa: BLE001
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
