"""One module-span tracker: ``lord.track_modules(model)`` and ``python -m memlord run
--modules`` (the profiler's global module hooks) open and close the same spans, in the
same nesting, for the same model: forward and backward, a keyword input that needs a
gradient, and a forward that raises."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from memlord import MemLord
from memlord.cli import _module_spans
from memlord.profiler import MemoryTracker
from memlord.report import load


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *, hidden: torch.Tensor) -> torch.Tensor:  # a keyword input
        return torch.relu(self.lin(hidden))


class Model(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.inner = Inner()
        self.b = nn.Linear(8, 4)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(hidden=self.a(x))
        if self.fail:
            self.b(h[:, :3])  # raises inside b: shapes do not match
        return self.b(h)


def _tree(spans: list[tuple[str, int, int]]) -> list[tuple[str, ...]]:
    """Each span as the path of names from its outermost enclosing span, in start order."""
    out = []
    stack: list[tuple[int, str]] = []
    for start, end, name in sorted(((s, e, n) for n, s, e in spans), key=lambda t: (t[0], -t[1])):
        while stack and start >= stack[-1][0]:
            stack.pop()
        out.append((*(n for _, n in stack), name))
        stack.append((end, name))
    return out


def _step(model: nn.Module) -> None:
    x = torch.randn(2, 8, requires_grad=True)
    try:
        model(x).sum().backward()
    except RuntimeError:
        if not model.fail:
            raise


def _by_track_modules(model: nn.Module) -> list[tuple[str, int, int]]:
    lord = MemLord()
    with lord.track_modules(model):
        _step(model)
    history, _ = lord._region_history()
    return [(name, raw[2], raw[2] + raw[0]) for name, raw in history]


def _by_run_modules(model: nn.Module, tmp_path) -> list[tuple[str, int, int]]:
    path = tmp_path / "p.json"
    tracker = MemoryTracker(tmp_path, True, None, json_path=path, install_handlers=False)
    tracker.start()
    spans = _module_spans(tracker)
    try:
        _step(model)
    finally:
        spans._remove_hooks()
        tracker.stop()
    doc = load(path)
    ops = [s for s in doc.operations if s.kind == "module"]
    assert all(s.finished for s in ops), [s.name for s in ops if not s.finished]
    return [(s.name, s.start_ns, s.end_ns) for s in ops]


@pytest.mark.parametrize("fail", [False, True], ids=["forward-backward", "forward-raises"])
def test_track_modules_and_run_modules_record_the_same_spans(tmp_path, fail: bool) -> None:
    torch.manual_seed(0)
    model = Model(fail)
    regions = _tree(_by_track_modules(model))
    operations = _tree(_by_run_modules(model, tmp_path))
    assert operations == regions
    names = {path[-1] for path in regions}
    assert {"Model", "a", "inner", "inner.lin", "b"} <= names
    if not fail:
        # the keyword input's gradient ends inner's backward before a's begins
        assert ("Model (backward)", "inner (backward)") in regions
        assert ("Model (backward)", "a (backward)") in regions


def _compiled_counts(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """model compiled whole (fullgraph, the eager backend) and run forward and backward:
    its output, and dynamo's graph and graph-break counts."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="eager", fullgraph=True)(x)
    out.sum().backward()
    counts = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return out.detach(), *counts


@pytest.mark.parametrize("how", ["track_modules", "run --modules"])
def test_a_compiled_model_compiles_as_without_module_spans(tmp_path, how: str) -> None:
    """torch.compile(model, fullgraph=True) under the module spans' hooks: the same output,
    graphs and graph breaks as without them (torch is the reference). The hooks read
    autograd nodes and call memlord's C core: traced, that was an error under fullgraph
    ("Unsupported torch.* op returned non-Tensor") and a graph break without it. Eager
    calls after the compiled one still open their spans."""
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(2, 8, requires_grad=True)
    expected = _compiled_counts(model, x)
    lord = MemLord()
    if how == "track_modules":
        spans: Any = lord.track_modules(model)
    else:
        tracker = MemoryTracker(tmp_path, True, None, install_handlers=False)
        tracker.start()
        spans = _module_spans(tracker)
    try:
        got = _compiled_counts(model, x)
        assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:] == (1, 0)
        if how == "track_modules":
            _step(model)  # eager: the spans are there
            assert {"Model", "a", "inner", "inner.lin", "b"} <= set(lord.regions())
    finally:
        if how == "track_modules":
            spans.disable()
        else:
            spans._remove_hooks()
            tracker.stop()


