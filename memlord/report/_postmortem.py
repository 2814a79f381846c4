"""The out-of-memory post-mortem: who holds every byte at the moment a request failed.

``build_post_mortem(lords, request)`` makes a plain dict (schema ``"memlord.oom/1"``,
docs/oom.md describes every key); ``write_post_mortem(doc, directory, stem)`` writes it as
``<stem>.json``, ``<stem>.html`` (self-contained, no script fetched) and ``<stem>.pickle``
(torch's memory_viz format), each atomically and never over an existing file;
``load_post_mortem(path)`` reads a JSON document back and checks its schema.

What it reads, per device:

* memlord's ledger (``stats()``: live bytes by category) and its registry of live
  storages (lifetime tracking): bytes by birth region, by module, by call site, and the
  largest storages, each with a name a person recognises: a parameter or buffer by its
  qualified name (``encoder.layers.3.linear1.weight``), ``grad of <name>``,
  ``optimizer state exp_avg of <name>``, ``activation of <module> (forward)``, or the
  category and call site;
* on CUDA (when torch has initialised it): the caching allocator's counters
  (``torch.cuda.memory_stats``), its segments and blocks (``torch.cuda.memory._snapshot``),
  each allocated block attributed to the tracked storage whose address range holds it,
  and the bytes other processes hold (the driver's total minus free minus what this
  process reserved).

Every part is bounded (``top`` rows per table; one pass over the live storages) and
guarded: what cannot be read becomes ``None`` and a line in ``doc["notes"]``; building
never raises for a missing piece.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime as _dt
import gc
import heapq
import json
import logging
import math
import operator
import os
import pickle as _pickle
import platform
import re
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._bytes import format_bytes
from .._sites import site_frames, site_text
from ._util import _create_temp

SCHEMA = "memlord.oom/1"

log = logging.getLogger("memlord")

#: the tensors looked at to name storages (parameters, buffers, gradients, optimizer
#: state) at most: a bound on the work of naming; the rest keep their category and site
MAX_NAMED = 1_000_000
#: models (modules that are no other module's child) a scan of Python's objects names at
#: most
MAX_ROOTS = 10_000
#: blocks of the synthetic memory_viz pickle per device at most (the largest storages;
#: the rest is one block)
MAX_PICKLE_BLOCKS = 20_000
#: the error text kept at most
MAX_ERROR_CHARS = 4000
#: frames of the failed request kept at most (the innermost)
MAX_STACK = 64

_SINCE_ALL = -(2**63)
_UNNAMED = object()  # a storage no model or optimizer names

if TYPE_CHECKING:
    # a live storage as _live_storages reads it: (device name, nbytes, data pointer,
    # born_ns, site id, region name or None, dtype, requires_grad, shape, category)
    _Storage = tuple[
        str, int, int, int, int, str | None, torch.dtype | None, bool, tuple[int, ...] | None, str
    ]
_BACKWARD = " (backward)"


# ---- small helpers ----------------------------------------------------------------------


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return int(v)


def _float_or_none(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _str_or_none(v: Any, limit: int = 1000) -> str | None:
    if v is None:
        return None
    s = str(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _rank() -> tuple[int | None, int | None]:
    """(rank, world size) as a profile names them (memlord._ranks.rank_info: from
    torch.distributed when it is initialised, else from the launcher's RANK and
    WORLD_SIZE), else (None, None)."""
    from .._ranks import rank_info

    info = rank_info()
    return info.get("rank"), info.get("world_size")


def _host() -> str:
    try:
        return socket.gethostname() or "localhost"
    except OSError:
        return "localhost"


def default_stem(n: int) -> str:
    """The default name of the ``n``-th post-mortem of this process, without extension:
    ``memlord-oom-<host>-<pid>[-rank<r>]-<n>`` (the rank when torch.distributed or the
    launcher's RANK and WORLD_SIZE name one); the host name keeps letters, digits, ``.``,
    ``_`` and ``-``."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"default_stem(): argument 'n' must be an int, not {type(n).__name__}")
    if n < 0:
        raise ValueError(f"default_stem(): argument 'n' must be >= 0, not {n}")
    host = re.sub(r"[^A-Za-z0-9._-]", "_", _host())[:64] or "localhost"
    rank, _world = _rank()
    rank_part = f"-rank{rank}" if rank is not None else ""
    return f"memlord-oom-{host}-{os.getpid()}{rank_part}-{n}"


class _Notes(list[str]):
    """doc["notes"]: what could not be read, and why."""

    def guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _Guard(self, what)


class _Guard:
    def __init__(self, notes: _Notes, what: str) -> None:
        self.notes, self.what = notes, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        self.notes.append(f"{self.what}: not read ({exc_type.__name__}: {exc})"[:500])
        return True


def _device_of(d: Any) -> str | None:
    if d is None:
        return None
    try:
        dev = torch.device(d)
    except Exception:  # noqa: BLE001
        return str(d)
    if dev.type == "cuda" and dev.index is None:
        with contextlib.suppress(Exception):
            return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


# ---- naming the storages -----------------------------------------------------------------


def _tracing_types() -> tuple[type, ...]:
    from .._snapshot import _tracing_types as tt

    return tt()


class _Names:
    """(device, data pointer) of a storage -> (name, module), from the modules and
    optimizers memlord knows, else found by a scan of Python's objects."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[bool, int], tuple[str, str | None]] = {}
        self.param_names: dict[int, str] = {}  # id(parameter) -> qualified name
        self.module_names: set[str] = set()  # the qualified names of the modules named
        self.sources: list[str] = []
        self._skip = _tracing_types()
        self._count = 0

    def _add(self, t: Any, name: str, module: str | None) -> None:
        """Name t's storage, keyed by (on CUDA, data pointer): CUDA's unified addressing
        keeps the pointers of different GPUs apart.  A tensor of tracing (FakeTensor) is
        never read; a meta tensor's pointer is 0, a sparse one has no storage."""
        self._count += 1
        if self._skip and isinstance(t, self._skip):
            return
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no readable storage (sparse, nested, ...)
            return
        if ptr:
            key = (t.is_cuda, ptr)
            if key not in self.by_key:
                self.by_key[key] = (name, module)

    def add_model(self, root: torch.nn.Module) -> None:
        """Name the parameters (qualified names, as ``named_parameters()`` gives them; a
        tied parameter by its first name), their gradients and the buffers of a model:
        one walk of its modules."""
        root_name = type(root).__name__
        self.module_names.add(root_name)
        seen: set[int] = set()
        buffers = []
        for qual, mod in root.named_modules():
            if qual:
                self.module_names.add(qual)
            owner = qual or root_name
            prefix = qual + "." if qual else ""
            for pname, p in mod.__dict__.get("_parameters", {}).items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                name = prefix + pname
                self.param_names.setdefault(id(p), name)
                self._add(p, name, owner)
                g = p.grad
                if g is not None:
                    self._add(g, f"grad of {name}", owner)
            for bname, buf in mod.__dict__.get("_buffers", {}).items():
                if isinstance(buf, torch.Tensor):
                    buffers.append((buf, prefix + bname, owner))
            if self._count > MAX_NAMED:
                return
        for buf, name, owner in buffers:  # after the parameters: a parameter's name wins
            self._add(buf, name, owner)

    def add_optimizer(self, opt: Any) -> None:
        state = getattr(opt, "state", None)
        if not isinstance(state, dict):
            return
        cls = type(opt).__name__
        for p, st in list(state.items()):
            if not isinstance(st, dict):
                continue
            pname = self.param_names.get(id(p))
            if pname is None and isinstance(p, torch.Tensor):
                pname = f"a {cls} parameter {tuple(p.shape)}"
            owner = pname.rpartition(".")[0] if pname and "." in pname else None
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    self._add(v, f"optimizer state {k} of {pname}", owner)
            if self._count > MAX_NAMED:
                return


def _known_models(lords: Sequence[Any]) -> list[torch.nn.Module]:
    out: list[torch.nn.Module] = []
    for lord in lords:
        models = getattr(lord, "__dict__", {}).get("_tracked_models")
        if models is not None:
            out.extend(m for m in list(models) if isinstance(m, torch.nn.Module))
    return out


def _known_optimizers() -> list[Any]:
    from .. import _ops

    try:
        return list(_ops._state.watched.keys())
    except Exception:  # noqa: BLE001
        return []


def _scan(cls: type) -> list[Any]:
    """Every object of ``cls`` the cyclic GC knows (or gc.freeze() froze), in one C call
    during which no other thread runs (see memlord/_snapshot.py)."""
    from .._core import _gc_objects_of

    return _gc_objects_of(gc.get_objects, cls, ())


def _roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that are no other module's child and hold something (parameters,
    buffers or children)."""
    children: set[int] = set()
    for m in modules:
        sub = m.__dict__.get("_modules")
        if isinstance(sub, dict):
            children.update(id(c) for c in sub.values() if c is not None)
    return [
        m
        for m in modules
        if id(m) not in children
        and (
            m.__dict__.get("_parameters")
            or m.__dict__.get("_modules")
            or m.__dict__.get("_buffers")
        )
    ]


def collect_names(lords: Sequence[Any], notes: list[str]) -> _Names:
    """Names for the storages of the models' parameters, buffers and gradients and the
    optimizers' state: the models ``track_modules`` tracks and the optimizers stepped
    under ``hook_into_python()``, else those a scan of Python's objects finds."""
    names = _Names()
    models = _known_models(lords)
    if models:
        names.sources.append("track_modules")
    else:
        t0 = time.perf_counter()
        models = _roots(_scan(torch.nn.Module))
        names.sources.append(f"object scan ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        if len(models) > MAX_ROOTS:
            notes.append(f"naming: {len(models)} models found, the first {MAX_ROOTS} named")
            del models[MAX_ROOTS:]
    with torch._C.DisableTorchFunction():
        for m in models:
            if names._count > MAX_NAMED:
                notes.append(f"naming: stopped after {MAX_NAMED} tensors")
                break
            try:
                names.add_model(m)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"naming the parameters of a {type(m).__name__}: {exc!r}"[:500])
        opts = _known_optimizers()
        if opts:
            names.sources.append("optimizers stepped under hook_into_python()")
        else:
            opts = _scan(torch.optim.Optimizer)
            if opts:
                names.sources.append("optimizers found by the object scan")
        for o in opts:
            try:
                names.add_optimizer(o)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"naming the state of a {type(o).__name__}: {exc!r}"[:500])
    return names


