"""memlord's output through the logging module: DEBUG=1 read while the program runs, one
record per event and one summary per explicit call, a colored stderr handler only on a
terminal or with FORCE_COLOR, never with NO_COLOR, nothing printed by default."""

import logging
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import fake_cuda, here
from support import warm
from torch import nn

from memlord import MemLord
from memlord._log import ColorFormatter
from memlord._sites import relative_path

HERE = relative_path(__file__)
TAGS = ("[allocate]", "[free]", "[allocate-summary]", "[free-summary]", "[auto_gc]", "[reset]")


def _summary_block(out, header):
    """The lines of the single summary record headed `header`."""
    lines = out.splitlines()
    starts = [i for i, ln in enumerate(lines) if header in ln]
    assert len(starts) == 1, out
    block = [lines[starts[0]]]
    for ln in lines[starts[0] + 1 :]:
        if any(tag in ln for tag in TAGS):
            break
        block.append(ln)
    return block


def test_silent_without_debug(lord, capsys, memlog):
    t = torch.empty(10)
    lord.allocate(t)
    lord.free(t)
    lord.reset()
    lord.allocated()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert memlog.text() == ""


def test_silent_with_debug_zero(lord, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "0")
    t = torch.empty(10)
    lord.allocate(t)
    lord.free(t)
    lord.reset()
    assert memlog.text() == ""


