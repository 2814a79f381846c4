"""The buffers of the code torch.compile's inductor generates are counted.

Inductor's generated code allocates its buffers and outputs with
``torch._C._dynamo.guards._empty_strided_cpu`` (``_cuda``, ...), which bypass the
dispatcher: no dispatch mode sees them (a do-nothing TorchDispatchMode does not either),
so ``hook_into_python()`` wraps them as it wraps the factories. Checked against the
storages of the compiled function's results (torch's own nbytes), and the values against
the same function uncompiled."""

from __future__ import annotations

import gc

import pytest
import torch

from memlord import MemLord

pytestmark = pytest.mark.skipif(
    not hasattr(torch._C._dynamo.guards, "_empty_strided_cpu"), reason="no inductor allocator"
)


def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x.sin() * 2
    z = y @ y.T
    return z.relu(), y.cos()


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "factories"])
def test_compiled_outputs_are_counted_and_freed(ops):
    torch._dynamo.reset()
    lord = MemLord()
    x = torch.randn(64, 64)
    with lord.hook_into_python(ops=ops):
        compiled = torch.compile(fn, backend="inductor")
        a, b = compiled(x)
        gc.collect()
        assert (
            lord.allocated("cpu")[0] == a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
        )
        want = fn(x)
        assert torch.allclose(a, want[0], atol=1e-4) and torch.allclose(b, want[1], atol=1e-5)
        del a, b, want
        gc.collect()
        assert lord.allocated("cpu")[0] == 0
    torch._dynamo.reset()


def test_the_allocator_is_torchs_own_again_after_disable():
    guards = torch._C._dynamo.guards
    original = guards._empty_strided_cpu
    lord = MemLord()
    with lord.hook_into_python():
        assert guards._empty_strided_cpu is not original
        t = guards._empty_strided_cpu((4, 4), (4, 1), torch.float32)
        assert t.shape == (4, 4) and lord.allocated("cpu")[0] == 64
    assert guards._empty_strided_cpu is original
