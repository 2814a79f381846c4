"""The category sources that every hook_into_python() has (ops or not): gradients once
accumulated, what torch.load returns, optimizer state, parameters and buffers as modules
register them. Each figure is checked against torch's own storage sizes."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import textwrap

import pytest
import torch
from support import warm
from support.ledger import ledger, storage_bytes, torch_memory
from torch import nn

from memlord import MemLord


def nbytes(*tensors: torch.Tensor) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def cats(lord: MemLord) -> dict[str, int]:
    return lord.stats("cpu")["cpu"]["categories"]


@pytest.fixture(params=[False, True], ids=["default", "ops"])
def lord(request):
    lord = MemLord()
    with lord.hook_into_python(ops=request.param) as hooks:
        assert hooks.ops is request.param
        yield lord


def test_torch_load_counts_what_it_returns_as_loaded(lord):
    buf = io.BytesIO()
    state = {"w": torch.randn(256, 256), "b": torch.randn(256), "nested": [torch.ones(10)]}
    torch.save(state, buf)
    before = lord.allocated("cpu")[0]
    buf.seek(0)
    loaded = torch.load(buf)
    got = [loaded["w"], loaded["b"], loaded["nested"][0]]
    assert cats(lord)["loaded"] == nbytes(*got)
    assert lord.allocated("cpu")[0] - before >= nbytes(*got)
    del loaded, got
    assert cats(lord)["loaded"] == 0


_SELF_REFERENCING_LOAD = """
import io, torch
from memlord import MemLord
cycle = [torch.ones(4)]
cycle.append(cycle)
cycle.append({"again": cycle, "t": torch.ones(2, dtype=torch.float64)})
buf = io.BytesIO()
torch.save(cycle, buf)
lord = MemLord(auto_gc_bytes=None)
with lord.hook_into_python():
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded[1] is loaded and loaded[2]["again"] is loaded
    print(lord.stats("cpu")["cpu"]["categories"]["loaded"])
"""


def test_torch_load_of_a_structure_holding_itself_returns():
    """pickle keeps cycles: torch.load of a list that holds itself (twice) returns at once,
    as without memlord, and each tensor in it is loaded once.  (The load source walked
    every path through the structure, 2**64 of them here: a hang.)"""
    try:
        r = warm.run(
            [sys.executable, "-c", textwrap.dedent(_SELF_REFERENCING_LOAD)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("torch.load did not return within 60 s")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) == 4 * 4 + 2 * 8


def test_torch_load_is_torch_serialization_load_again_after_disable():
    original = torch.load
    lord = MemLord()
    with lord.hook_into_python():
        assert torch.load is not original
        assert torch.load.__wrapped__ is original
    assert torch.load is original


def test_gradients_parameters_buffers_and_optimizer_state(lord):
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    params = list(model.parameters())
    assert cats(lord)["parameter"] == nbytes(*params)
    assert cats(lord)["buffer"] == nbytes(*model.buffers())
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(16, 32)
    model(x).square().sum().backward()
    # accumulated: post-accumulate-grad hooks, before any optimizer step
    assert cats(lord)["gradient"] == nbytes(*(p.grad for p in params))
    opt.step()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    assert cats(lord)["optimizer_state"] == nbytes(*state)
    opt.zero_grad(set_to_none=True)
    assert cats(lord)["gradient"] == 0
    assert cats(lord)["parameter"] == nbytes(*params)


def test_a_failing_source_is_reported_and_the_call_returns(lord, monkeypatch):
    """A category source that fails goes to sys.unraisablehook, naming itself; torch.load
    returns what it loaded all the same."""
    import memlord._ops as ops

    def broken(*args):
        raise RuntimeError("categorizing broke")

    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    monkeypatch.setattr(ops._core, "_categorize", broken)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    buf.seek(0)
    assert torch.load(buf)["w"].tolist() == [1.0, 1.0, 1.0]
    assert [(str(r.exc_value), r.object) for r in reports] == [
        ("categorizing broke", "memlord: categorizing loaded")
    ]


class _BareStateSGD(torch.optim.Optimizer):
    """An optimizer keeping a bare tensor per parameter in ``state`` (torch's own
    state_dict() and load_state_dict() take any value there)."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state.get(p)
                self.state[p] = p.grad.clone() if buf is None else buf.add_(p.grad)
                p.add_(self.state[p], alpha=-group["lr"])


