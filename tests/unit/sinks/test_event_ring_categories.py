"""The event ring records each event's category: the storage's category at that moment
(born with on an alloc, held at death on a free), decoded by decode_events()."""

from __future__ import annotations

import torch

from memlord import CATEGORIES, EVENT_DTYPE, EVENT_KINDS, MemLord


def test_the_record_stays_64_bytes_with_a_category_field():
    assert EVENT_DTYPE.itemsize == 64 and EVENT_DTYPE["category"] == "u1"


def test_allocate_is_other_and_a_gradient_is_born_temporary_and_dies_a_gradient():
    lord = MemLord()
    lord.record_events(4096)
    a = torch.empty(100, dtype=torch.uint8)
    lord.allocate(a)
    with lord.hook_into_python(ops=True):
        model = torch.nn.Linear(8, 4)
        model(torch.randn(2, 8)).sum().backward()
        ptr = model.weight.grad.untyped_storage().data_ptr()
        nbytes = model.weight.grad.untyped_storage().nbytes()
        model.weight.grad = None  # the gradient dies
        recs = lord.events()
    first = lord.decode_events(recs[:1])[0]
    assert first["kind"] == "alloc" and first["bytes"] == 100 and first["category"] == "other"
    # the gradient's own alloc and free are the last events at its address (a storage
    # freed earlier in the step may have had the same address)
    mine = recs[recs["address"] == ptr][-2:]
    kinds = [EVENT_KINDS[k] for k in mine["kind"].tolist()]
    cats = [CATEGORIES[c] for c in mine["category"].tolist()]
    assert (kinds, cats) == (["alloc", "free"], ["temporary", "gradient"])
    assert mine["bytes"].tolist() == [nbytes, nbytes]
