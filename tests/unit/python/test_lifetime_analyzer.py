"""LifetimeAnalyzer over a lord's event ring, and fed by hand.

The references: the ledger's own peak and its categories at the peak (themselves equal to
torch's MemTracker on such steps, tests/integration/test_ops_vs_memtracker.py), the
bytes of tensors the test makes itself (``numel * element_size``), and the modules of the
model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.tiny_lm import training

import memlord
from memlord import LifetimeAnalyzer, MemLord, ReusePlan


def _train(steps: int = 3, keep_history: bool = False, scratch: bool = True):
    model, opt, step = training(seq=32)
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(1 << 16)
    history = []
    with lord.hook_into_python(ops=True), lord.track_modules(model) as tracker:
        for _ in range(steps):
            step(4)
            if scratch:
                buf = torch.empty(4096)  # 16 KiB made and freed here every step
                del buf
            if keep_history:
                history.append(torch.ones(8192))  # 32 KiB per step, kept: never freed
            lord.step()
    return lord, model, opt, tracker, history


def test_peak_composition_is_the_ledgers_peak():
    lord, model, opt, _t, _h = _train()
    a = LifetimeAnalyzer(lord, modules=model)
    pc = a.peak_composition()
    stats = lord.stats()["cpu"]
    assert pc["device"] == "cpu"
    assert pc["bytes"] == stats["peak_allocated"]
    assert pc["by_category"] == {c: b for c, b in stats["peak_categories"].items() if b}
    assert sum(pc["by_module"].values()) == sum(pc["by_region"].values()) == pc["bytes"]
    assert sum(pc["by_site"].values()) == pc["bytes"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pc["by_category"]["parameter"] == params
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert pc["by_category"]["optimizer_state"] == state
    # the blocks' activations are attributed to them; modules are the model's
    assert {"blocks.0", "blocks.1"} <= set(pc["by_module"])
    names = {n for n, _ in model.named_modules()} | {"TinyLM", None}
    assert set(pc["by_module"]) <= names
    assert a.steps() == [1, 2, 3]
    # the rows: each storage's bytes, category, module; the live ones sum to the ledger
    rows = a.storages()
    alive = rows["death"] == np.iinfo(np.int64).max
    assert int(rows["nbytes"][alive].sum()) == stats["allocated"]
    cats = rows["tables"]["category"]
    params_rows = rows["category"] == cats.index("parameter")
    assert int(rows["nbytes"][params_rows].sum()) == params
    assert (rows["birth"] < rows["death"]).all()
    mods = rows["tables"]["module"]
    assert {"blocks.0", "blocks.1"} <= {mods[i] for i in rows["module"].tolist() if i >= 0}
    # per step: the first step has no optimizer state until its end; the peak is later
    firsts = a.peak_composition(step=1)
    assert firsts["step"] == 1 and firsts["bytes"] <= pc["bytes"]
    assert a.peak_composition(step=3)["bytes"] == stats["peak_allocated"]
    assert "LifetimeAnalyzer(storages=" in repr(a)


def test_suggestions_find_checkpoints_preallocation_history_and_optimizer_state():
    lord, model, opt, _t, history = _train(steps=4, keep_history=True)
    a = LifetimeAnalyzer(lord, modules=model)
    got = a.get_optimization_suggestions()
    assert got["device"] == "cpu" and got["peak_bytes"] == a.peak_composition()["bytes"]
    kinds = {s["kind"] for s in got["suggestions"]}
    assert {"checkpoint", "preallocate", "free_earlier", "offload_optimizer"} <= kinds
    by_bytes = [s["bytes"] for s in got["suggestions"]]
    assert by_bytes == sorted(by_bytes, reverse=True)
    for s in got["suggestions"]:
        assert s["bytes"] > 0 and s["text"] and isinstance(s["evidence"], dict)
    ck = [s for s in got["suggestions"] if s["kind"] == "checkpoint"]
    assert {s["target"] for s in ck} >= {"blocks.0", "blocks.1"}
    for s in ck:
        assert s["bytes"] < s["evidence"]["activation_bytes_at_peak"]
    # the history list: a 32 KiB storage per earlier step, alive across the peak
    held = [s for s in got["suggestions"] if s["kind"] == "free_earlier"]
    hist = [s for s in held if s["target"] and "test_lifetime_analyzer.py" in s["target"]]
    assert hist and hist[0]["bytes"] >= 32768 * (got["step"] - 1)
    opt_s = next(s for s in got["suggestions"] if s["kind"] == "offload_optimizer")
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    assert opt_s["bytes"] == state
    # the reuse plan of the peak's step
    plan = a.compute_reuse_plan(step=got["step"])
    assert isinstance(plan, ReusePlan)
    assert got["reusable_bytes"] == plan.saved_bytes > 0
    assert plan.bytes_after < plan.bytes_before
    assert "saves" in plan.summary() and "ReusePlan(device='cpu'" in repr(plan)
    del history


def test_preallocate_names_the_line_size_and_buffers():
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(4096)
    with lord.hook_into_python(ops=True):
        for _ in range(3):
            a = torch.empty(1000)  # two 4000-byte storages alive at once, every step
            b = torch.empty(1000)
            del a, b
            c = torch.empty(10)
            del c
            lord.step()
    got = LifetimeAnalyzer(lord).get_optimization_suggestions()
    pre = [s for s in got["suggestions"] if s["kind"] == "preallocate"]
    assert [(s["evidence"]["nbytes"], s["evidence"]["per_step"]) for s in pre] == [
        (4000, 1),
        (4000, 1),
        (40, 1),
    ]
    assert all(s["evidence"]["steps"] == 3 and s["evidence"]["allocations"] == 3 for s in pre)
    assert all("test_lifetime_analyzer.py" in s["target"] for s in pre)
    # a and b are one buffer each (they overlap); c reuses a's: 8000 bytes a step instead
    # of 8040
    assert got["reusable_bytes"] == 40


def test_a_window_of_steps():
    lord, model, _o, _t, _h = _train(steps=4)
    assert LifetimeAnalyzer(lord, steps=2).steps() == [3, 4]
    assert LifetimeAnalyzer(lord, steps=range(2, 4)).steps() == [2, 3]
    a = LifetimeAnalyzer(lord, steps=[1])
    assert a.peak_composition()["bytes"] == a.peak_composition(step=1)["bytes"]
    with pytest.raises(ValueError, match="'step'"):
        a.peak_composition(step=3)


def test_a_window_of_steps_the_ring_does_not_hold_is_refused():
    """LifetimeAnalyzer(lord, steps=[99]) on a ring without step 99 gave an empty analysis
    (peak 0 bytes, no suggestions) where peak_composition(step=99) raises: both refuse a
    step the ring does not hold, naming the argument, the missing steps and the steps the
    ring holds, and change nothing."""
    lord, *_ = _train(steps=3)
    events, stats = lord.events().copy(), lord.stats()
    for window, missing in (([99], "[99]"), ([2, 99, 100], "[99, 100]"), (range(3, 6), "[4, 5]")):
        with pytest.raises(ValueError) as info:
            LifetimeAnalyzer(lord, steps=window)
        text = str(info.value)
        assert text.startswith("LifetimeAnalyzer(): argument 'steps'"), text
        assert missing in text and "holds steps [1, 2, 3]" in text, text
    assert np.array_equal(lord.events(), events) and lord.stats() == stats
    a = LifetimeAnalyzer(lord, steps=[2, 3])  # held: as before
    assert a.steps() == [2, 3]
    assert LifetimeAnalyzer(lord, steps=5).steps() == [1, 2, 3]  # "the last 5": all 3
    with pytest.raises(ValueError) as info:
        a.peak_composition(step=99)
    text = str(info.value)
    assert text.startswith("peak_composition(): argument 'step'") and "99" in text, text
    assert "its steps: [2, 3]" in text, text


@pytest.mark.parametrize(
    "query",
    ["peak_composition", "compute_reuse_plan", "get_optimization_suggestions"],
)
def test_a_window_of_steps_not_recorded_by_hand_is_refused_by_the_queries(query):
    """Fed by hand, the analyzer learns its steps after it is made: a query over a window
    that names steps not recorded raises as the ring analyzer's constructor does, and
    works once they are."""
    a = LifetimeAnalyzer(steps=[1, 99])
    a.record_usage(0, torch.ones(10))
    a.record_usage(1, torch.ones(20))
    with pytest.raises(ValueError) as info:
        getattr(a, query)()
    text = str(info.value)
    assert text.startswith(f"{query}(): the window (argument 'steps' of LifetimeAnalyzer())")
    assert "[99]" in text and "recorded steps: [0, 1]" in text, text
    a.record_usage(99, torch.ones(30))
    assert a.steps() == [1, 99]
    getattr(a, query)()


def test_storages_born_before_the_ring_count():
    """Parameters made before recording started, and a storage freed during the ring
    that was born before it, are in the picture."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(ops=True):
        old = torch.ones(1000)  # 4000 bytes, before the ring
        keep = torch.ones(500)  # 2000 bytes, alive throughout
        lord.record_events(1024)
        x = torch.ones(250)  # 1000 bytes
        del old
        y = torch.ones(100)
        lord.step()
    a = LifetimeAnalyzer(lord)
    pc = a.peak_composition()
    assert pc["bytes"] == 4000 + 2000 + 1000 == lord.stats()["cpu"]["peak_allocated"]
    del keep, x, y


