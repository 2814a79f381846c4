"""hook_into_python(ops=True) on a real GPU: after a training step the ledger's live bytes on
the device are within 5% of torch's own count, ``torch.cuda.memory_allocated()`` (the
caching allocator's allocated bytes: block rounding to 512 B and library workspaces are
what it has beyond the logical bytes memlord counts), and every storage is categorised as
torch's MemTracker would.

Marked ``cuda``; skips itself without a GPU (tools/gpu_check.sh runs it alone too).
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.cuda import library_workspace_bytes
from torch import nn

from memlord import MemLord

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_ledger_within_5_percent_of_memory_allocated_after_a_training_step():
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_torch(), lord.hook_into_python(ops=True):
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
        model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(16, 128, 512, device="cuda")
        for _ in range(2):
            opt.zero_grad(set_to_none=False)
            model(x).float().pow(2).mean().backward()
            opt.step()
        torch.cuda.synchronize()
        gc.collect()
        ours = lord.allocated("cuda:0")[0]
        summary = lord.memory_summary("cuda:0")
        # the cuBLAS workspaces the step made (64 MiB on an H100): no storage, measured by
        # torch releasing them
        workspaces = library_workspace_bytes(0)
        theirs = torch.cuda.memory_allocated() - base
        assert ours == pytest.approx(theirs, rel=0.05), (workspaces, summary)
        cats = lord.stats("cuda:0")["cuda:0"]["categories"]
        params = sum(p.untyped_storage().nbytes() for p in model.parameters())
        assert cats["parameter"] == params
        grads = [p.grad for p in model.parameters()]
        assert cats["gradient"] == sum(g.untyped_storage().nbytes() for g in grads)
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        assert cats["optimizer_state"] == sum(
            v.untyped_storage().nbytes() for v in state if v.is_cuda
        )