def _phase_name(category: str, region: str, modules: set[str]) -> tuple[str, str | None]:
    """(name, module) of a storage made inside a region: ``activation of
    decoder.block.2 (forward)`` inside a module's region, ``... in region <r>``
    otherwise."""
    if region.endswith(_BACKWARD):
        base = region[: -len(_BACKWARD)]
        if base in modules or not modules:
            return f"{category} of {base} (backward)", base
    if region in modules:
        return f"{category} of {region} (forward)", region
    return f"{category} in region {region}", None


# ---- the live storages ---------------------------------------------------------------------


class _Group:
    __slots__ = ("bytes", "count")

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0


def _add(groups: dict[Any, _Group], key: Any, nbytes: int, count: int = 1) -> None:
    """``count`` more items of ``nbytes`` in all in ``groups[key]``."""
    g = groups.get(key)
    if g is None:
        g = groups[key] = _Group()
    g.bytes += nbytes
    g.count += count


def _table(groups: dict[Any, _Group], top: int, label: Any = None) -> dict[str, Any]:
    """The ``top`` largest groups, and the rest summed."""
    items = sorted(groups.items(), key=lambda kv: (-kv[1].bytes, str(kv[0])))
    shown = items[:top]
    rest = items[top:]
    rows = [
        {"name": label(k) if label else k, "bytes": g.bytes, "count": g.count} for k, g in shown
    ]
    return {
        "top": rows,
        "rest": {
            "groups": len(rest),
            "bytes": sum(g.bytes for _, g in rest),
            "count": sum(g.count for _, g in rest),
        },
    }


