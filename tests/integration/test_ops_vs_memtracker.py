"""hook_into_python(ops=True) against torch's own tracker.

torch.distributed._tools.mem_tracker.MemTracker is a TorchDispatchMode that follows every
storage an operator makes and categorises it (parameter, buffer, gradient, activation,
temporary, optimizer state, other). It knows nothing of memlord, so it is the outside
reference: on the same training steps of a GPT-like model built from plain torch modules,
memlord's peak equals MemTracker's within 1%, each category within 2%, and each
transformer block's forward delta within 5% of MemTracker's Pre-Forward to Post-Forward
change; and every module's forward and backward region (track_modules' breakdown) has
MemTracker's delta and peak to the byte. A second check is the real thing: after the
steps the ledger equals the bytes of the live storages of the model, the optimizer and
the inputs.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memlord import MemLord

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")
MemTracker = mem_tracker.MemTracker
_ModState = mem_tracker._ModState
_MemRefType = mem_tracker._MemRefType

CPU = torch.device("cpu")
# MemTracker's categories -> memlord's (MemTracker has no "input" or "loaded": the inputs
# given to its track_external are its "Other"; memlord calls them "input" when a tracked
# model's outermost forward receives them)
MAP = {
    _MemRefType.PARAM: ("parameter",),
    _MemRefType.BUFFER: ("buffer",),
    _MemRefType.GRAD: ("gradient",),
    _MemRefType.ACT: ("activation",),
    _MemRefType.TEMP: ("temporary",),
    _MemRefType.OPT: ("optimizer_state",),
    _MemRefType.OTH: ("other", "input", "loaded"),
}


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, n: int = 4, seq: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.register_buffer("mask_scale", torch.ones(1))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos * self.mask_scale
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def live_bytes(*tensors: torch.Tensor) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.fixture
def workload():
    torch.manual_seed(0)
    lord = MemLord()
    hooks = lord.hook_into_python(ops=True)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (4, 32))
    tgt = torch.randint(0, 256, (4, 32))

    def step(keep_grads: bool) -> None:
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)

    held = [lord, model, opt, idx, tgt, step]
    try:
        yield held
    finally:
        hooks.disable()
        # MemTracker leaves the model it tracked as garbage that the collector frees one
        # module per pass (some 26 passes here): free it now, or it dies during a later
        # test's measurement (a fit's fixed bytes, a snapshot before and after)
        held.clear()
        lord = model = opt = idx = tgt = step = None  # the closure's cells too
        for _ in range(100):
            if gc.collect() == 0:
                break


def _steps_under_memtracker(workload, modules, keep_grads):
    """A warm-up step (AdamW makes its state), then two steps under MemTracker, the
    lord's peak and the module regions reset before them and both sides' module stats
    before the second: the MemTracker, whose module stats and the regions are the
    second step's."""
    lord, model, opt, idx, tgt, step = workload
    step(keep_grads)
    gc.collect()
    lord.reset_peak_memory_stats("cpu")
    modules.regions(clear=True)
    mt = MemTracker()
    mt.track_external(model, opt, idx, tgt)
    with mt:
        for i in range(2):
            if i:
                mt.reset_mod_stats()
                modules.regions(clear=True)
            step(keep_grads)
    return mt


