"""One rank of a real gloo job on the CPU, for tests/integration/test_ranks_gather.py.

    python rank_worker.py RANK WORLD INIT_METHOD OUT_DIR

Joins the group, starts the memory profiler (its JSON goes to OUT_DIR under the default
name), and under a lord with ``hook_into_python()`` allocates ``(rank + 1)`` MiB to keep
and as much again as scratch (so its peak is twice what it keeps), rank ``r`` after
``r * STAGGER_S`` seconds, so the ranks peak one after another.  Then it stops the
profiler, calls ``lord.gather()`` and the argument checks, and writes what it did and saw
(its own pid, host, the tensors' own ``nbytes``, the wall clock around the peak, the
gathered list) to ``OUT_DIR/rank<r>.json``."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

MiB = 1 << 20
STAGGER_S = 0.3


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> int:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    from memlord import MemLord
    from memlord.profiler import initialize_memory_tracker, stop_memory_tracker

    initialize_memory_tracker(out, interval=None)
    lord = MemLord(auto_gc_bytes=None)
    report: dict = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
    with lord.hook_into_python():
        dist.barrier()
        time.sleep(rank * STAGGER_S)
        amount = (rank + 1) * MiB
        report["before"] = time.time()
        kept = torch.empty(amount, dtype=torch.uint8)
        scratch = torch.empty(amount, dtype=torch.uint8)
        report["after"] = time.time()
        report["kept"] = kept.untyped_storage().nbytes()
        report["scratch"] = scratch.untyped_storage().nbytes()
        del scratch
        report["profile"] = str(stop_memory_tracker())
        report["gathered"] = lord.gather()
        report["gathered_top1"] = lord.gather(top=1)
        # wrong arguments, checked before any collective
        report["bad_group"] = _error(lambda: lord.gather(group="world"))
        report["bad_top"] = _error(lambda: lord.gather(top=-1))
        report["bad_top_type"] = _error(lambda: lord.gather(top=1.5))
        if world > 1:
            first = dist.new_group([0])  # every rank calls new_group
            report["not_member"] = _error(lambda: lord.gather(group=first)) if rank else None
            report["subgroup"] = lord.gather(group=first) if rank == 0 else None
        del kept
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