def test_record_usage_by_hand():
    a = LifetimeAnalyzer()
    w = torch.nn.Parameter(torch.ones(100))  # 400 bytes, every step
    t1, t2, t3 = torch.ones(50), torch.ones(50), torch.ones(25)
    a.record_usage(0, [w, t1])
    a.record_usage(1, {"w": w, "a": t1, "b": t2})
    a.record_usage(2, (w, t2[:10], t3))  # a view: the same storage as t2
    a.record_usage(3, w)
    assert a.steps() == [0, 1, 2, 3]
    pc = a.peak_composition()
    assert pc["bytes"] == 400 + 200 + 200 and pc["step"] == 1
    assert pc["by_category"] == {"parameter": 400, "other": 400}
    assert a.peak_composition(step=2)["bytes"] == 400 + 200 + 100
    plan = a.compute_reuse_plan()
    # t1 [0, 2), t3 [2, 3) share one buffer; t2 [1, 3) needs its own
    assert plan.bytes_before == 200 + 200 + 100 and plan.bytes_after == 400
    got = a.get_optimization_suggestions()
    assert got["peak_bytes"] == 800 and isinstance(got["reusable_bytes"], int)


def _fed() -> LifetimeAnalyzer:
    a = LifetimeAnalyzer()
    a.record_usage(0, torch.ones(10))
    return a