def test_optimizer_state_that_is_not_a_dict(lord, monkeypatch):
    """State values that are tensors, not dicts: categorised as optimizer state, and the
    source reports no failure."""
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    model = nn.Linear(8, 4)
    opt = _BareStateSGD(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert reports == []
    assert cats(lord)["optimizer_state"] == nbytes(*opt.state.values())


def test_sources_are_removed_with_the_last_hooks():
    from torch.nn.modules import module as torch_module
    from torch.optim import optimizer as torch_optimizer

    before = (
        len(torch_module._global_parameter_registration_hooks),
        len(torch_module._global_buffer_registration_hooks),
        len(torch_optimizer._global_optimizer_pre_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
    )
    a, b = MemLord(), MemLord()
    ha, hb = a.hook_into_python(), b.hook_into_python(ops=True)
    assert len(torch_module._global_parameter_registration_hooks) == before[0] + 1
    p = nn.Parameter(torch.randn(4))
    ha.disable()
    assert len(torch_optimizer._global_optimizer_pre_hooks) == before[2] + 1
    hb.disable()
    after = (
        len(torch_module._global_parameter_registration_hooks),
        len(torch_module._global_buffer_registration_hooks),
        len(torch_optimizer._global_optimizer_pre_hooks),
        len(torch_optimizer._global_optimizer_post_hooks),
    )
    assert after == before
    assert torch._C._len_torch_dispatch_stack() == 0
    del p


@pytest.mark.parametrize(
    ("ops", "modules"),
    [(True, False), (False, True), (False, False)],
    ids=["ops", "factories-track_modules", "factories"],
)
def test_what_an_optimizers_step_finds_alive_is_no_allocation_of_the_region(ops, modules):
    """A model trained a step before the hooks (its AdamW state made then): a region
    around the next step counts what the step makes (its gradients, as torch.profiler's
    timeline), not the parameters and the state the step's source finds alive; those are
    counted from then on (source ``found``), the region's entry level raised by them.
    With ops off and the model not tracked, no source sees the backward make the
    gradients: the step finds them too (counted, no allocation of the region's)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.ones(4, 64)).sum().backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    held = [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]
    found = storage_bytes(*held)
    with torch_memory() as theirs:  # the same step bare: the gradients it leaves
        step()
    expected = theirs.net
    grads = storage_bytes(*(p.grad for p in model.parameters()))
    assert expected == grads
    opt.zero_grad(set_to_none=True)
    lord = MemLord(auto_gc_bytes=None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(lord.hook_into_python(ops=ops))
        if modules:
            stack.enter_context(lord.track_modules(model))
        r = stack.enter_context(lord.region("step"))
        step()
    (row,) = r.stats.values()
    if not ops and not modules:
        found += grads
        expected = 0
    assert row["delta"] == expected
    assert ledger(lord) >= found  # counted from the step on
    assert row["peak"] - row["peak_delta"] == found  # the level the region started from


def _found_lord() -> MemLord:
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(256)
    return lord


def _events(lord: MemLord) -> list[tuple[str, str, int, str | None]]:
    """(kind, source, bytes, site) of the lord's allocations and frees; site None for
    none."""
    return [
        (e["kind"], e["source"], e["bytes"], None if e["site"] == "<unknown>:0" else e["site"])
        for e in lord.decode_events(lord.events())
        if e["kind"] in ("alloc", "free")
    ]


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "factories"])
def test_a_parameter_made_of_a_tensor_from_before_the_hooks_is_found(ops):
    """nn.Parameter(data) over a storage made before the hooks: counted from then on as a
    parameter (its bytes, read from torch), with no call site, and no allocation of the
    open region's (it raises the level the region started from). A parameter over a
    storage a factory made under the hooks stays the factory's allocation, counted once."""
    old = torch.randn(1000)
    lord = _found_lord()
    with lord.hook_into_python(ops=ops), lord.region("r") as r:
        p = nn.Parameter(old)
        q = nn.Parameter(torch.randn(500))
    found, made = storage_bytes(p), storage_bytes(q)
    assert (found, made) == (4000, 2000)
    (kind, source, nbytes, site), second = _events(lord)
    assert (kind, source, nbytes, site) == ("alloc", "found", found, None)
    kind, source, nbytes, site = second  # randn's: the factory, or its operator with ops
    assert (kind, nbytes, source) == ("alloc", made, "op" if ops else "factory")
    assert "test_category_sources.py:" in site
    (row,) = r.stats.values()
    assert row["delta"] == made
    assert row["peak"] - row["peak_delta"] == found
    assert ledger(lord) == found + made
    assert cats(lord)["parameter"] == found + made
    top = lord.top_alloc_site("cpu")
    assert top is not None and top[2] == made  # the found bytes are no site's


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "factories"])
def test_a_buffer_or_parameter_from_before_the_hooks_registered_by_a_module_is_found(ops):
    """A module registering a buffer, or a parameter, whose storage was made before the
    hooks: counted from then on under its category, with no call site, and no allocation
    of the open region's."""
    buf, weight = torch.randn(300), nn.Parameter(torch.randn(200))
    lord = _found_lord()
    with lord.hook_into_python(ops=ops), lord.region("r") as r:
        m = nn.Module()
        m.register_buffer("running", buf)
        m.weight = weight
    b, w = storage_bytes(buf), storage_bytes(weight)
    assert _events(lord) == [("alloc", "found", b, None), ("alloc", "found", w, None)]
    assert r.stats == {}  # the region allocated nothing
    assert ledger(lord) == b + w
    assert cats(lord)["buffer"] == b and cats(lord)["parameter"] == w
    assert lord.top_alloc_site("cpu") is None
    del m


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "factories"])
def test_gradients_accumulated_before_the_hooks_are_found_at_the_next_step(ops):
    """Gradients a backward made before the hooks, seen by the optimizer's next step
    inside a region: found (counted as gradients, no allocation of the region's); the
    region counts what the step makes (SGD's momentum), as torch.profiler's timeline of
    the same step does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(4, 64)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    lord = _found_lord()
    with torch_memory() as theirs:
        with lord.hook_into_python(ops=ops), lord.region("step") as r:
            opt.step()
    (row,) = r.stats.values()
    assert theirs.net > 0  # the momentum buffers
    assert row["delta"] == theirs.net
    found = [(b, site) for _kind, source, b, site in _events(lord) if source == "found"]
    assert sum(b for b, _site in found) == storage_bytes(*model.parameters(), *grads)
    assert {site for _b, site in found} == {None}
    assert cats(lord)["gradient"] == storage_bytes(*grads)
    opt.zero_grad(set_to_none=True)
    del grads
    assert cats(lord)["gradient"] == 0