def _live_storages(lords: Sequence[Any], notes: list[str]) -> tuple[int, list[_Storage]]:
    """Every live storage the lords track, deduplicated by (device, data pointer) across
    lords: ``(device name, nbytes, ptr, born_ns, site, region name, dtype, requires_grad,
    shape, category)``; and the time of the walk."""
    out: list[_Storage] = []
    seen: set[tuple[str, int]] = set()
    now = 0
    for i, lord in enumerate(lords):
        try:
            # the registry keeps what it tracked after disable(): read it whatever the state
            now, _totals, raw = lord._live(-1, _SINCE_ALL)
            region_names = lord._region_names()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"lord {i}: its live storages: {exc!r}"[:500])
            continue
        # index -> name (None for "no region" and for names freed since)
        rnames = [None, *(n or None for n in region_names[1:])]
        nreg = len(rnames)
        devs = {d: lord._device_name(d) for d in {e[0] for e in raw}}
        if len(lords) == 1:  # one comprehension: no dedup to do
            out = [
                (devs[d], n, p, b, s, rnames[r] if r < nreg else None, dt, rg, sh, c)
                for d, n, p, b, s, r, dt, rg, sh, c in raw
            ]
            continue
        for d, n, p, b, s, r, dt, rg, sh, c in raw:
            name = devs[d]
            if p:
                key = (name, p)
                if key in seen:
                    continue
                seen.add(key)
            out.append((name, n, p, b, s, rnames[r] if r < nreg else None, dt, rg, sh, c))
    return now, out


def _ledger(lords: Sequence[Any], notes: list[str]) -> dict[str, dict[str, Any]]:
    """Per device, the ledger of the first lord that counted it."""
    out: dict[str, dict[str, Any]] = {}
    for i, lord in enumerate(lords):
        try:
            stats = lord.stats()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"lord {i}: stats(): {exc!r}"[:500])
            continue
        for dev, s in stats.items():
            if dev in out:
                continue
            out[dev] = {
                "lord": i,
                "allocated": int(s.get("allocated", 0)),
                "peak_allocated": int(s.get("peak_allocated", 0)),
                "allocs": int(s.get("allocs", 0)),
                "frees": int(s.get("frees", 0)),
                "gc_runs": int(s.get("gc_runs", 0)),
                "categories": {k: int(v) for k, v in s.get("categories", {}).items()},
                "peak_categories": {k: int(v) for k, v in s.get("peak_categories", {}).items()},
            }
    return out


