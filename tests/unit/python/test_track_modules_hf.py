"""track_modules (and ``run --modules``) on models shaped like Hugging Face ones: forwards
that take keyword and integer inputs and return dicts or tuples.  No torch warning, a
backward region for every module including the root, values unchanged, and the backward
regions measure what is allocated inside them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import torch
from torch import nn

from memlord import MemLord
from memlord.report import load

MODEL = """
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        a = self.q(hidden_states)
        if attention_mask is not None:
            a = a * attention_mask[..., None]
        out = self.o(a)
        return (out, a) if output_attentions else (out,)


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = Attn(d)
        self.ln = nn.LayerNorm(d)

    def forward(self, hidden_states, attention_mask=None):
        h = self.attn(hidden_states, attention_mask=attention_mask)[0]
        return (self.ln(h + hidden_states),)


class Model(nn.Module):
    def __init__(self, vocab=50, d=16, n=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask)[0]
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return {"loss": loss, "logits": logits}
"""

_ns: dict = {}
exec(compile(MODEL, "<hf-like model>", "exec"), _ns)  # noqa: S102 - the same text runs below
Model = _ns["Model"]

MODULES = [
    "Model",
    "embed",
    "layers.0",
    "layers.0.attn",
    "layers.0.attn.q",
    "layers.0.attn.o",
    "layers.0.ln",
    "layers.1",
    "layers.1.attn",
    "layers.1.attn.q",
    "layers.1.attn.o",
    "layers.1.ln",
    "head",
]


def _step(model: nn.Module, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (2, 5), generator=g)
    mask = torch.ones(2, 5)
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    model.zero_grad()
    out["loss"].backward()
    return out["loss"].detach(), [p.grad.clone() for p in model.parameters()]


def test_hf_like_model_no_warning_and_a_backward_region_per_module() -> None:
    torch.manual_seed(0)
    model = Model()
    lord = MemLord()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lord.track_modules(model) as t:
            _step(model)
    assert [str(w.message) for w in caught] == []
    regions = t.regions()
    expected = {n: 1 for n in MODULES} | {n + " (backward)": 1 for n in MODULES}
    assert {k: v["count"] for k, v in regions.items()} == expected


def test_values_and_gradients_unchanged_by_tracking() -> None:
    torch.manual_seed(0)
    model = Model()
    loss0, grads0 = _step(model)
    lord = MemLord()
    with lord.track_modules(model):
        loss1, grads1 = _step(model)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))


def test_root_backward_region_spans_the_whole_backward() -> None:
    torch.manual_seed(0)
    model = Model()
    lord = MemLord()
    with lord.track_modules(model):
        _step(model)
    history, _ = lord._region_history()
    spans = {name: (raw[2], raw[2] + raw[0]) for name, raw in history}
    root = spans["Model (backward)"]
    forward_end = spans["Model"][1]
    for name in MODULES[1:]:
        start, end = spans[name + " (backward)"]
        assert root[0] <= start <= end <= root[1], name
        assert start >= forward_end


class _AllocInBackward(torch.autograd.Function):
    """Identity whose backward makes a tensor memlord is told about (a stand-in for the
    activations' gradients a real backward allocates)."""

    lord: MemLord
    made: list

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        t = torch.empty(4096, dtype=torch.uint8)
        _AllocInBackward.lord.allocate(t)
        _AllocInBackward.made.append(t)
        return grad


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, *, scale=1.0):
        return {"y": _AllocInBackward.apply(self.lin(x)) * scale}


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, ids):
        x = nn.functional.one_hot(ids, 8).float()
        return (self.inner(x, scale=2.0)["y"].sum(),)


def test_backward_regions_measure_what_the_backward_allocates() -> None:
    lord = MemLord()
    _AllocInBackward.lord, _AllocInBackward.made = lord, []
    model = _Outer()
    with lord.track_modules(model) as t:
        model(torch.tensor([1, 2, 3]))[0].backward()
    nbytes = _AllocInBackward.made[0].untyped_storage().nbytes()  # the outside reference
    regions = t.regions()
    for name in ("_Outer (backward)", "inner (backward)"):
        assert regions[name]["devices"]["cpu"]["total_delta"] == nbytes, name
    assert "inner.lin (backward)" in regions
    # the Linear ran before the allocating Function in the backward: not counted there
    assert regions["inner.lin (backward)"]["devices"] == {}
    for name in ("_Outer", "inner", "inner.lin"):
        assert regions[name]["devices"] == {}  # nothing explicit in the forward


def test_in_place_change_of_a_tracked_output_is_allowed() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    seq(x).sum().backward()
    ref = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    lord = MemLord()
    with lord.track_modules(seq) as t:
        seq(x).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, seq.parameters(), strict=True))
    assert {"0 (backward)", "1 (backward)", "2 (backward)", "Sequential (backward)"} <= set(
        t.regions()
    )


def test_no_backward_region_without_a_graph_and_backward_false() -> None:
    model = Model()
    lord = MemLord()
    with lord.track_modules(model) as t, torch.no_grad():
        model(torch.tensor([[1, 2]]))
    assert all("(backward)" not in n for n in t.regions())
    with lord.track_modules(model, backward=False) as t:
        model(torch.tensor([[1, 2]]), labels=torch.tensor([[1, 2]]))["loss"].backward()
    assert all("(backward)" not in n for n in t.regions())
    assert set(t.regions()) == set(MODULES)


def test_run_modules_records_backward_of_a_dict_output_model(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        MODEL
        + textwrap.dedent(
            """
            torch.manual_seed(0)
            model = Model()
            for _ in range(2):
                ids = torch.randint(0, 50, (2, 5))
                out = model(input_ids=ids, attention_mask=torch.ones(2, 5), labels=ids)
                out["loss"].backward()
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "memlord", "run", "--modules", "--json", "p.json", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    doc = load(tmp_path / "p.json")
    counts: dict[str, int] = {}
    for s in doc.operations:
        if s.kind == "module":
            counts[s.name] = counts.get(s.name, 0) + 1
    assert counts == {n: 2 for n in MODULES} | {n + " (backward)": 2 for n in MODULES}
    assert all(s.finished for s in doc.operations)


def _assert_nested(history: list) -> None:
    spans = sorted(
        ((raw[2], raw[2] + raw[0], name) for name, raw in history), key=lambda s: (s[0], -s[1])
    )
    stack: list[tuple[int, str]] = []
    for start, end, name in spans:
        while stack and start >= stack[-1][0]:
            stack.pop()
        assert not stack or end <= stack[-1][0], f"{name} overlaps {stack[-1][1]}"
        stack.append((end, name))


def test_backward_regions_nest_like_the_modules() -> None:
    # a module's output is its parent's (Sequential) and its successor's input (ReLU)
    seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4), nn.Tanh()))
    model = Model()
    lord = MemLord()
    with lord.track_modules(seq), lord.track_modules(model):
        seq(torch.randn(4, 8, requires_grad=True)).sum().backward()
        _step(model)
    history, _ = lord._region_history()
    assert len(history) == 2 * 6 + 2 * len(MODULES)
    _assert_nested(history)