@pytest.mark.parametrize("keep_grads", [False, True], ids=["grads_to_none", "grads_kept"])
def test_peak_categories_and_block_deltas_match_memtracker(workload, keep_grads):
    lord, model, opt, idx, tgt, _ = workload
    modules = lord.track_modules(model, backward=False)
    mt = _steps_under_memtracker(workload, modules, keep_grads)
    stats = lord.stats("cpu")["cpu"]
    theirs = mt.get_tracker_snapshot("peak")[CPU]

    # the peak of the steps
    assert stats["peak_allocated"] == pytest.approx(theirs["Total"], rel=0.01)
    # each category at that peak
    ours = stats["peak_categories"]
    assert sum(ours.values()) == stats["peak_allocated"]
    for ref, names in MAP.items():
        assert sum(ours[n] for n in names) == pytest.approx(theirs[ref], rel=0.02, abs=64), ref
    if keep_grads:
        assert ours["gradient"] == live_bytes(*(p.grad for p in model.parameters()))
    # each category's own highest: at least MemTracker's highest at any module boundary
    # (it reads nothing between them), and for what lives whole through the steps the
    # bytes of its storages (every gradient is alive at once at the end of backward)
    highest: dict[object, int] = {}
    for mod_stats in mt.memory_tracking.values():
        for snaps in mod_stats.snapshots.values():
            for snap in snaps:
                for ref, nbytes in snap.get(CPU, {}).items():
                    highest[ref] = max(highest.get(ref, 0), nbytes)
    own = stats["category_peaks"]
    for ref, names in MAP.items():
        assert sum(own[n] for n in names) >= highest[ref] > 0, ref
    assert own["parameter"] == live_bytes(*model.parameters()) == highest[_MemRefType.PARAM]
    assert own["buffer"] == live_bytes(*model.buffers()) == highest[_MemRefType.BUFFER]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert own["gradient"] == grads == highest[_MemRefType.GRAD]

    # each block's forward: our region's delta against MemTracker's Pre-Fw -> Post-Fw
    regions = modules.regions()
    for k, block in enumerate(model.blocks):
        snaps = mt.memory_tracking[block].snapshots
        post, pre = snaps[_ModState.POST_FW][-1][CPU], snaps[_ModState.PRE_FW][-1][CPU]
        change = post["Total"] - pre["Total"]
        delta = regions[f"blocks.{k}"]["devices"]["cpu"]["max_delta"]
        assert change > 0
        assert delta == pytest.approx(change, rel=0.05), f"blocks.{k}"
    modules.disable()

    # and the ledger is the live storages' bytes now (torch's own count)
    gc.collect()
    held = [*model.parameters(), *model.buffers(), idx, tgt]
    held += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    held += [p.grad for p in model.parameters() if p.grad is not None]
    assert lord.allocated("cpu")[0] == live_bytes(*held)
    current = lord.stats("cpu")["cpu"]["categories"]
    assert current["parameter"] == live_bytes(*model.parameters())
    assert current["buffer"] == live_bytes(*model.buffers())
    assert current["optimizer_state"] == live_bytes(
        *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    )
    assert current["input"] == live_bytes(idx, tgt)


def _mod_change(snaps: dict, start: object, end: object) -> int:
    return int(snaps[end][-1][CPU]["Total"] - snaps[start][-1][CPU]["Total"])


@pytest.mark.parametrize("keep_grads", [False, True], ids=["grads_to_none", "grads_kept"])
def test_module_breakdown_deltas_and_peaks_match_memtracker(workload, keep_grads):
    """track_modules' breakdown, every module of the model, forward and backward: a
    module's region delta is MemTracker's change from its Pre-Forward (Pre-Backward) to
    its Post-Forward (Post-Backward) snapshot, and the region's peak_delta is MemTracker's
    Peak-Forward (Peak-Backward) less the Pre snapshot. MemTracker follows the same
    operators' storages on its own, so the two agree to the byte."""
    lord, model = workload[:2]
    modules = lord.track_modules(model, backward=True)
    mt = _steps_under_memtracker(workload, modules, keep_grads)
    regions = modules.regions()
    modules.disable()
    checked = 0
    for qualified, module in model.named_modules():
        if module not in mt.memory_tracking:
            continue  # never called (the nn.ModuleList, MultiheadAttention's out_proj)
        name = qualified or type(module).__name__
        snaps = mt.memory_tracking[module].snapshots
        for suffix, pre, post, peak in (
            ("", _ModState.PRE_FW, _ModState.POST_FW, _ModState.PEAK_FW),
            (" (backward)", _ModState.PRE_BW, _ModState.POST_BW, _ModState.PEAK_BW),
        ):
            ours = regions[name + suffix]
            assert ours["count"] == 1, name + suffix
            dev = ours["devices"]["cpu"]
            assert dev["max_delta"] == _mod_change(snaps, pre, post), name + suffix
            assert dev["max_peak_delta"] == _mod_change(snaps, pre, peak), name + suffix
            if not suffix:  # a forward makes activations only, in both
                change = (
                    snaps[peak][-1][CPU][_MemRefType.ACT] - snaps[pre][-1][CPU][_MemRefType.ACT]
                )
                assert set(dev["categories"]) == {"activation"}, name
                assert dev["categories"]["activation"]["max_peak_delta"] == change, name
            checked += 1
    # every module called, forward and backward: the root, emb, ln, head and 8 per block
    assert checked == 2 * (4 + 8 * len(model.blocks))


