"""fit_memory and find_batch_size: a few measured steps predict the peak of bigger ones.

The reference that does not trust memlord is torch's own MemTracker (a dispatch mode that
follows every storage the step makes, and the model's and optimizer's): the peak memlord
predicts for a batch it never ran is checked against MemTracker's peak of a real step of
that size, and against memlord's measurement of real steps (``validate``)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from support import warm
from support.tiny_lm import training

import memlord
from memlord import MemoryFit, find_batch_size, fit_memory

pytest.importorskip("torch.distributed._tools.mem_tracker")


_REFERENCE = r"""
import gc, json, sys
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from support.tiny_lm import training
from memlord import fit_memory

def memtracker_peak(model, opt, step, n):
    mt = MemTracker()
    mt.track_external(model, opt)
    with mt:
        step(n)
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])

def foreign_bytes(model, opt):
    # live tensors' storages that are neither the model's nor the optimizer's (a scan of
    # gc.get_objects()): they count in the device's peak, not in MemTracker's
    gc.collect()
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ours |= {p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None}
    ours |= {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()}
    seen = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            st = o.untyped_storage()
            if st.data_ptr() and st.data_ptr() not in ours:
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())

model, opt, step = training()
fit = fit_memory(step, (2, 4, 8))
foreign = foreign_bytes(model, opt)
measured_8 = fit.measured["cpu"][2]
predicted_16 = fit.predict(16)
ref_8 = memtracker_peak(model, opt, step, 8)
ref_16 = memtracker_peak(model, opt, step, 16)
print(json.dumps(dict(foreign=foreign, measured_8=measured_8, ref_8=ref_8,
                      predicted_16=predicted_16, ref_16=ref_16)))
