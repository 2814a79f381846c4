"""The core's benchmarks (issue 2).

1. One ``allocate()`` or ``free()`` call (the mean of the two: each sample times
   ``allocate(m); free(m)`` pairs) on a module holding 1,000 parameter tensors,
   call sites on (the default), against a floor measured in the same process: a
   Python loop over those same tensors that only calls ``t.untyped_storage()``,
   its ``.data_ptr()`` and ``.nbytes()``, and reads ``t.device`` -- the least any
   Python code must do to learn each tensor's storage key, size and device.
   Target: at most 1.0x the floor. Two module shapes: a Sequential of 500 small
   Linear layers (a module tree, weight and bias each) and one ParameterList of
   1,000 parameters (one flat registry).

2. ``allocated()`` with no argument and with each form of device argument,
   against ``MemLord._bench_noop`` -- a method of the same C type that does
   nothing and returns None -- called with the same arguments, in the same run.
   That floor is the cost of calling into the extension at all: argument
   passing, the method lookup and the call protocol. Target: at most 2.0x.

    python bench/bench_core.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]
"""

from __future__ import annotations

import sys

import torch
from _harness import Case, Config, Row, compare, main
from torch import nn

from memlord import MemLord

N_PARAMS = 1000
ALLOC_TARGET = 1.0
QUERY_TARGET = 2.0


def linear_stack() -> nn.Module:
    # 500 x (weight 4x4, bias 4): 1,000 parameter tensors in 500 submodules.
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(N_PARAMS // 2)))


def parameter_list() -> nn.Module:
    return nn.ParameterList(nn.Parameter(torch.zeros(4)) for _ in range(N_PARAMS))


def storage_floor(tensors: list[torch.Tensor]) -> None:
    """The floor of benchmark 1: per tensor, the storage, its pointer and size, and
    the device."""
    for t in tensors:
        s = t.untyped_storage()
        ptr = s.data_ptr()  # noqa: F841
        nbytes = s.nbytes()  # noqa: F841
        dev = t.device  # noqa: F841


def _expected_bytes(tensors: list[torch.Tensor]) -> int:
    keys = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    return sum(nbytes for _, nbytes in keys)


def allocate_free_row(label: str, module: nn.Module, cfg: Config) -> Row:
    tensors = list(module.parameters())
    assert len(tensors) == N_PARAMS, len(tensors)
    lord = MemLord(auto_gc_bytes="auto")
    # Benchmark the real thing: the call counts every storage and records sites.
    lord.allocate(module)
    expected = _expected_bytes(tensors)
    assert lord.allocated()[0] == expected, (lord.allocated(), expected)
    lord.free(module)
    assert lord.allocated()[0] == 0, lord.allocated()
    sites = getattr(lord, "track_callsite", True)
    assert sites, "call-site recording must be on (the default)"
    lord.reset()

    subject = Case(
        f"allocate/free, {label}",
        "lord.allocate(m); lord.free(m)",
        {"lord": lord, "m": module},
        ops=2,
    )
    floor = Case(
        f"storage loop, {N_PARAMS:,} tensors", "walk(ts)", {"walk": storage_floor, "ts": tensors}
    )
    return compare(subject, floor, target=ALLOC_TARGET, cfg=cfg, note="call sites on")


QUERY_ARGS: list[tuple[str, tuple[object, ...]]] = [
    ("", ()),
    ('torch.device("cuda", 0)', (torch.device("cuda", 0),)),
    ('torch.device("cpu")', (torch.device("cpu"),)),
    ('"cpu"', ("cpu",)),
    ('"cuda:0"', ("cuda:0",)),
]


def query_rows(cfg: Config) -> list[Row]:
    lord = MemLord(auto_gc_bytes="auto")
    # A ledger with something in it.
    lord.allocate([torch.zeros(256), nn.Linear(8, 8)])
    rows = []
    for label, args in QUERY_ARGS:
        env: dict[str, object] = {"lord": lord}
        names = []
        for i, arg in enumerate(args):
            env[f"a{i}"] = arg
            names.append(f"a{i}")
        call_args = ", ".join(names)
        lord.allocated(*args)  # raises if the form is not accepted
        subject = Case(f"allocated({label})", f"lord.allocated({call_args})", env, unroll=20)
        floor = Case(f"_bench_noop({label})", f"lord._bench_noop({call_args})", env, unroll=20)
        rows.append(compare(subject, floor, target=QUERY_TARGET, cfg=cfg))
    return rows


def rows(cfg: Config) -> list[Row]:
    return [
        allocate_free_row(
            f"{N_PARAMS // 2} x nn.Linear ({N_PARAMS:,} params)", linear_stack(), cfg
        ),
        allocate_free_row(f"nn.ParameterList ({N_PARAMS:,} params)", parameter_list(), cfg),
        *query_rows(cfg),
    ]


if __name__ == "__main__":
    sys.exit(main(rows))