class Shared(nn.Module):
    """A submodule called twice in one forward, the first call under activation
    checkpointing when ``ckpt`` (its forward runs again in backward)."""

    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.shared = nn.Sequential(nn.Linear(256, 256), nn.GELU())
        self.b = nn.Linear(256, 8)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.ckpt:
            # no saved generator state: memlord counts it (torch.get_rng_state, 5,056 B),
            # MemTracker never sees it (no operator makes it)
            h = checkpoint(self.shared, h, use_reentrant=False, preserve_rng_state=False)
        else:
            h = self.shared(h)
        return self.b(self.shared(h)).square().mean()


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_a_module_called_twice_has_memtrackers_largest_delta_and_peak(ckpt):
    """A module called more than once per step (and recomputed in backward under
    activation checkpointing): its region's max_delta and max_peak_delta over the calls
    are the largest of MemTracker's per-call changes, forward and backward."""
    torch.manual_seed(0)
    lord = MemLord()
    hooks = lord.hook_into_python(ops=True)
    model, x = Shared(ckpt), torch.randn(32, 64)
    modules = lord.track_modules(model)
    try:
        model(x).backward()  # warm-up
        model.zero_grad(set_to_none=True)
        gc.collect()
        modules.regions(clear=True)
        mt = MemTracker()
        mt.track_external(model, x)
        with mt:
            model(x).backward()
            model.zero_grad(set_to_none=True)
        regions = modules.regions()
    finally:
        modules.disable()
        hooks.disable()
    for qualified, module in model.named_modules():
        name = qualified or type(module).__name__
        snaps = mt.memory_tracking[module].snapshots
        for suffix, pre, post, peak in (
            ("", _ModState.PRE_FW, _ModState.POST_FW, _ModState.PEAK_FW),
            (" (backward)", _ModState.PRE_BW, _ModState.POST_BW, _ModState.PEAK_BW),
        ):
            starts = [s[CPU]["Total"] for s in snaps[pre]]
            deltas = [s[CPU]["Total"] - b for s, b in zip(snaps[post], starts, strict=True)]
            peaks = [s[CPU]["Total"] - b for s, b in zip(snaps[peak], starts, strict=True)]
            dev = regions[name + suffix]["devices"]["cpu"]
            assert dev["max_delta"] == max(deltas), name + suffix
            assert dev["max_peak_delta"] == max(peaks), name + suffix
    calls = regions["shared"]["count"]
    assert calls == (3 if ckpt else 2)  # the recomputation is a call of its own


class Checkpointed(nn.Module):
    """A block under activation checkpointing between two plain layers."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.block = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
        self.b = nn.Linear(256, 8)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # no saved generator state: memlord counts it, MemTracker never sees it
        h = checkpoint(
            self.block, self.a(x), use_reentrant=self.reentrant, preserve_rng_state=False
        )
        return self.b(h).square().mean()


@pytest.mark.parametrize(
    "tracked",
    ["track_modules", "ops_alone", "disabled_in_recompute"],
)
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recomputation_is_activation_as_memtracker_counts_it(reentrant, tracked):
    """Under activation checkpointing, the forward that backward runs again makes
    activations (MemTracker's Pre-Forward-AC to Post-Forward-AC, its ACT), not temporaries:
    each category at the step's peak is MemTracker's, with track_modules on or with
    ops=True alone (memlord then knows the recomputation from torch.utils.checkpoint's
    own state, MemTracker from its module hooks), and with a tracker disable()d inside
    the recomputed forward (the rest of that backward is temporary again)."""
    torch.manual_seed(0)
    lord = MemLord()
    x = torch.randn(32, 64)
    lord.allocate(x)  # the input: memlord's "other" (or "input"), MemTracker's Other
    hooks = lord.hook_into_python(ops=True)
    model = Checkpointed(reentrant)

    def step() -> None:
        model(x).backward()
        model.zero_grad(set_to_none=True)

    modules = lord.track_modules(model) if tracked != "ops_alone" else None
    if tracked == "disabled_in_recompute":

        def disable_in_backward(*_):
            if torch._C._current_graph_task_id() != -1 and modules is not None:
                modules.disable()  # inside the recomputed block, the measured step's

        model.block[2].register_forward_pre_hook(disable_in_backward)
    try:
        if tracked != "disabled_in_recompute":
            step()  # warm-up (which would disable the tracker before the measured step)
        gc.collect()
        lord.reset_peak_memory_stats("cpu")
        mt = MemTracker()
        mt.track_external(model, x)
        with mt:
            step()
        ours = lord.stats("cpu")["cpu"]["peak_categories"]
    finally:
        if modules is not None:
            modules.disable()
        hooks.disable()
    theirs = mt.get_tracker_snapshot("peak")[CPU]
    assert sum(ours.values()) == theirs["Total"]
    assert ours["activation"] == theirs[_MemRefType.ACT] > 0
    assert ours["temporary"] == theirs[_MemRefType.TEMP]
