"""What ``hook_into_python()`` and ``hook_into_python(ops=True)`` cost on a training step.

    python bench/bench_ops.py [--samples N] [--sample-ms MS] [--quick] [--json PATH]

1. **A small CPU-bound transformer training step**, where Python and dispatch overhead
   matter: a GPT-like model of plain torch modules (token and position embeddings, 4
   pre-norm blocks of LayerNorm, a fused ``nn.Linear`` q/k/v projection, causal
   ``scaled_dot_product_attention`` over 4 heads, an output projection and a GELU MLP of
   width 4 x 128, a final LayerNorm and an LM head), width 128, vocabulary 512, batch
   4 x 64 tokens, cross-entropy loss and ``torch.optim.AdamW`` (its default
   implementation on the CPU: a Python loop over the parameters), one thread
   (``torch.set_num_threads(1)``: the step is the same work on any machine). One step is
   ``zero_grad(set_to_none=True)``, forward, backward and ``opt.step()``: about 250
   aten operators forward and backward and 20 per parameter tensor in AdamW.

   Six variants of the same step on the same model, each sample ``STEPS`` steps after
   one untimed step, the variants interleaved in a rotating order (every variant sees
   the same noise), medians over ``max(cfg.samples, 21)`` samples each:

   - ``bare``: torch alone (the floor of every row);
   - ``hooks``: ``lord.hook_into_python()`` with its defaults: the factory wrappers and
     the category sources (gradients, ``torch.load``, optimizer state, module
     registrations), call sites on. **Target <= 1.05x**;
   - ``ops=True``: ``lord.hook_into_python(ops=True)``: also memlord's dispatch mode,
     which counts and tracks every storage an operator creates. **Target <= 1.5x**;
   - ``do-nothing mode``: a Python ``TorchDispatchMode`` whose ``__torch_dispatch__`` is
     ``return func(*args, **(kwargs or {}))``: the least any dispatch-mode mechanism
     costs, measured in the same run (informative);
   - ``MemTracker``: torch's own tracker (``torch.distributed._tools.mem_tracker``), the
     outside reference, with ``track_external(model, opt)`` (informative);
   - ``profiler``: ``torch.profiler.profile(activities=[CPU], profile_memory=True)``, the
     other mechanism that sees every allocation (its events' post-processing at exit is
     not timed) (informative).

   The hooks are switched on and off outside the timed region; after timing, the
   benchmark checks that ``ops=True`` really counted operator outputs and that the
   default sources counted the gradients.

2. **One tiny operator**: ``a + b`` on two 1 KiB float32 tensors (256 elements), unrolled
   20 times in the harness's timing loop: bare, under the do-nothing mode, and with
   ``ops=True`` (the result's storage counted, tracked, and credited at its death),
   interleaved in the same way. The rows give the time added per operator, ops=True
   against the do-nothing mode's (informative: the C mode saves the Python mode's two
   frames and spends them, and a little more time, on the accounting; see
   docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _harness import Case, Config, Row, main, make_loop
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlord import MemLord, _core

WIDTH, HEADS, LAYERS, VOCAB = 128, 4, 4, 512
BATCH, SEQ = 4, 64
STEPS = 3  # timed steps per sample
MIN_SAMPLES = 21
MIN_OP_SAMPLES = 21

HOOKS_TARGET = 1.05
OPS_TARGET = 1.5
INFO_TARGET = float("inf")  # informative rows


class NoopMode(TorchDispatchMode):
    """The floor of the mechanism: a Python dispatch mode that only runs the operator."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(LAYERS))
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def make_training():
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    target = torch.randint(0, VOCAB, (BATCH, SEQ))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return model, opt, step


# ---------------------------------------------------------------------------- variants


