"""An untracked storage in ``snapshot(include_untracked=True)`` (and the reports' scan of
live tensors) is described by the tensor that owns it, not by whichever view of it the
scan meets first.

The scan reads ``gc.get_objects()``, which lists the collector's youngest generation
first: a view made after the last collection comes before the tensor it views, so the
entry took the view's shape, and whether it did depended on when the collector last ran
(in a shuffled suite, test_include_untracked_no_double_count met ``(5,)`` for its
12,345-element tensor). The reference is torch's own: the tensors' shapes, their
``_base`` and the storage's ``nbytes()``.
"""

from __future__ import annotations

import gc

import torch

from memlord import MemLord
from memlord._snapshot import _live_tensors
from memlord.report._source import LedgerSource


def _scan_meets_first(a: torch.Tensor, b: torch.Tensor) -> bool:
    order = [id(t) for t in _live_tensors()]
    return order.index(id(a)) < order.index(id(b))


def _untracked_entries(lord: MemLord, nbytes: int) -> list[dict]:
    snap = lord.snapshot(top=1_000_000, include_untracked=True)
    return [e for e in snap["cpu"]["top"] if not e["tracked"] and e["nbytes"] == nbytes]


def test_a_view_met_first_does_not_describe_the_storage():
    owner = torch.empty(12_347)
    gc.collect()  # owner goes to the oldest generation: the scan meets it last
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        view = owner[:5]
        assert view._base is owner
        assert _scan_meets_first(view, owner)  # the order that misled the scan
        nbytes = owner.untyped_storage().nbytes()
        (entry,) = _untracked_entries(lord, nbytes)
        assert entry["shape"] == tuple(owner.shape) == (12_347,)
        assert entry["dtype"] == str(owner.dtype)
        assert entry["category"] == "other"
    del view, owner


def test_a_parameter_describes_its_storage_with_a_view_of_it_alive():
    param = torch.nn.Parameter(torch.ones(3001, dtype=torch.float64))
    gc.collect()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        head = param[:3]
        assert _scan_meets_first(head, param)
        (entry,) = _untracked_entries(lord, param.untyped_storage().nbytes())
        assert entry["shape"] == (3001,) and entry["dtype"] == "torch.float64"
        assert entry["category"] == "parameter" and entry["requires_grad"] is True
    del head, param


def test_the_reports_scan_describes_a_storage_by_its_owner():
    owner = torch.empty(7, 1231)
    gc.collect()
    view = owner[2:4]
    assert _scan_meets_first(view, owner)
    nbytes = owner.untyped_storage().nbytes()
    rows = LedgerSource.scan_tensors(1_000_000)["cpu"]["tensors"]
    (row,) = [r for r in rows if r["nbytes"] == nbytes]
    assert row["shape"] == list(owner.shape) == [7, 1231]
    del view, owner
