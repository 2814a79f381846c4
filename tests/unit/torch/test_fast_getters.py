"""torch's getters called fast (src/torch/getters.h) are cached per type, not per
descriptor: once the module state is cleared (the interpreter finalizing, a tracked
tensor dying after memlord's own module), the cache must not call the descriptor that is
gone. CI's py310 run once ended in a segmentation fault at interpreter exit with tracked
tensors alive and the getters in use; the probe reads ``t.device`` as the free path does
then, in a process of its own (a child of the warm interpreter, tests/support/warm.py: a
crash there kills only that child)."""

import sys
import textwrap

import torch
from support import warm

from memlord import _core


def test_a_cleared_descriptor_is_never_called_through_the_cache():
    script = textwrap.dedent(
        """
        import torch
        from memlord import _core
        t = torch.zeros(3)
        print(_core._testing.device_getter_cleared(t))
        p = torch.nn.Parameter(torch.zeros(2))
        print(_core._testing.device_getter_cleared(p))
        """
    )
    out = warm.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    # the plain attribute read, as torch answers it
    assert out.stdout.split() == [str(torch.zeros(3).device)] * 2


def test_the_probe_answers_what_torch_answers_in_process():
    t = torch.zeros(3)
    assert _core._testing.device_getter_cleared(t) == t.device