def _compiled_names(how: str, tmp_path, step) -> tuple[list[str], list[str]]:
    """The span names and the warnings of ``step()`` under the module spans (``how``)."""
    import warnings

    lord = MemLord()
    path = tmp_path / "c.json"
    if how == "track_modules":
        spans: Any = None
    else:
        tracker = MemoryTracker(tmp_path, True, None, json_path=path, install_handlers=False)
        tracker.start()
        spans = _module_spans(tracker)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "track_modules":
                with lord.track_modules(step.model):
                    step()
            else:
                step()
    finally:
        if spans is not None:
            spans._remove_hooks()
            tracker.stop()
    if how == "track_modules":
        names = [name for name, _ in lord._region_history()[0]]
    else:
        names = [s.name for s in load(path).operations if s.kind == "module"]
    return names, _warnings(caught)


def _warnings(caught: list[Any]) -> list[str]:
    """The warnings' texts, less torch's "Guards may run slower on Python 3.13.0", which
    it gives once per dict guard it builds (the hooks add guards: docs/guide.md)."""
    return [str(w.message) for w in caught if "Guards may run slower" not in str(w.message)]


@pytest.mark.parametrize("how", ["track_modules", "run --modules"])
@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("kind", ["Model", "Sequential"])
def test_a_torch_compiled_model_is_one_span_named_as_the_model(tmp_path, how, fullgraph, kind):
    """torch.compile(model) returns a wrapper module (OptimizedModule) whose call runs the
    model compiled: the module spans name that call as the model (one span and its
    backward, as eager gives the model's outermost span), and torch warns of nothing it
    does not warn of without memlord (torch, bare, is the reference). Before: nothing for
    track_modules; spans named "OptimizedModule" and torch's warning of global module
    hooks for run --modules."""
    import warnings

    torch.manual_seed(0)
    # torch runs a user module's own call eagerly around its compiled forward, and an
    # nn.Sequential's inside the compiled frame
    model = Model() if kind == "Model" else nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)

    def step() -> None:
        torch._dynamo.reset()
        x = torch.randn(2, 8, requires_grad=True)
        compiled(x).sum().backward()
        compiled(x).sum().backward()

    step.model = model  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as bare:
        warnings.simplefilter("always")
        step()
    names, caught = _compiled_names(how, tmp_path, step)
    assert caught == _warnings(bare)
    assert names == [kind, kind + " (backward)"] * 2


@pytest.mark.parametrize("how", ["track_modules", "run --modules"])
def test_a_compiled_submodule_is_spanned_once_by_its_name(tmp_path, how):
    """A submodule replaced by its compiled wrapper: one span per call, named by the
    wrapper's place in the model, none for the wrapper's ``_orig_mod``."""
    torch.manual_seed(0)
    model = Model()
    model.a = torch.compile(model.a, backend="eager")

    def step() -> None:
        torch._dynamo.reset()
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()

    step.model = model  # type: ignore[attr-defined]
    names, caught = _compiled_names(how, tmp_path, step)
    assert caught == []
    forward = sorted(n for n in names if not n.endswith("(backward)"))
    assert forward == ["Model", "a", "b", "inner", "inner.lin"]