def test_allocate_record_is_one_line(lord, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    lord.allocate(torch.empty(10))
    line = here() - 1
    records = memlog.records()
    assert all(r.levelname == "DEBUG" for r in records)
    out = memlog.text()
    assert (
        out
        == f"[allocate] cpu +40 B (1 storage) float32[10] at {HERE}:{line}; cpu allocated 40 B\n"
    )


def test_free_record(lord, memlog, monkeypatch):
    t = torch.empty(10)
    lord.allocate(t)
    monkeypatch.setenv("DEBUG", "1")
    lord.free(t)
    out = memlog.text()
    assert out.startswith("[free] cpu -40 B (1 storage)") and out.count("\n") == 1
    assert "[allocate" not in out


def test_reset_record(lord, memlog, monkeypatch):
    lord.allocate(torch.empty(1))
    monkeypatch.setenv("DEBUG", "1")
    lord.reset()
    assert "[reset] counters and hotspots cleared" in memlog.text()


def test_one_summary_line_per_call_that_spans_devices(lord, memlog, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    m = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    objs = [m, torch.empty(4), np.zeros(3), fake_cuda(3, 0), fake_cuda(4, 1)]
    for _ in range(3):
        lord.allocate(objs)
    lord.free(objs)
    lord.free(objs[1])  # one device: no summary
    out = memlog.text()
    assert out.count("[allocate-summary]") == 3
    assert out.count("[free-summary]") == 1
    (summary,) = [ln for ln in out.splitlines() if ln.startswith("[free-summary]")]
    assert " on 3 devices at " in summary
    for dev in ("cpu", "cuda:0", "cuda:1"):
        assert f"{dev} allocated" in summary, summary


def test_debug_is_read_while_the_program_runs(lord, memlog, monkeypatch):
    t = torch.empty(3)
    lord.allocate(t)
    assert memlog.text() == ""
    monkeypatch.setenv("DEBUG", "1")
    lord.allocate(t)
    assert "[allocate]" in memlog.text()
    monkeypatch.delenv("DEBUG")
    lord.allocate(t)
    assert memlog.text() == ""
    monkeypatch.setenv("DEBUG", "1")
    lord.free(t)
    assert "[free]" in memlog.text()
    monkeypatch.setenv("DEBUG", "0")
    lord.free(t)
    assert memlog.text() == ""


def test_level_changes_between_events_are_seen_at_once(lord, memlog):
    """memlord keeps its answer to "is DEBUG on?" between events while neither the
    environment nor the logger's cache changes; any change is seen at the next event."""
    logger = logging.getLogger("memlord")
    t = torch.empty(3)
    for _ in range(3):  # the same answer, kept
        lord.allocate(t)
    assert memlog.text() == ""
    logger.setLevel(logging.DEBUG)
    for _ in range(3):
        lord.allocate(t)
    assert memlog.text().count("[allocate]") == 3
    logging.disable(logging.DEBUG)  # the process-wide switch: it clears every cache too
    lord.allocate(t)
    assert memlog.text() == ""
    logging.disable(logging.NOTSET)
    lord.allocate(t)
    assert "[allocate]" in memlog.text()
    logger.setLevel(logging.INFO)
    lord.allocate(t)
    assert memlog.text() == ""
    os.environ["DEBUG"] = "1"  # os.environ itself, as a program would
    try:
        lord.allocate(t)
        assert "[allocate]" in memlog.text()
    finally:
        del os.environ["DEBUG"]
    lord.allocate(t)
    assert memlog.text() == ""


def test_the_answer_is_kept_between_hooked_casts(lord, memlog, monkeypatch):
    """A hooked cast does not work out again whether to log while neither os.environ nor
    the logger's levels changed: on 3.10 and 3.11 the dicts' version tags say so, on 3.12
    and 3.13 (no version tag) a dict watcher.  Without it every cast asked (about 500
    instructions each, a third of memlord's part of the cast).  A change is still seen at
    the next cast."""
    from memlord import _core

    monkeypatch.delenv("DEBUG", raising=False)
    t = torch.zeros(256)
    with lord.hook_into_torch():
        for _ in range(10):
            t.half()
        before, watched = _core._testing.log_info()
        for _ in range(1000):
            t.half()
        after, _ = _core._testing.log_info()
        assert watched
        assert after - before == 0
        assert memlog.text() == ""
        monkeypatch.setenv("DEBUG", "1")
        t.half()
        assert memlog.text().count("[allocate]") == 1
        monkeypatch.delenv("DEBUG")
        t.half()
        assert memlog.text() == ""
        logging.getLogger("memlord").setLevel(logging.DEBUG)
        t.half()
        assert memlog.text().count("[allocate]") == 1


def test_application_enabling_debug_sees_records_without_the_variable(lord, caplog):
    caplog.set_level(logging.DEBUG, logger="memlord")
    lord.allocate(torch.empty(3))
    assert any("[allocate]" in r.getMessage() for r in caplog.records)


def test_hook_records_name_the_tensor(lord, memlog, monkeypatch):
    with lord.hook_into_torch():
        monkeypatch.setenv("DEBUG", "1")
        torch.empty(4, 8).half()
        line = here() - 1
    out = memlog.text()
    assert f"[allocate] (hook) cpu +64 B (1 storage) float16[4, 8] at {HERE}:{line}" in out, out
    assert "cpu allocated 64 B" in out


def test_no_log_on_queries(lord, memlog, monkeypatch):
    lord.allocate(torch.empty(3))
    monkeypatch.setenv("DEBUG", "1")
    lord.allocated()
    lord.freed("cpu")
    lord.stats()
    lord.top_alloc_site()
    repr(lord)
    assert memlog.text() == ""


def test_color_formatter(monkeypatch):
    record = logging.LogRecord("memlord", logging.DEBUG, __file__, 1, "[free] x", None, None)
    record.color = "32"
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert ColorFormatter().format(record) == "\x1b[32mmemlord: [free] x\x1b[0m"
    monkeypatch.setenv("NO_COLOR", "1")  # NO_COLOR wins over FORCE_COLOR
    assert ColorFormatter().format(record) == "memlord: [free] x"
    monkeypatch.delenv("NO_COLOR")
    monkeypatch.delenv("FORCE_COLOR")
    assert ColorFormatter().format(record) == "memlord: [free] x"  # not a terminal


SCRIPT = textwrap.dedent(
    """\
    import logging, os, sys, torch
    from memlord import MemLord
    {setup}
    lord = MemLord(auto_gc_bytes=4)
    t = torch.empty(4)
    lord.allocate(t)
    lord.free(t)
    print("done")
    """
)


def _run(env_extra, setup=""):
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "NO_COLOR", "FORCE_COLOR")}
    env.update(env_extra)
    # DEBUG, NO_COLOR and FORCE_COLOR are read while the program runs: a child of the warm
    # interpreter (tests/support/warm.py) sees them as a fresh process does
    return warm.run(
        [sys.executable, "-c", SCRIPT.format(setup=setup)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_debug_handler_writes_to_stderr_plain_when_not_a_terminal():
    r = _run({"DEBUG": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "done\n"
    assert "memlord: [allocate] cpu +16 B" in r.stderr
    assert "memlord: [free] cpu -16 B" in r.stderr
    assert "\x1b[" not in r.stderr


def test_debug_handler_colors_with_force_color_not_with_no_color():
    r = _run({"DEBUG": "1", "FORCE_COLOR": "1"})
    assert "\x1b[31mmemlord: [allocate]" in r.stderr, r.stderr
    assert "\x1b[32mmemlord: [free]" in r.stderr, r.stderr
    r = _run({"DEBUG": "1", "FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert "[allocate]" in r.stderr and "\x1b[" not in r.stderr


def test_nothing_printed_by_default_even_when_auto_gc_runs():
    r = _run({})
    assert r.returncode == 0 and r.stdout == "done\n" and r.stderr == "", r.stderr


def test_application_handler_is_used_instead_of_ours():
    setup = (
        "logging.basicConfig(stream=sys.stdout, format='APP %(levelname)s %(message)s', "
        "level=logging.WARNING)"
    )
    r = _run({"DEBUG": "1"}, setup)
    assert r.returncode == 0, r.stderr
    assert "APP DEBUG [allocate]" in r.stdout
    assert r.stderr == ""  # no second handler of memlord's own


def test_info_enabled_shows_auto_gc_without_debug():
    setup = "logging.basicConfig(stream=sys.stdout, format='APP %(message)s', level=logging.INFO)"
    r = _run({}, setup)
    assert r.returncode == 0, r.stderr
    # cpu has no cache: the record is about a fake device only when one frees; here none
    assert "[allocate]" not in r.stdout  # DEBUG records stay off at INFO


@pytest.mark.parametrize("method", ["allocate", "free"])
def test_log_goes_to_the_memlord_logger(lord, memlog, monkeypatch, method):
    monkeypatch.setenv("DEBUG", "1")
    getattr(lord, method)(torch.empty(3))
    assert all(r.name == "memlord" for r in memlog.records())
    assert f"[{method}]" in memlog.text()


def test_long_site_path_not_truncated(lord, memlog, monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200) / ("g" * 200)
    deep.mkdir(parents=True)
    script = deep / "user_script_with_a_long_name.py"
    script.write_text("def run(lord, t):\n    lord.allocate(t)\n")
    ns = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    monkeypatch.setenv("DEBUG", "1")
    ns["run"](lord, torch.empty(3))
    out = memlog.text()
    assert f"{script}:2" in out
    assert lord.top_alloc_site()[1] == f"{script}:2"


def test_auto_gc_record_on_fake_device(memlog):
    gc_lord = MemLord(auto_gc_bytes=4)
    gc_lord.free(fake_cuda(1, 0))
    (record,) = [r for r in memlog.records() if "[auto_gc]" in r.getMessage()]
    assert record.levelname == "INFO"
    assert record.getMessage().startswith("[auto_gc] cuda:0 band=bytes")