def _variants(model, opt):
    """({name: enter()}, lords): enter() switches the variant on and returns its exit()
    and what to call between two steps (MemTracker's module statistics cover one
    iteration: ``reset_mod_stats()`` makes it take the next)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    lords = {"hooks": MemLord(), "ops=True": MemLord()}

    def nothing() -> None:
        pass

    def hooks():
        return lords["hooks"].hook_into_python().disable, nothing

    def ops():
        return lords["ops=True"].hook_into_python(ops=True).disable, nothing

    def noop():
        return _enter_noop(), nothing

    def memtracker():
        mt = MemTracker()
        mt.track_external(model, opt)
        mt.__enter__()
        return lambda: mt.__exit__(None, None, None), mt.reset_mod_stats

    def profiler():
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        prof.__enter__()
        return lambda: prof.__exit__(None, None, None), nothing

    return {
        "bare": lambda: (nothing, nothing),
        "hooks": hooks,
        "ops=True": ops,
        "do-nothing mode": noop,
        "MemTracker": memtracker,
        "profiler": profiler,
    }, lords


def _interleave(
    names: list[str], sample: Callable[[str], float], n: int, warmup: int = 1
) -> dict[str, list[float]]:
    """n samples of each name, in an order that rotates every round."""
    out: dict[str, list[float]] = {name: [] for name in names}
    k = len(names)
    for i in range(warmup + n):
        order = names[i % k :] + names[: i % k]
        if i % 2:
            order.reverse()
        for name in order:
            t = sample(name)
            if i >= warmup:
                out[name].append(t)
    return out


def training_rows(cfg: Config) -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt, step = make_training()
        for _ in range(3):
            step()
        variants, lords = _variants(model, opt)
        exits: dict[str, list[float]] = {name: [] for name in variants}

        def sample(name: str) -> float:
            leave, between = variants[name]()
            try:
                step()  # untimed: the sources watch the parameters from here on
                between()
                gc.collect()
                gc.disable()
                t0 = time.perf_counter_ns()
                for _ in range(STEPS):
                    step()
                    between()
                elapsed = time.perf_counter_ns() - t0
                gc.enable()
            finally:
                t0 = time.perf_counter_ns()
                leave()
                exits[name].append(time.perf_counter_ns() - t0)
            return elapsed / STEPS

        n = max(cfg.samples, MIN_SAMPLES) if cfg.samples >= 5 else cfg.samples
        times = _interleave(list(variants), sample, n)
    finally:
        torch.set_num_threads(threads)
    s = lords["ops=True"].stats().get("cpu", {})
    assert s.get("allocs", 0) > 0, "ops=True counted nothing"
    hooked = lords["hooks"].stats().get("cpu", {})
    assert hooked.get("allocated", 0) > 0, "the sources counted nothing"
    bare = times["bare"]
    targets = {
        "hooks": (HOOKS_TARGET, "factories + gradients, torch.load, optimizer, module sources"),
        "ops=True": (OPS_TARGET, "every operator output counted and tracked, call sites on"),
        "do-nothing mode": (
            INFO_TARGET,
            "the mechanism's floor: a Python dispatch mode that only calls func",
        ),
        "MemTracker": (INFO_TARGET, "torch's mem_tracker, track_external(model, opt)"),
        "profiler": (
            INFO_TARGET,
            "torch.profiler, CPU activity, profile_memory=True; not timed: its exit "
            f"(the events' processing) took {statistics.median(exits['profiler']) / 1e6:.0f} "
            f"ms after {STEPS + 1} steps",
        ),
    }
    desc = f"GPT step, width {WIDTH}, {LAYERS} blocks, {BATCH} x {SEQ} tokens, AdamW, 1 thread"
    rows = []
    for name, (target, note) in targets.items():
        rows.append(
            Row(
                f"{desc}: {name}",
                statistics.median(times[name]),
                "bare",
                statistics.median(bare),
                target,
                note=note,
                samples_ns=times[name],
                floor_samples_ns=bare,
            )
        )
    return rows


# ---------------------------------------------------------------------------- one op


def op_rows(cfg: Config) -> list[Row]:
    a, b = torch.ones(256), torch.ones(256)
    case = Case("a + b", "a + b", {"a": a, "b": b}, unroll=20)
    loop = make_loop(case)
    per_op = case.ops * case.unroll
    lord = MemLord()
    enter: dict[str, Callable[[], Callable[[], None]]] = {
        "bare": lambda: lambda: None,
        "do-nothing mode": lambda: _enter_noop(),
        "ops=True": lambda: lord.hook_into_python(ops=True).disable,
    }
    # calibrate on the slowest, the do-nothing mode
    leave = enter["do-nothing mode"]()
    try:
        n = 1
        while loop(n) < cfg.sample_ms * 1e6 and n < 1 << 24:
            n *= 2
    finally:
        leave()

    def sample(name: str) -> float:
        leave = enter[name]()
        try:
            return loop(n) / (n * per_op)
        finally:
            leave()

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        n_samples = max(cfg.samples, MIN_OP_SAMPLES) if cfg.samples >= 5 else cfg.samples
        times = _interleave(list(enter), sample, n_samples)
    finally:
        if was:
            gc.enable()
    s = lord.stats()["cpu"]
    assert s["allocs"] > 0 and s["allocated"] == 0, s  # counted, and every result credited
    med = {k: statistics.median(v) for k, v in times.items()}
    added_ops = [o - b for o, b in zip(times["ops=True"], times["bare"], strict=True)]
    added_noop = [o - b for o, b in zip(times["do-nothing mode"], times["bare"], strict=True)]
    return [
        Row(
            "a + b, 1 KiB float32: ops=True",
            med["ops=True"],
            "bare",
            med["bare"],
            INFO_TARGET,
            note=f"adds {statistics.median(added_ops):.0f} ns per op",
            samples_ns=times["ops=True"],
            floor_samples_ns=times["bare"],
        ),
        Row(
            "a + b, 1 KiB float32: do-nothing mode",
            med["do-nothing mode"],
            "bare",
            med["bare"],
            INFO_TARGET,
            note=f"adds {statistics.median(added_noop):.0f} ns per op",
            samples_ns=times["do-nothing mode"],
            floor_samples_ns=times["bare"],
        ),
        Row(
            "a + b, 1 KiB: ops=True's added time",
            statistics.median(added_ops),
            "do-nothing mode's",
            statistics.median(added_noop),
            INFO_TARGET,
            note="per operator, over bare, paired per round",
            samples_ns=added_ops,
            floor_samples_ns=added_noop,
        ),
    ]


def _enter_noop() -> Callable[[], None]:
    mode = NoopMode()
    mode.__enter__()
    return lambda: mode.__exit__(None, None, None)


def rows(cfg: Config | None = None) -> list[Row]:
    cfg = cfg or Config()
    assert not _core._hooks_info()["python_installed"], "python hooks already installed"
    return training_rows(cfg) + op_rows(cfg)


if __name__ == "__main__":
    sys.exit(main(rows))