def test_track_modules_leaves_the_model_as_it_is() -> None:
    """The tracker's hooks are torch's global ones, filtered to the model's modules: none
    on the modules (they would go into pickle.dumps(model) and torch.jit.script(model)),
    other modules untouched, and the hooks go when the model goes if the tracker was never
    disabled (the tracker does not keep the model alive)."""
    import gc
    import weakref

    from torch.nn.modules import module as torch_module

    def hooks_on(m: nn.Module) -> int:
        return sum(len(s._forward_hooks) + len(s._forward_pre_hooks) for s in m.modules())

    before = len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)
    torch_has_any = torch_module._has_any_global_hook
    lord = MemLord()
    model, other = Model(), nn.Linear(8, 8)
    tracker = lord.track_modules(model)
    assert hooks_on(model) == 0
    _step(model)
    other(torch.ones(1, 8))
    names = {"Model", "a", "inner", "inner.lin", "b"}
    assert set(lord.regions()) == names | {n + " (backward)" for n in names}
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    assert not tracker.enabled
    after = len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)
    assert after == before
    assert torch_module._has_any_global_hook is torch_has_any  # torch's own stands again


def test_disabled_tracker_leaves_no_global_hook() -> None:
    """torch's handle of a global forward hook with kwargs leaves its id behind in
    ``_global_forward_hooks_with_kwargs`` (torch 2.13): memlord removes it, or
    torch.compile(model) would warn of global module hooks for the rest of the process.
    torch's own ``_has_any_global_hook`` stands again once the tracker is off."""
    from torch.nn.modules import module as torch_module

    torch_has_any = torch_module._has_any_global_hook
    assert not torch_has_any()
    lord = MemLord()
    model = Model()
    with lord.track_modules(model):
        assert torch_module._global_forward_pre_hooks
        assert torch_module._global_forward_hooks_with_kwargs
    assert torch_module._has_any_global_hook is torch_has_any
    assert not torch_has_any()
    assert not torch_module._global_forward_hooks_with_kwargs


def test_compiled_module_warns_only_of_hooks_other_than_a_trackers(tmp_path) -> None:
    """torch.compile(model)'s module warns at each call that global module hooks fire an
    extra time for it (torch decides by ``_has_any_global_hook()``). A model tracker's
    hooks pass every module but the model's, and ``run --modules``' hooks take the
    compiled module's call as the model's (the model's own inside it adds no span):
    torch.compile(model) does not warn of them (bare, it does not), but it still warns of
    a global hook of the program's own (torch is the reference: its warning with the
    program's hook alone)."""
    import warnings

    from torch.nn.modules import module as torch_module

    def warned(model: nn.Module) -> list[str]:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(model, backend="eager")(torch.ones(2, 8)).sum().backward()
        torch._dynamo.reset()
        # only torch.compile(module)'s (torch 2.13 on CPython 3.13.0 warns of slower guards)
        return [str(w.message) for w in caught if "global hooks" in str(w.message)]

    def warned_with_own_hook(model: nn.Module) -> list[str]:
        handle = torch_module.register_module_forward_pre_hook({}.get)  # the program's own
        try:
            return warned(model)
        finally:
            handle.remove()

    model = Model()
    bare = warned(model)
    expected = warned_with_own_hook(model)
    assert bare == [] and len(expected) == 1
    lord = MemLord()
    with lord.track_modules(model):
        assert warned(model) == bare
        assert warned_with_own_hook(model) == expected
        with lord.track_modules(Model()):  # a second tracker beside it
            assert warned(model) == bare
        profiler = MemoryTracker(tmp_path, True, None, install_handlers=False)
        profiler.start()
        spans = _module_spans(profiler)
        try:
            assert warned(model) == bare
            assert warned_with_own_hook(model) == expected
        finally:
            spans._remove_hooks()
            profiler.stop()
        assert warned(model) == bare
    assert warned(model) == bare


