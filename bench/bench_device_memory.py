"""device_memory("cpu") cached read against a no-op C method (issue 4).

Target: a cached read costs at most 2x ``lord._bench_noop("cpu")``, the same C type's
method that does nothing, called with the same argument in the same run.

A sample that straddles the end of the 50 ms cache window pays one /proc/meminfo
read (about 10 us spread over the sample's thousands of calls); the median ignores it.

    python bench/bench_device_memory.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys

from _harness import Case, Config, Row, compare, main

from memlord import MemLord

TARGET = 2.0


def rows(cfg: Config) -> list[Row]:
    lord = MemLord()
    env = {"lord": lord, "arg": "cpu"}
    lord.device_memory("cpu")  # fills the cache
    subject = Case('device_memory("cpu") cached', "lord.device_memory(arg)", env, unroll=20)
    floor = Case('_bench_noop("cpu")', "lord._bench_noop(arg)", env, unroll=20)
    return [compare(subject, floor, target=TARGET, cfg=cfg)]


if __name__ == "__main__":
    sys.exit(main(rows))
