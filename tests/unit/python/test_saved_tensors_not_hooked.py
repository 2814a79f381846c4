"""Why memlord does not track tensors saved for backward through saved-tensor hooks.

Issue #27 asks whether the tensors autograd saves could be tracked by default without
changing when memory is freed. They cannot, and these tests are the evidence, with torch
alone as the reference:

- identity saved-tensor hooks (``pack=lambda t: t``) keep an output an op saves for
  itself (``exp`` saves its result) alive after the program dropped it: the graph then
  holds the Python tensor, whose ``grad_fn`` is the graph — a reference cycle that bare
  autograd avoids. Under ``gc.disable()`` the storage outlives ``del`` with the hooks, and
  dies at ``del`` without them;
- torch.func's transforms refuse to run under saved-tensor hooks at all.

So memlord installs none: ``hook_into_python()`` leaves torch's saved-tensor hooks stack
as it was, and with ``ops=True`` what backward keeps is seen where it is made (an op's
output or a factory's), which changes nothing of its lifetime.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from memlord import MemLord


def output_outlives_del(hooks: bool) -> bool:
    x = torch.randn(1000, requires_grad=True)
    gc.disable()
    try:
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                y = x.exp()
                loss = y.sum()
        else:
            y = x.exp()
            loss = y.sum()
        storage = weakref.ref(y.untyped_storage())
        del y, loss
        return storage() is not None
    finally:
        gc.enable()


def test_identity_saved_tensor_hooks_keep_a_saved_output_alive():
    assert output_outlives_del(hooks=False) is False
    assert output_outlives_del(hooks=True) is True


def test_torch_func_refuses_saved_tensor_hooks():
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(RuntimeError, match="saved tensor hooks"):
            torch.func.grad(lambda a: a.exp().sum())(torch.randn(3))


@pytest.mark.parametrize("ops", [False, True])
def test_memlord_installs_no_saved_tensor_hooks(ops):
    top = torch._C._autograd._top_saved_tensors_default_hooks
    before = top(True)
    lord = MemLord()
    with lord.hook_into_python(ops=ops):
        assert top(True) == before
        assert output_outlives_del(hooks=False) is False  # lifetimes as bare
        # torch.func still runs
        g = torch.func.grad(lambda a: a.exp().sum())(torch.ones(3))
        assert torch.equal(g, torch.ones(3).exp())


def test_with_ops_what_backward_saves_is_counted_where_it_is_made():
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        x = torch.randn(1000, requires_grad=True)
        before = lord.allocated("cpu")[0]
        y = x.exp()  # saved by exp's backward
        loss = y.sum()
        assert lord.allocated("cpu")[0] - before == y.untyped_storage().nbytes() + 4
        del y  # still saved by the graph: still counted
        assert lord.allocated("cpu")[0] - before == 4000 + 4
        del loss  # the graph goes: its saved output dies with it
        assert lord.allocated("cpu")[0] == before