"""


def _in_a_fresh_process(code: str, cwd) -> dict:
    """code run in a child of the warm interpreter (tests/support/warm.py: torch imported,
    nothing made, tests/ on its path): the JSON object its last line prints."""
    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = warm.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r})\n" + code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_measured_and_predicted_peaks_against_memtracker(tmp_path):
    """In a fresh process (MemTracker keeps the modules it tracked alive, which would
    count in the other tests' peaks): memlord's measured peak of a step of 8 equals
    MemTracker's within 1%, and its prediction for 16, a size it never ran, is within 3%
    of MemTracker's peak of a real step of 16."""
    got = _in_a_fresh_process(_REFERENCE, tmp_path)
    assert got["foreign"] < 0.001 * got["ref_8"]  # nothing else lives in that process
    assert got["measured_8"] - got["foreign"] == pytest.approx(got["ref_8"], rel=0.01)
    assert got["predicted_16"] - got["foreign"] == pytest.approx(got["ref_16"], rel=0.03)


def _untouched():
    return (
        torch._C._len_torch_dispatch_stack(),
        type(torch.empty).__name__,
        type(torch.Tensor.to).__name__,
        torch.UntypedStorage.resize_,
    )


def test_batch_fit_predicts_16_and_32_within_3_percent():
    model, opt, step = training()
    before = _untouched()
    fit = fit_memory(step, (2, 4, 8))
    assert _untouched() == before  # no mode, wrapper or hook left behind
    assert isinstance(fit, MemoryFit) and fit.device == "cpu"
    assert fit.terms == ("fixed", "linear") and fit.quadratic_bytes == 0.0
    assert fit.per_sample_bytes > 0 and fit.fixed_bytes > 0
    # the model's parameters (made before the fit) count: fixed holds them
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cats = fit.categories()
    # (other tests' leftover parameters, alive in this process, count too: a little)
    assert cats["fixed"]["parameter"] == pytest.approx(params, rel=0.01)
    assert cats["fixed"]["optimizer_state"] == pytest.approx(2 * params, rel=0.01)
    assert set(cats["per_sample"]) <= {"activation", "temporary", "input", "gradient"}
    assert cats["per_sample"]["activation"] > 0.5 * fit.per_sample_bytes
    assert max(abs(r) for r in fit.residuals) <= 0.01 * min(fit.measured["cpu"])

    # memlord's measurement of real steps of 16 and 32 (MemTracker's: below)
    assert abs(fit.validate(16)) <= 0.03
    assert abs(fit.validate(32)) <= 0.03


def test_sequence_sweep_with_the_quadratic_term_within_5_percent():
    """Attention scores grow with the square of the sequence length."""
    _model, _opt, step = training(optimizer="sgd")

    def by_length(seq_len: int) -> None:
        step(2, seq_len)

    fit = fit_memory(by_length, (128, 192, 256, 320), terms=("fixed", "linear", "quadratic"))
    assert fit.terms == ("fixed", "linear", "quadratic")
    # the scores of 2 layers x 4 heads x batch 2 in float32, a few of each alive
    assert fit.quadratic_bytes >= 2 * 4 * 2 * 4
    assert "quadratic" in fit.categories() and "quadratic_bytes=" in repr(fit)
    assert abs(fit.validate(512)) <= 0.05  # 1.6x the longest length fitted


def test_fit_runs_warmup_plus_one_step_per_size():
    calls = []

    def step(n: int) -> None:
        calls.append(n)
        keep = torch.empty(n, 1024)
        del keep

    fit = fit_memory(step, (3, 1, 2), warmup=2)
    assert calls == [3, 3, 3, 1, 2]
    # a step holding n KiB at its peak: 4096 bytes per sample; fixed is what else lives
    # in this process (other tests' leftovers, torch's own tensors)
    fixed = fit.fixed_bytes
    assert fit.per_sample_bytes == pytest.approx(4096, abs=1e-6)
    assert fit.predict(1000) == round(fixed) + 4096 * 1000
    assert fit.max_batch_size(round(fixed) + 4096 * 100, headroom=0.0) == 100
    assert fit.max_batch_size(2 * (round(fixed) + 4096 * 100), headroom=0.5) == 100
    assert fit.max_batch_size(round(fixed) + 100, headroom=0.0) == 0
    total = memlord._sizing._mem_total()
    assert fit.max_batch_size() == int((0.95 * total - fixed) // 4096)
    calls.clear()
    assert fit.validate(7) == pytest.approx(0.0, abs=1e-9)
    assert calls == [7]
    text = fit.summary()
    assert "per sample" in text and "4 KiB" in text and "residuals" in text
    assert repr(fit).startswith("MemoryFit(device='cpu', fixed_bytes=")
    assert "per_sample_bytes=4096.0, batch_sizes=(3, 1, 2))" in repr(fit)


def test_a_leftover_tensor_memlord_cannot_read_does_not_stop_the_fit(monkeypatch):
    """The fit counts what already lives in the process; a tensor whose storage cannot be
    read (a FunctionalTensor left behind by a FunctionalTensorMode, as torch.compile's
    tracing can leave one; CI met one left by another test) makes allocate() refuse the
    whole call.  The fit counts the others and goes on (it raised TypeError before).  The
    scan is made to find that tensor here: which leftovers a process has is chance."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    import memlord._snapshot as snap

    with FunctionalTensorMode():
        kept = torch.ones(3) + 1
    params = torch.nn.Parameter(torch.ones(1000))
    with pytest.raises(TypeError, match="cannot be read"):
        memlord.MemLord().allocate([params, kept])
    real = snap._live_tensors
    leftovers = [kept]
    monkeypatch.setattr(snap, "_live_tensors", lambda: [*real(), *leftovers])

    def step(n: int) -> None:
        keep = torch.empty(n, 1024)
        del keep

    fit = fit_memory(step, (1, 2, 4))
    assert fit.per_sample_bytes == pytest.approx(4096, abs=1e-6)
    assert fit.fixed_bytes >= params.nbytes - 1  # the parameter was counted (a float fit)
    leftovers.clear()


def test_a_step_that_raises_passes_through_with_the_size_and_leaves_nothing():
    before = _untouched()

    def step(n: int) -> None:
        torch.ones(n)
        if n == 4:
            raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        fit_memory(step, (2, 4, 8))
    if sys.version_info >= (3, 11):
        assert any("batch_size=4" in note for note in info.value.__notes__)
    assert _untouched() == before


def _oom_above(limit: int, seen: list):
    def step(n: int) -> None:
        seen.append((n, sys.exc_info()[0]))
        x = torch.ones(n, 256)
        if n > limit:
            torch.empty(1 << 50)  # RuntimeError: DefaultCPUAllocator: can't allocate memory
        del x

    return step


def test_find_batch_size_shrinks_after_a_real_oom_outside_the_except_frame():
    seen: list = []
    n, fit = find_batch_size(_oom_above(20, seen), 64)
    assert n == 19  # 64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19: 10% smaller each time
    assert isinstance(fit, MemoryFit)
    assert [s for s, _ in seen] == [1, 1, 2, 4, 64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19]
    # every retry ran with no exception being handled
    assert all(exc is None for _, exc in seen)


_RIGHT_PREDICTION = r"""
import gc, json, sys
import torch
from memlord import find_batch_size

seen = []

def step(n):
    seen.append(n)
    x = torch.ones(n, 256)  # 1 KiB per sample
    del x

keep = torch.ones(3, 1024)  # 12 KiB alive through the fit: fixed bytes
held = {}  # the CPU storages of the tensors alive before the fit, by a scan of the GC's objects
for o in gc.get_objects():
    if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
        s = o.untyped_storage()
        held[s.data_ptr()] = s.nbytes()
n, fit = find_batch_size(step, 1000, budget=100 * 1024)
print(json.dumps({"n": n, "seen": seen, "held": sum(held.values()), "fixed": fit.fixed_bytes,
                  "per_sample": fit.per_sample_bytes,
                  "max": fit.max_batch_size(100 * 1024)}))
"""


def test_find_batch_size_trusts_a_right_prediction(tmp_path):
    # in a fresh process: in this one, what tests run before left alive counts in
    # fixed_bytes (in a random order, enough to move the prediction anywhere)
    got = _in_a_fresh_process(_RIGHT_PREDICTION, tmp_path)
    assert got["per_sample"] == pytest.approx(1024)
    # what the fit holds fixed is what the GC's objects held before it, within a sample
    assert got["held"] >= 12 * 1024
    assert got["fixed"] == pytest.approx(got["held"], abs=1024)
    # a budget of 100 KiB at 5% headroom predicts 95, less what was held (83)
    n = int((0.95 * 100 * 1024 - got["fixed"]) // 1024)
    assert got["n"] == got["max"] == n > 80
    # warm-up, the three fitted sizes, one confirming step of the predicted size
    assert got["seen"] == [1, 1, 2, 4, n]


def test_find_batch_size_without_growth_starts_at_start():
    """A step whose peak does not grow with the batch: nothing bounds it, so the
    confirmation starts at ``start`` and shrinks on real OOMs."""
    seen = []

    def step(n: int) -> None:
        seen.append(n)
        if n > 4:
            torch.empty(1 << 50)

    assert find_batch_size(step, 8, batch_sizes=(1, 2), budget=10**15)[0] == 4
    assert seen == [1, 1, 2, 8, 7, 6, 5, 4]


def test_find_batch_size_gives_up_below_one():
    calls = []

    def step(n: int) -> None:
        calls.append(n)
        if len(calls) > 3:  # the fit's three steps ran; nothing fits after
            torch.empty(1 << 50)

    with pytest.raises(RuntimeError, match="can't allocate memory") as info:
        find_batch_size(step, 3, batch_sizes=(1, 2), budget=10**15)
    assert calls == [1, 1, 2, 3, 2, 1]
    if sys.version_info >= (3, 11):
        assert any("down to batch_size=1" in n for n in info.value.__notes__)

    def always(n: int) -> None:
        if n >= 3:
            torch.empty(1 << 50)

    with pytest.raises(RuntimeError) as info:
        find_batch_size(always, 8, batch_sizes=(1, 3), budget=10**15)
    if sys.version_info >= (3, 11):  # the fit's own size 3 failed: named
        assert any("batch_size=3" in n for n in info.value.__notes__)


def test_a_non_oom_error_of_the_confirming_step_passes_through():
    def step(n: int) -> None:
        if n > 4:
            raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape") as info:
        find_batch_size(step, 16)
    if sys.version_info >= (3, 11):
        assert any("batch_size=16" in n for n in info.value.__notes__)


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: fit_memory(3), TypeError, ["fit_memory()", "'step'", "int"]),
        (lambda: fit_memory(print, (4,)), ValueError, ["'batch_sizes'", "at least 2"]),
        (
            lambda: fit_memory(print, (1, 2), terms=("fixed", "linear", "quadratic")),
            ValueError,
            ["'batch_sizes'", "at least 3"],
        ),
        (lambda: fit_memory(print, (0, 2)), ValueError, ["'batch_sizes'", "positive", "0"]),
        (lambda: fit_memory(print, (2, -1)), ValueError, ["'batch_sizes'", "-1"]),
        (lambda: fit_memory(print, (2, 2, 4)), ValueError, ["'batch_sizes'", "2 twice"]),
        (lambda: fit_memory(print, (2, 4.0)), TypeError, ["'batch_sizes'", "float"]),
        (lambda: fit_memory(print, 8), TypeError, ["'batch_sizes'", "int"]),
        (lambda: fit_memory(print, (1, 2), warmup=-1), ValueError, ["'warmup'", ">= 0"]),
        (lambda: fit_memory(print, (1, 2), terms=("cubic",)), ValueError, ["'terms'", "cubic"]),
        (lambda: fit_memory(print, (1, 2), device=3), TypeError, ["'device'", "int"]),
        (lambda: fit_memory(print, (1, 2), device="gpu:x"), ValueError, ["'device'", "gpu:x"]),
        (lambda: find_batch_size("step", 8), TypeError, ["find_batch_size()", "'step'", "str"]),
        (lambda: find_batch_size(print, 1), ValueError, ["'start'", ">= 2"]),
        (lambda: find_batch_size(print, 2.5), TypeError, ["'start'", "float"]),
    ],
)
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_fit_methods_check_their_arguments():
    fit = fit_memory(lambda n: torch.ones(n), (1, 2), warmup=0)
    with pytest.raises(TypeError, match="'batch_size'"):
        fit.predict(2.0)
    with pytest.raises(ValueError, match="'batch_size'"):
        fit.predict(0)
    with pytest.raises(ValueError, match="'device'"):
        fit.predict(2, device="cuda:3")
    with pytest.raises(ValueError, match="'headroom'"):
        fit.max_batch_size(100, headroom=1.0)
    with pytest.raises(ValueError, match="'budget'"):
        fit.max_batch_size(-1)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_cpu_with_an_index_is_the_cpu(device):
    """torch has one CPU device: ``"cpu:0"`` is where ``torch.empty(device="cpu:0")``
    lives and what memlord's ledger counts as ``"cpu"``. A fit asked for it measures the
    CPU, not an empty device of its own whose prediction is 0 bytes."""
    fit = fit_memory(lambda n: torch.ones(n, 256), (1, 2), warmup=0, device=device)
    assert fit.device == "cpu" and fit.devices == ("cpu",)
    assert fit.predict(4) >= 4 * 256 * 4
    assert fit.predict(4, device=device) == fit.predict(4, device="cpu")
    assert fit.max_batch_size(64 << 10, headroom=0, device=device) == fit.max_batch_size(
        64 << 10, headroom=0
    )


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"budget": -1}, ValueError, ["find_batch_size()", "'budget'", "-1"]),
        ({"budget": 1.5}, TypeError, ["find_batch_size()", "'budget'", "float"]),
        ({"headroom": 1.0}, ValueError, ["find_batch_size()", "'headroom'"]),
        ({"headroom": "5%"}, TypeError, ["find_batch_size()", "'headroom'", "str"]),
    ],
)
def test_find_batch_size_checks_budget_and_headroom_before_any_step(kwargs, exc, words):
    """A bad ``budget`` or ``headroom`` is an error naming it before a single step runs:
    not a fit of real steps first, and never taken for "nothing bounds the batch" (a
    negative budget ran a step of size ``start``)."""
    seen: list = []
    with pytest.raises(exc) as info:
        find_batch_size(seen.append, 64, **kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert seen == []
