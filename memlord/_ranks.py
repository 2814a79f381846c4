"""Several ranks: each rank's compact summary, gathered over a process group.

``lord.gather(group=None, *, top=5)`` is a collective: every rank of the group calls
it at the same point of the program (after a step, say), the way it calls any
``torch.distributed`` collective.  Each rank builds its own summary first (host, pid,
rank, devices with live and peak bytes by category, OOMs, top allocation sites, top
regions), then ``all_gather_object`` hands every rank the list of all of them, in the
group's rank order.  It works over any backend torch's ``all_gather_object`` takes (gloo
on the CPU; NCCL on GPUs, where torch needs ``torch.cuda.set_device`` to have been
called, as for any NCCL object collective).

:func:`rank_info` is the rank a file names: the profiler's default JSON name gains
``_rank<r>`` with it, and profiles carry it in their metadata, so ``python -m memlord
merge`` can put the files of a job side by side (docs/ranks.md).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

#: the summary's keys, in order (docs/api.md#gather)
SUMMARY_KEYS = (
    "host",
    "pid",
    "rank",
    "world_size",
    "backend",
    "time",
    "devices",
    "categories",
    "ooms",
    "top_sites",
    "regions",
)


def _dist() -> Any:
    """``torch.distributed`` when it is available and initialised, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    try:
        if dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001 - a broken process group names no rank
        return None
    return None


def host_name() -> str:
    try:
        return socket.gethostname()
    except OSError:  # pragma: no cover
        return "localhost"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n >= 0 else None


def rank_info() -> dict[str, Any]:
    """``{"rank": r, "world_size": n}`` of this process: from ``torch.distributed`` when
    it is initialised, else from the ``RANK`` and ``WORLD_SIZE`` variables a launcher
    (torchrun) sets, so a profile written at exit, after ``destroy_process_group()``,
    still names its rank; ``{}`` when neither says."""
    dist = _dist()
    if dist is not None:
        try:
            return {"rank": int(dist.get_rank()), "world_size": int(dist.get_world_size())}
        except Exception:  # noqa: BLE001 - fall back to the launcher's variables
            pass
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is not None and world is not None and rank < world:
        return {"rank": rank, "world_size": world}
    return {}


def rank_metadata() -> dict[str, Any]:
    """What a profile's metadata says of where it was written: ``host``, and ``rank`` and
    ``world_size`` when :func:`rank_info` knows them."""
    return {"host": host_name(), **rank_info()}


def _check_top(top: Any) -> int:
    if isinstance(top, bool) or not isinstance(top, int):
        raise TypeError("gather(): argument 'top' must be an int, not " + type(top).__name__)
    if top < 0:
        raise ValueError(f"gather(): argument 'top' must be >= 0, not {top}")
    return top


def _top_regions(lord: Any, top: int) -> list[dict[str, Any]]:
    """The ``top`` regions of ``lord.regions()`` with the largest peak delta on any
    device, largest first: ``{"name", "count", "total_s", "devices"}`` as regions()."""
    regions = lord.regions()

    def peak(entry: dict[str, Any]) -> int:
        return max((int(d.get("max_peak_delta", 0)) for d in entry["devices"].values()), default=0)

    order = sorted(regions.items(), key=lambda kv: (-peak(kv[1]), kv[0]))[:top]
    return [{"name": name, **entry} for name, entry in order]


def summary(lord: Any, *, top: int = 5, backend: str | None = None) -> dict[str, Any]:
    """This process's compact summary of ``lord`` now (what :func:`gather` sends):
    plain Python values only, so it pickles and converts to JSON as it is."""
    from .report._source import lord_hotspots

    stats = lord.stats()
    devices = {
        dev: {
            "allocated": int(st["allocated"]),
            "peak_allocated": int(st["peak_allocated"]),
            "ooms": int(st.get("ooms", 0)),
            "categories": dict(st["categories"]),
            "peak_categories": dict(st["peak_categories"]),
        }
        for dev, st in stats.items()
    }
    sites = [h for h in lord_hotspots(lord, limit=top) if h["kind"] == "alloc"]
    sites.sort(key=lambda h: (-h["bytes"], h["device"], h["site"]))
    info = rank_info()
    return {
        "host": host_name(),
        "pid": os.getpid(),
        "rank": info.get("rank"),
        "world_size": info.get("world_size"),
        "backend": backend,
        "time": time.time(),
        "devices": devices,
        "categories": lord.categories(),
        "ooms": sum(d["ooms"] for d in devices.values()),
        "top_sites": [
            {"device": h["device"], "site": h["site"], "bytes": int(h["bytes"])}
            for h in sites[:top]
        ],
        "regions": _top_regions(lord, top),
    }


def gather(lord: Any, group: Any = None, *, top: int = 5) -> list[dict[str, Any]]:
    """Every rank's :func:`summary` of its lord, in the group's rank order (a
    collective: every rank of ``group`` must call it)."""
    top = _check_top(top)
    dist = _dist()
    if dist is None:
        raise RuntimeError(
            "gather(): torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() first, on every rank"
        )
    not_member = ValueError(
        "gather(): this process is not a member of 'group' (new_group() gives a non-member "
        "GroupMember.NON_GROUP_MEMBER): only the group's ranks call gather() with it"
    )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise not_member
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "gather(): argument 'group' must be a torch.distributed.ProcessGroup or None, "
            "not " + type(group).__name__
        )
    if dist.get_rank(group) < 0:
        raise not_member
    backend = str(dist.get_backend(group))
    mine = summary(lord, top=top, backend=backend)
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out