def _lords_section(lords: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for i, lord in enumerate(lords):
        d: dict[str, Any] = {"index": i}
        for key, fn in (
            ("lifetime_tracking", lambda lord=lord: bool(lord._life_active())),
            ("recording_events", lambda lord=lord: int(lord.events_capacity) > 0),
            ("allocated", lambda lord=lord: {k: v["allocated"] for k, v in lord.stats().items()}),
        ):
            try:
                d[key] = fn()
            except Exception:  # noqa: BLE001
                d[key] = None
        out.append(d)
    return out


# ---- CUDA: the allocator's view ------------------------------------------------------------


_STATS_KEYS = {
    "allocated": "allocated_bytes.all.current",
    "allocated_peak": "allocated_bytes.all.peak",
    "reserved": "reserved_bytes.all.current",
    "reserved_peak": "reserved_bytes.all.peak",
    "active": "active_bytes.all.current",
    "inactive_split": "inactive_split_bytes.all.current",
    "requested": "requested_bytes.all.current",
    "segments": "segment.all.current",
    "allocations": "allocation.all.current",
    "retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def allocator_stats(stats: dict[str, Any]) -> dict[str, int | None]:
    """The caching allocator's counters of one device, from ``torch.cuda.memory_stats(i)``
    (missing keys: None)."""
    out: dict[str, int | None] = {}
    for k, src in _STATS_KEYS.items():
        v = stats.get(src)
        out[k] = int(v) if isinstance(v, (int, float)) else None
    return out


def _cuda_index(device: str) -> int | None:
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


_MIB = 1 << 20
_CUBLAS_CONFIG = re.compile(r":([0-9]+):([0-9]+)")


def library_workspace_sizes(
    major: int | None, environ: Mapping[str, str] | None = None
) -> dict[int, str]:
    """The sizes of the workspaces torch gives cuBLAS and cuBLASLt on a CUDA device of
    compute capability ``major`` (``{bytes: name}``), computed as torch's
    ``CublasHandlePool.cpp`` computes them: cuBLAS's from ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE:COUNT`` pairs, SIZE in KiB) or the default (32 MiB on Hopper and
    Blackwell, ``:4096:2:16:8`` = 8 MiB + 128 KiB before); cuBLASLt's own from
    ``CUBLASLT_WORKSPACE_SIZE`` (KiB) or 1 MiB. Newer torch lets cuBLASLt share cuBLAS's
    workspace (then no block has cuBLASLt's size); torch 2.11 on an H100 kept a 1 MiB
    cuBLASLt workspace beside two 32 MiB cuBLAS ones. With
    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` set true no cuBLASLt size is looked for.

    torch allocates them per handle (or device) and stream through the caching
    allocator: no tensor's storage, so no tracked storage holds them. The post-mortem
    names an untracked block of exactly such a size (asked for with exactly that size) a
    library workspace: nothing is read from torch's handles, nothing is allocated or
    released. Empty for ROCm (its sizes depend on the GPU's name) and for an unknown
    device."""
    env = os.environ if environ is None else environ
    if major is None or getattr(torch.version, "hip", None):
        return {}
    cublas = 32 * _MIB if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is not None:
        pairs = _CUBLAS_CONFIG.findall(config)
        if pairs:
            cublas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    out = {cublas: "cuBLAS workspace"} if cublas > 0 else {}
    unified = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "").strip().upper()
    if unified in ("1", "ON", "YES", "TRUE", "Y"):
        return out
    lt = _MIB
    raw = env.get("CUBLASLT_WORKSPACE_SIZE")
    if raw is not None:
        with contextlib.suppress(ValueError):
            lt = int(raw.strip()) * 1024
    if lt > 0:
        out[lt] = "cuBLAS/cuBLASLt workspace" if lt in out else "cuBLASLt workspace"
    return out


def attribute_blocks(
    segments: Iterable[dict[str, Any]],
    storages: Sequence[tuple[int, int, str]],
    device_index: int,
    top: int = 20,
    library_sizes: Mapping[int, str] | None = None,
) -> dict[str, Any]:
    """Attribute the allocator's blocks of one device to tracked storages (a pure function
    of ``torch.cuda.memory._snapshot()["segments"]``' format).

    ``storages``: ``(data pointer, nbytes, name)`` of the live tracked storages of that
    device.  A block in use (``active_allocated``; ``active_awaiting_free`` counts apart)
    belongs to the tracked storage whose address range ``[ptr, ptr + nbytes)`` holds the
    block's start, or that starts inside the block; else it is ``untracked``.  A block
    without an ``address`` (older torch) is placed after the one before it in its segment.

    An untracked block whose size (and requested size) is one of ``library_sizes`` is
    named a library workspace (``library_workspace_sizes``).

    Returns the segments' count and reserved bytes, the bytes of blocks allocated,
    awaiting free and inactive, the allocated bytes attributed and untracked, the
    fraction attributed, the untracked bytes named library workspaces and what is left
    unexplained, the ``top`` largest untracked blocks (with their frames, when the
    allocator recorded them, and their library name or None) and the ``top`` storages
    holding the most blocks' bytes.
    """
    sizes = dict(library_sizes or {})
    library: dict[str, _Group] = {}
    library_bytes = 0
    ordered = sorted((int(p), int(n), str(nm)) for p, n, nm in storages if p)
    ptrs = [p for p, _n, _nm in ordered]
    n_segments = reserved = allocated = awaiting = inactive = attributed = 0
    untracked: list[dict[str, Any]] = []
    held: dict[str, _Group] = {}
    for seg in segments:
        if not isinstance(seg, dict) or int(seg.get("device", device_index)) != device_index:
            continue
        n_segments += 1
        reserved += int(seg.get("total_size", 0))
        addr = int(seg.get("address", 0))
        for blk in seg.get("blocks", ()):
            size = int(blk.get("size", 0))
            start = int(blk.get("address", addr))
            addr = start + size
            state = blk.get("state")
            if state == "inactive":
                inactive += size
                continue
            if state != "active_allocated":
                awaiting += size
                continue
            allocated += size
            owner = None
            i = bisect.bisect_right(ptrs, start + max(size, 1) - 1) - 1
            if i >= 0:
                p, n, nm = ordered[i]
                if p >= start or p + max(n, 1) > start:
                    owner = nm
            if owner is None:
                requested = int(blk.get("requested_size", size))
                lib = sizes.get(size) if requested == size else None
                if lib is not None:
                    library_bytes += size
                    _add(library, lib, size)
                untracked.append(
                    {
                        "address": start,
                        "size": size,
                        "requested_size": requested,
                        "frames": list(blk.get("frames", ()))[:8],
                        "library": lib,
                    }
                )
            else:
                attributed += size
                _add(held, owner, size)
    untracked.sort(key=lambda b: (-b["size"], b["address"]))
    return {
        "segments": n_segments,
        "reserved": reserved,
        "allocated": allocated,
        "awaiting_free": awaiting,
        "inactive": inactive,
        "attributed": attributed,
        "untracked": allocated - attributed,
        "untracked_blocks_count": len(untracked),
        "attributed_fraction": (attributed / allocated) if allocated else None,
        "library_workspaces": {
            "bytes": library_bytes,
            "by_name": {
                name: {"bytes": g.bytes, "blocks": g.count} for name, g in sorted(library.items())
            },
            "sizes": {str(k): v for k, v in sorted(sizes.items())},
        },
        "explained": attributed + library_bytes,
        "explained_fraction": ((attributed + library_bytes) / allocated) if allocated else None,
        "unexplained": allocated - attributed - library_bytes,
        "untracked_blocks": untracked[:top],
        "by_storage": _table(held, top),
    }


def _cuda_ready() -> bool:
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def _cuda_sections(
    devices: dict[str, dict[str, Any]],
    storages_by_dev: dict[str, list[tuple[int, int, str]]],
    request: dict[str, Any],
    top: int,
    notes: _Notes,
) -> dict[str, Any] | None:
    """Fill each CUDA device's ``allocator``, ``segments`` and ``driver``; returns torch's
    memory snapshot (for the pickle), or None."""
    if not _cuda_ready():
        if any(_cuda_index(d) is not None for d in devices):
            notes.append("CUDA: torch has not initialised CUDA: no allocator view")
        return None
    with notes.guard("CUDA devices"):
        for i in range(torch.cuda.device_count()):
            devices.setdefault(f"cuda:{i}", _empty_device())
    snap: dict[str, Any] | None = None
    with notes.guard("torch.cuda.memory._snapshot()"):
        snap = torch.cuda.memory._snapshot()
    observer = request.get("cuda") if isinstance(request.get("cuda"), dict) else None
    req_dev = request.get("device")
    for dev, d in devices.items():
        idx = _cuda_index(dev)
        if idx is None:
            continue
        with notes.guard(f"{dev}: torch.cuda.memory_stats"):
            d["allocator"] = allocator_stats(torch.cuda.memory_stats(idx))
        if snap is not None:
            with notes.guard(f"{dev}: segments"):
                major = None
                with notes.guard(f"{dev}: compute capability"):
                    major = int(torch.cuda.get_device_capability(idx)[0])
                d["segments"] = attribute_blocks(
                    snap.get("segments", ()),
                    storages_by_dev.get(dev, ()),
                    idx,
                    top,
                    library_workspace_sizes(major),
                )
        with notes.guard(f"{dev}: the driver's free and total bytes"):
            free, total = torch.cuda.mem_get_info(idx)
            reserved = int(torch.cuda.memory_reserved(idx))
            drv: dict[str, Any] = {
                "total": int(total),
                "free": int(free),
                "reserved": reserved,
                "other_processes": max(int(total) - int(free) - reserved, 0),
            }
            if observer is not None and dev == req_dev:
                drv["observer_device_free"] = _int_or_none(observer.get("device_free"))
                drv["observer_device_allocated"] = _int_or_none(observer.get("device_allocated"))
            d["driver"] = drv
    return snap


# ---- the memory_viz snapshot of the same moment -----------------------------------------------


def synthetic_snapshot(
    doc: dict[str, Any],
    live: list[_Storage],
    names: dict[tuple[bool, int], tuple[str, str | None]],
    lords: Sequence[Any],
) -> dict[str, Any]:
    """A torch memory snapshot dict of the live storages: one segment per device, one
    ``active_allocated`` block per live storage (largest first, at most
    ``MAX_PICKLE_BLOCKS``, the rest one block), each with its birth site's frames; the
    device traces of the lords' event ring when one records, and an ``oom`` entry for the
    failed request.

    The trace's addresses are the segment's, as torch's readers match them: an allocation
    the ring leaves alive has the address of the block of its storage (a storage among the
    rest gets a block of its own then), or, when no live storage has its data pointer, a
    block of its own after the storages'; every other allocation an address of its own
    while it lives, after the active blocks, where the segment ends in one ``inactive``
    block that holds them."""
    from ._pickle import (
        SEGMENT_BASE,
        SEGMENT_STRIDE,
        _frames,
        device_indices,
        device_names,
        live_at_end,
        remap_traces,
        segment,
        site_table,
    )

    devices = sorted(doc["devices"])
    index = device_indices(devices)
    prof = None
    for lord in lords:  # the ring's history, when a lord records
        try:
            if int(lord.events_capacity) <= 0:
                continue
            from ._lord import profile_from_lord

            prof = profile_from_lord(lord, top=0)
            break
        except Exception:  # noqa: BLE001 - the traces are a bonus
            continue
    # per device, the ring's allocations still alive: data pointer -> alloc event
    ring_live: dict[str, dict[int, int]] = {}
    ring_bytes: list[int] = []
    ring_sites: list[int] = []
    site_names: list[str] = []
    table = None
    if prof is not None:
        with contextlib.suppress(Exception):
            ring_live = live_at_end(prof)
            ring_bytes = prof.events["bytes"].tolist()
            ring_sites = prof.events["site"].tolist()
            site_names = list(prof.events.sites)
            table = site_table(prof)
    by_dev: dict[str, list[_Storage]] = {d: [] for d in devices}
    for e in live:
        by_dev.setdefault(e[0], []).append(e)
    frames_of: dict[int, list[dict[str, Any]]] = {}
    layout: dict[str, tuple[int, int]] = {}
    blocks_of: dict[str, list[dict[str, Any]]] = {}
    block_at: dict[int, int] = {}  # a ring allocation's alloc event -> its block's address
    # in the order of the devices' indices (CUDA devices first, at their own index; a GPU
    # host's post-mortem lists every one, so segments[i] is memlord_devices[i]'s there)
    for dev in sorted(devices, key=index.__getitem__):
        entries = by_dev.get(dev, [])
        alive = dict(ring_live.get(dev, {}))
        # a storage is the ring's allocation when its data pointer and size are the same
        matched: dict[int, int] = {}  # id of a storage entry -> its alloc event
        for e in entries if alive else ():
            i = alive.get(e[2]) if e[2] else None
            if i is not None and ring_bytes[i] == e[1]:
                matched[id(e)] = i
                del alive[e[2]]
        kept = _largest(entries, MAX_PICKLE_BLOCKS)
        if matched and len(kept) < len(entries):  # the ring's storages among the rest
            chosen = {id(e) for e in kept}
            kept += [e for e in entries if id(e) in matched and id(e) not in chosen]
            kept.sort(key=lambda e: (-e[1], e[3]))
        rest_bytes = sum(e[1] for e in entries) - sum(e[1] for e in kept)
        rest_count = len(entries) - len(kept)
        base = SEGMENT_BASE + index[dev] * SEGMENT_STRIDE
        blocks = []
        offset = 0
        for e in kept:
            site = e[4]
            fr = frames_of.get(site)
            if fr is None:
                fr = frames_of[site] = site_frames(site) if site else []
            hit = names.get((dev[:4] == "cuda", e[2])) if e[2] else None
            i = matched.get(id(e))
            if i is not None:
                block_at[i] = base + offset
            blocks.append(
                {
                    "address": base + offset,
                    "size": e[1],
                    "requested_size": e[1],
                    "state": "active_allocated",
                    "frames": fr,
                    "memlord_name": hit[0] if hit is not None else None,
                    "memlord_category": e[9],
                }
            )
            offset += e[1]
        if rest_count:
            size = rest_bytes
            blocks.append(
                {
                    "address": base + offset,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": [],
                    "memlord_name": f"{rest_count} smaller storages",
                }
            )
            offset += size
        # the ring's allocations no live storage stands for (lifetime tracking off, a
        # storage no lord tracks, a free the ring did not record): a block each, so that
        # the trace's allocations never freed are blocks of the segment, counted once
        for _ptr, i in sorted(alive.items()):
            size = ring_bytes[i]
            site_i = ring_sites[i]
            block_at[i] = base + offset
            blocks.append(
                {
                    "address": base + offset,
                    "size": size,
                    "requested_size": size,
                    "state": "active_allocated",
                    "frames": _frames(site_names[site_i] if site_i >= 0 else None, table),
                    "memlord_name": "allocated in the event ring, not among the live storages",
                }
            )
            offset += size
        layout[dev] = (base, offset)
        blocks_of[dev] = blocks
    n_traces = max(index.values(), default=-1) + 1
    traces: list[list[dict[str, Any]]] = [[] for _ in range(n_traces)]
    slots: dict[str, int] = {}
    if prof is not None:
        with contextlib.suppress(Exception):  # the traces are a bonus
            traces, slots = remap_traces(prof, index, layout, block_at, table)
    segments = []
    for dev in sorted(devices, key=index.__getitem__):
        base, offset = layout[dev]
        blocks = blocks_of[dev]
        used = slots.get(dev, 0)
        if used:  # the addresses of the trace's freed allocations
            blocks.append(
                {
                    "address": base + offset,
                    "size": used,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        segments.append(segment(index[dev], dev, base, offset + used, offset, blocks))
    req = doc.get("request") or {}
    rdev = req.get("device")
    if rdev in index:
        frames = [
            {
                "filename": f.get("file", "?"),
                "line": int(f.get("line") or 0),
                "name": f.get("function", "?"),
            }
            for f in reversed(req.get("stack") or [])
            if isinstance(f, dict)
        ]
        traces[index[rdev]].append(
            {
                "action": "oom",
                "addr": 0,
                "size": int(req.get("bytes") or 0),
                "stream": 0,
                "time_us": int(float(doc.get("time") or 0) * 1e6),
                "device_free": 0,
                "frames": frames,
            }
        )
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {
            "backend": "memlord (synthetic segments: one per device, a block per live storage)",
            "expandable_segments": False,
        },
        "memlord_devices": device_names(index),
    }


# ---- building the document --------------------------------------------------------------------


def _empty_device() -> dict[str, Any]:
    return {
        "ledger": None,
        "tracked": {"bytes": 0, "count": 0},
        "coverage": None,
        "categories": None,
        "by_region": None,
        "by_module": None,
        "by_site": None,
        "largest": [],
        "allocator": None,
        "segments": None,
        "driver": None,
    }


def _request_section(
    request: dict[str, Any], lords: Sequence[Any], modules: set[str]
) -> dict[str, Any]:
    stack = []
    for f in list(request.get("stack") or [])[-MAX_STACK:]:
        if isinstance(f, dict):
            stack.append(
                {
                    "file": _str_or_none(f.get("file")),
                    "line": _int_or_none(f.get("line")),
                    "function": _str_or_none(f.get("function")),
                }
            )
    thread = request.get("thread")
    if isinstance(thread, dict):
        thread = {"id": _int_or_none(thread.get("id")), "name": _str_or_none(thread.get("name"))}
    else:
        cur = threading.current_thread()
        thread = {"id": threading.get_ident(), "name": cur.name}
    nbytes = _int_or_none(request.get("bytes"))
    cuda = request.get("cuda")
    regions = request.get("regions")
    if isinstance(regions, (list, tuple)):
        regions = [str(r) for r in regions]
    else:
        regions = _open_module_regions(lords)
    module = _str_or_none(request.get("module"))
    if module is None:
        for r in reversed(regions):
            base = r[: -len(_BACKWARD)] if r.endswith(_BACKWARD) else r
            if base in modules or r.endswith(_BACKWARD):
                module = r
                break
    return {
        "device": _device_of(request.get("device")),
        "bytes": nbytes,
        "bytes_text": format_bytes(nbytes) if nbytes is not None and nbytes >= 0 else None,
        "what": _str_or_none(request.get("what")),
        "source": _str_or_none(request.get("source")),
        "site": _str_or_none(request.get("site")),
        "stack": stack,
        "thread": thread,
        "regions": regions,
        "module": module,
        "error": _str_or_none(request.get("error"), MAX_ERROR_CHARS),
        "time": _float_or_none(request.get("time")),
        "cuda": (
            {
                "device_allocated": _int_or_none(cuda.get("device_allocated")),
                "device_free": _int_or_none(cuda.get("device_free")),
            }
            if isinstance(cuda, dict)
            else None
        ),
    }


def _open_module_regions(lords: Sequence[Any]) -> list[str]:
    """The regions ``track_modules`` has open on the calling thread, outermost first."""
    out: list[str] = []
    for lord in lords:
        trackers = getattr(lord, "__dict__", {}).get("_module_trackers")
        if not trackers:
            continue
        for tracker in list(trackers):
            stack = getattr(getattr(tracker, "_local", None), "stack", None) or ()
            for entry in list(stack):
                with contextlib.suppress(Exception):
                    out.append(str(entry[1].name))
    return out


def build_post_mortem(lords: Any, request: dict[str, Any], *, top: int = 20) -> dict[str, Any]:
    """The post-mortem document of a failed request (schema ``SCHEMA``, docs/oom.md).

    ``lords``: the lords watching (a sequence of MemLord, or one); ``request``: what
    failed (keys ``device``, ``bytes``, ``what``, ``source``, ``site``, ``stack``,
    ``thread``, ``error``, ``time``, ``cuda``, each may be None or missing).  ``top``
    bounds every table.  Never raises for a piece it cannot read: that piece is None and
    ``doc["notes"]`` says why."""
    if isinstance(top, bool) or not isinstance(top, int):
        raise TypeError(
            f"build_post_mortem(): argument 'top' must be an int, not {type(top).__name__}"
        )
    if top < 0:
        raise ValueError(f"build_post_mortem(): argument 'top' must be >= 0, not {top}")
    if request is None:
        request = {}
    if not isinstance(request, dict):
        raise TypeError(
            f"build_post_mortem(): argument 'request' must be a dict, not {type(request).__name__}"
        )
    if lords is None:
        lords = []
    elif hasattr(lords, "_live"):  # one lord
        lords = [lords]
    elif not isinstance(lords, (list, tuple)):
        try:
            lords = list(lords)
        except TypeError:
            raise TypeError(
                "build_post_mortem(): argument 'lords' must be a MemLord or a sequence of them, "
                f"not {type(lords).__name__}"
            ) from None
    # the cyclic GC off while building: the document's objects would otherwise trigger
    # collections over the whole heap (a model's every tensor) many times over
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(lords, request, top)
    finally:
        if gc_was_enabled:
            gc.enable()


def _build(lords: Sequence[Any], request: dict[str, Any], top: int) -> dict[str, Any]:
    t_start = time.perf_counter()
    notes = _Notes()
    when = request.get("time")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
        when = time.time()
    rank, world = _rank()
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "time": float(when),
        "time_iso": _iso(float(when)),
        "host": _host(),
        "pid": os.getpid(),
        "rank": rank,
        "world_size": world,
        "argv": [str(a)[:500] for a in sys.argv[:32]],
        "versions": {
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "memlord": _memlord_version(),
        },
        "top": top,
        "request": None,
        "lords": _lords_section(lords),
        "naming": None,
        "devices": {},
        "notes": notes,
        "build_s": None,
    }
    # what the registry and the models say
    with torch._C.DisableTorchFunction():
        now_live: tuple[int, list[_Storage]] = (0, [])
        with notes.guard("the live storages"):
            now_live = _live_storages(lords, notes)
        if not now_live[1] and not any(d.get("lifetime_tracking") for d in doc["lords"]):
            notes.append(
                "lifetime tracking is off in every lord: no live storages to name "
                "(turn it on with lord.hook_into_python())"
            )
        names = _Names()
        with notes.guard("naming the storages"):
            names = collect_names(lords, notes)
        doc["naming"] = {"sources": names.sources, "named_storages": len(names.by_key)}
        with notes.guard("the failed request"):
            doc["request"] = _request_section(request, lords, names.module_names)
        if doc["request"] is None:
            doc["request"] = {"device": _device_of(request.get("device"))}
        ledger = {}
        with notes.guard("the ledger"):
            ledger = _ledger(lords, notes)
        now_ns, live = now_live
        devices: dict[str, dict[str, Any]] = doc["devices"]
        for dev in ledger:
            devices.setdefault(dev, _empty_device())["ledger"] = ledger[dev]
        rdev = doc["request"].get("device")
        if isinstance(rdev, str):
            devices.setdefault(rdev, _empty_device())
        storages_by_dev: dict[str, list[tuple[int, int, str]]] = {}
        with notes.guard("attributing the live storages"):
            storages_by_dev = _attribute_live(devices, live, names, now_ns, top)
        snap = None
        with notes.guard("the CUDA allocator"):
            snap = _cuda_sections(devices, storages_by_dev, request, top, notes)
    doc["devices"] = dict(sorted(devices.items()))
    # the memory_viz snapshot of the same moment (in memory only: keys with "_" are not
    # written to the JSON)
    if snap is not None and _cuda_index(str(rdev)) is not None:
        # a CUDA request: torch's own snapshot of the moment (a CPU request's pickle
        # shows memlord's storages of every device instead)
        doc["_memory_snapshot"] = snap
        doc["pickle_source"] = "torch.cuda.memory._snapshot()"
    else:
        with notes.guard("the memory_viz snapshot"):
            doc["_memory_snapshot"] = synthetic_snapshot(doc, live, names.by_key, lords)
            doc["pickle_source"] = "memlord (live storages)"
    doc["notes"] = list(notes)
    doc["build_s"] = round(time.perf_counter() - t_start, 6)
    return doc


def _iso(when: float) -> str | None:
    try:
        return _dt.datetime.fromtimestamp(when, _dt.timezone.utc).isoformat()
    except (OverflowError, ValueError, OSError):
        return None


def _memlord_version() -> str | None:
    try:
        from memlord import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001
        return None


def _attribute_live(
    devices: dict[str, dict[str, Any]],
    live: list[_Storage],
    names: _Names,
    now_ns: int,
    top: int,
) -> dict[str, list[tuple[int, int, str]]]:
    """Fill each device's tracked totals, coverage, tables and largest storages from the
    live storages; returns, per CUDA device, ``(ptr, nbytes, name)`` of each storage (for
    the allocator's blocks).

    One pass sums the storages by (device, category, region, site, module, named); the
    tables are made from those groups, which are few: a loop's storages share one."""
    by_key = names.by_key
    modules = names.module_names
    per_dev: dict[str, list[_Storage]] = {}
    for e in live:
        lst = per_dev.get(e[0])
        if lst is None:
            lst = per_dev[e[0]] = []
        lst.append(e)
    # (device, category, region, site, module name or _UNNAMED) -> [bytes, count]
    groups: dict[tuple[str, str, str | None, int, object], list[int]] = {}
    for dev, entries in per_dev.items():
        cu = dev.startswith("cuda")
        for e in entries:
            hit = by_key.get((cu, e[2])) if e[2] else None
            key = (dev, e[9], e[5], e[4], hit[1] if hit is not None else _UNNAMED)
            g = groups.get(key)
            if g is None:
                groups[key] = [e[1], 1]
            else:
                g[0] += e[1]
                g[1] += 1
    phase_cache: dict[tuple[str, str], tuple[str, str | None]] = {}

    def phase(cat: str, region: str) -> tuple[str, str | None]:
        got = phase_cache.get((cat, region))
        if got is None:
            got = phase_cache[(cat, region)] = _phase_name(cat, region, modules)
        return got

    tables: dict[str, dict[str, Any]] = {}
    for (dev, cat, region, site, module), (nbytes, count) in groups.items():
        t = tables.get(dev)
        if t is None:
            t = tables[dev] = {
                "bytes": 0,
                "count": 0,
                "with_category": 0,
                "with_site": 0,
                "named": 0,
                "cats": {},
                "regions": {},
                "modules": {},
                "sites": {},
            }
        t["bytes"] += nbytes
        t["count"] += count
        if cat != "other":
            t["with_category"] += nbytes
        if site:
            t["with_site"] += nbytes
        if module is _UNNAMED:
            module = phase(cat, region)[1] if region else None
        else:
            t["named"] += nbytes
        for table, k in (
            (t["cats"], cat),
            (t["regions"], region),
            (t["modules"], module),
            (t["sites"], site),
        ):
            _add(table, k, nbytes, count)

    def name_of(e: _Storage) -> str | None:
        hit = by_key.get((e[0][:4] == "cuda", e[2])) if e[2] else None
        if hit is not None:
            return hit[0]
        if e[5]:
            return phase(e[9], e[5])[0]
        return None

    site_texts: dict[int, str | None] = {}

    def text(site: int) -> str | None:
        if site not in site_texts:
            site_texts[site] = site_text(site) if site else None
        return site_texts[site]

    cuda_storages: dict[str, list[tuple[int, int, str]]] = {}
    for dev, t in tables.items():
        d = devices.setdefault(dev, _empty_device())
        d["tracked"] = {"bytes": t["bytes"], "count": t["count"]}
        d["coverage"] = {
            "bytes": t["bytes"],
            "with_category": t["with_category"],
            "with_site": t["with_site"],
            "named": t["named"],
        }
        d["by_category"] = _table(t["cats"], len(t["cats"]))
        d["by_region"] = _table(t["regions"], top)
        d["by_module"] = _table(t["modules"], top)
        d["by_site"] = _table(t["sites"], top, text)
        largest = _largest(per_dev[dev], top)
        rows = []
        for e in largest:
            row = _entry(e, name_of(e), now_ns)
            row["site"] = text(row.pop("_site"))
            if row["name"] is None:
                row["name"] = f"{row['category']} at {row['site'] or 'an unknown site'}"
            rows.append(row)
        d["largest"] = rows
        if dev.startswith("cuda"):
            out = cuda_storages[dev] = []
            for e in per_dev[dev]:
                nm = name_of(e) or f"{e[9]} at {text(e[4]) or 'an unknown site'}"
                out.append((e[2], e[1], nm))
    for d in devices.values():
        led = d.get("ledger")
        d["categories"] = dict(led["categories"]) if led else None
        if led is not None:
            d["untracked_ledger_bytes"] = max(led["allocated"] - d["tracked"]["bytes"], 0)
    return cuda_storages


def _largest(entries: list[_Storage], n: int) -> list[_Storage]:
    """The n largest storages, largest first (ties: older first)."""
    got = heapq.nlargest(n, entries, key=_NBYTES) if n < len(entries) else list(entries)
    got.sort(key=lambda e: (-e[1], e[3]))
    return got


_NBYTES = operator.itemgetter(1)


def _entry(e: _Storage, name: str | None, now_ns: int) -> dict[str, Any]:
    dev, nbytes, ptr, born, site, region, dtype, rg, shape, cat = e
    return {
        "name": name,
        "nbytes": nbytes,
        "category": cat,
        "device": dev,
        "shape": list(shape) if shape is not None else None,
        "dtype": None if dtype is None else str(dtype),
        "requires_grad": bool(rg),
        "_site": site,
        "region": region,
        "age_s": round(max(now_ns - born, 0) / 1e9, 6) if now_ns else None,
        "address": ptr,
    }


# ---- writing and reading ----------------------------------------------------------------------


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def to_json(doc: dict[str, Any]) -> str:
    """The document as JSON text (keys beginning with ``_`` are left out)."""
    return json.dumps(_public(doc), indent=1, default=str, allow_nan=False)


def _create_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and never over an existing file: a temporary
    file of its own, then a hard link to ``path`` (which fails when ``path`` exists),
    then the temporary name removed.  Where the file system has no hard links, a rename
    after a check."""
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:
            if path.exists():
                raise FileExistsError(17, "File exists", str(path)) from None
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def write_post_mortem(
    doc: dict[str, Any],
    directory: str | os.PathLike[str],
    stem: str,
    *,
    html: bool = True,
    pickle: bool = True,
) -> dict[str, str]:
    """Write ``<directory>/<stem>.json`` (and ``.html``, ``.pickle``), each atomically and
    never over an existing file; returns ``{"json": path, ...}`` for what was written.

    ``FileExistsError`` before anything is written when ``<stem>.json`` exists; an
    ``OSError`` of the JSON file reaches the caller.  The HTML page and the pickle are
    extras: a failure of either is logged on the ``memlord`` logger and leaves it out of
    the result."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"write_post_mortem(): 'doc' must be a post-mortem ({SCHEMA}) document")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            "write_post_mortem(): argument 'directory' must be a str or os.PathLike, not "
            + type(directory).__name__
        )
    if not isinstance(stem, str) or not stem or "/" in stem or os.sep in stem:
        raise ValueError(f"write_post_mortem(): argument 'stem' must be a file name, not {stem!r}")
    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        # not FileExistsError: that one means "this name is taken, try the next"
        raise NotADirectoryError(20, "Not a directory", str(folder))
    base = folder / stem
    json_path = base.with_name(stem + ".json")
    if json_path.exists():
        raise FileExistsError(17, "File exists", str(json_path))
    text = to_json(doc)
    folder.mkdir(parents=True, exist_ok=True)
    _create_new(json_path, text.encode("utf-8"))
    out = {"json": str(json_path)}
    if html:
        path = base.with_name(stem + ".html")
        try:
            _create_new(path, render_html(doc).encode("utf-8"))
            out["html"] = str(path)
        except Exception:  # noqa: BLE001 - the JSON is written; the page is an extra
            log.exception("memlord: the post-mortem's HTML page %s was not written", path)
    if pickle:
        snap = doc.get("_memory_snapshot")
        if snap is not None:
            path = base.with_name(stem + ".pickle")
            try:
                _create_new(path, _pickle.dumps(snap, protocol=_pickle.HIGHEST_PROTOCOL))
                out["pickle"] = str(path)
            except Exception:  # noqa: BLE001
                log.exception("memlord: the post-mortem's pickle %s was not written", path)
    return out


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "time": (int, float),
    "host": str,
    "pid": int,
    "request": dict,
    "devices": dict,
    "notes": list,
}