def _modules_mod_tracker_sees(model: nn.Module, x: torch.Tensor, calls: int) -> set[str]:
    """The modules whose calls torch's own ModTracker sees over ``calls`` calls of a model
    compiled in place, by memlord's names (the root by its class, the others by their
    place)."""
    from torch.distributed._tools.mod_tracker import ModTracker

    root = type(model).__name__
    seen: set[str] = set()
    tracker = ModTracker()
    tracker.register_user_hooks(lambda m, _inputs: seen.add(tracker.get_known_fqn(m)))
    torch._dynamo.reset()
    try:
        model.compile(backend="eager")
        with tracker, torch.no_grad():
            for _ in range(calls):
                model(x)
    finally:
        torch._dynamo.reset()
        model._compiled_call_impl = None  # as it was before compile()
    return {name if name == root else name.removeprefix(root + ".") for name in seen}


def test_a_module_compiled_in_place_has_the_spans_of_what_runs_eagerly() -> None:
    """model.compile() of an nn.Sequential: a module call that runs eagerly has its span
    with its exact bytes, one inside the compiled frame none, and which calls run so is
    torch's to decide (torch 2.13's dynamo skips every frame of torch's own modules, so
    all four run eagerly; torch 2.14 compiles the Sequential's frame, so none does). The
    reference is torch's own ModTracker over the same calls (which modules) and torch's
    storages (the bytes of each module's output, which is all it leaves alive). Dynamo
    compiled the tracker's pre-hook's frame once, where the hook does nothing: no span at
    all where ModTracker saw every module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.ones(64, 8)
    with torch.no_grad():
        h = model[0](x)
        outputs = {"0": h, "1": model[1](h), "2": model(x), "Sequential": model(x)}
    nbytes = {name: t.untyped_storage().nbytes() for name, t in outputs.items()}
    eager = _modules_mod_tracker_sees(model, x, 2)
    assert eager <= set(nbytes), eager
    lord = MemLord()
    torch._dynamo.reset()
    try:
        with lord.hook_into_python(ops=True), lord.track_modules(model) as tracker:
            model.compile(backend="eager")
            with torch.no_grad():
                got = [model(x) for _ in range(2)]
    finally:
        torch._dynamo.reset()
    assert torch.equal(got[0], outputs["2"])
    regions = tracker.regions()
    assert set(regions) == eager
    for name in eager:
        assert regions[name]["count"] == 2, name
        assert regions[name]["devices"]["cpu"]["total_delta"] == 2 * nbytes[name], name
        assert regions[name]["devices"]["cpu"]["max_delta"] == nbytes[name], name


def test_keyword_inputs_are_read_before_the_forward() -> None:
    """torch hands a global forward pre-hook the positional inputs only: the keyword ones
    are read from torch's frame calling the hook (found on every supported torch)."""
    from torch.nn.modules import module as torch_module

    from memlord import _regions

    seen = []

    def pre(module, args):
        seen.append(_regions._call_kwargs(sys._getframe(1)))

    handle = torch_module.register_module_forward_pre_hook(pre)
    try:
        h = torch.ones(1, 8)
        Inner()(hidden=h)
    finally:
        handle.remove()
    assert seen[0] is not None and seen[0]["hidden"] is h
    assert seen[1] == {}  # Inner.lin, called with a positional input


_TRACK_WITHOUT_DYNAMO = """
import sys
import torch
from memlord import MemLord

model = torch.nn.Sequential(torch.nn.Linear(2, 2))
with MemLord().track_modules(model):
    model(torch.ones(1, 2))
print("torch._dynamo" in sys.modules)
"""


def test_track_modules_does_not_import_dynamo() -> None:
    """The tracker marks its hooks' code for dynamo through torch's C extension
    (``torch._C._dynamo``, loaded with torch) and asks for ``OptimizedModule`` nowhere:
    importing ``torch._dynamo`` is slow and changes torch's state, so a program that never
    compiles never imports it (the fresh process is the reference)."""
    from support import warm  # a fresh process: this one imported torch._dynamo long ago

    r = warm.run(
        [sys.executable, "-c", _TRACK_WITHOUT_DYNAMO], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "False"