@pytest.mark.parametrize(
    ("call", "exc", "words"),
    [
        (lambda: LifetimeAnalyzer("lord"), TypeError, ["'lord'", "MemLord", "str"]),
        (lambda: LifetimeAnalyzer(MemLord()), ValueError, ["'lord'", "record_events"]),
        (lambda: LifetimeAnalyzer(steps=0), ValueError, ["'steps'", ">= 1"]),
        (lambda: LifetimeAnalyzer(steps="all"), TypeError, ["'steps'", "str"]),
        (lambda: LifetimeAnalyzer(modules=3), TypeError, ["'modules'", "int"]),
        (lambda: LifetimeAnalyzer().record_usage(1.5, []), TypeError, ["'step'", "float"]),
        (lambda: LifetimeAnalyzer().record_usage(1, 3), TypeError, ["'tensors'", "int"]),
        (lambda: LifetimeAnalyzer().record_usage(1, [3]), TypeError, ["'tensors'", "int"]),
        (lambda: LifetimeAnalyzer().peak_composition(step="1"), TypeError, ["'step'", "str"]),
        # a device torch cannot parse: a ValueError naming it, not torch's RuntimeError
        (lambda: _fed().peak_composition(device="gpu"), ValueError, ["'device'", "'gpu'"]),
        (lambda: _fed().compute_reuse_plan(device="gpu"), ValueError, ["'device'", "'gpu'"]),
        (
            lambda: _fed().get_optimization_suggestions(device="cuda:x"),
            ValueError,
            ["'device'", "'cuda:x'"],
        ),
        (lambda: _fed().peak_composition(device=0), TypeError, ["'device'", "int"]),
    ],
)
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_record_usage_on_a_ring_analyzer_is_refused():
    lord = MemLord()
    lord.record_events(16)
    a = LifetimeAnalyzer(lord)
    with pytest.raises(RuntimeError, match="record_usage"):
        a.record_usage(0, [torch.ones(1)])


def test_exported():
    assert {"LifetimeAnalyzer", "ReusePlan", "fit_memory", "find_batch_size", "MemoryFit"} <= set(
        memlord.__all__
    )