def validate_post_mortem(doc: Any, where: str = "post-mortem") -> dict[str, Any]:
    """Check a document's schema and top-level keys; ValueError naming what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: not a post-mortem: a JSON object was expected")
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{where}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    for key, typ in _REQUIRED.items():
        if key not in doc:
            raise ValueError(f"{where}: key {key!r} is missing")
        if not isinstance(doc[key], typ) or isinstance(doc[key], bool):
            raise ValueError(f"{where}: key {key!r} has the wrong type ({type(doc[key]).__name__})")
    for dev, d in doc["devices"].items():
        if not isinstance(d, dict):
            raise ValueError(f"{where}: devices[{dev!r}] is not an object")
    return doc


def load_post_mortem(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a post-mortem's JSON file and check its schema (``ValueError`` otherwise)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "load_post_mortem(): argument 'path' must be a str or os.PathLike, not "
            + type(path).__name__
        )
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)}: not JSON ({exc})") from None
    return validate_post_mortem(doc, os.fspath(path))


def render_html(doc: dict[str, Any]) -> str:
    """The post-mortem as one self-contained HTML page (nothing fetched)."""
    from ._postmortem_html import render

    return render(doc)


__all__ = [
    "SCHEMA",
    "attribute_blocks",
    "build_post_mortem",
    "default_stem",
    "load_post_mortem",
    "render_html",
    "synthetic_snapshot",
    "validate_post_mortem",
    "write_post_mortem",
]
