"""DEBUG=1 colored log lines on stdout, read at call time; NO_COLOR; one summary per call."""

import re

import numpy as np
import pytest
import torch
from conftest import fake_cuda
from torch import nn

RED, GREEN, YELLOW, MAGENTA, CYAN = "\x1b[31m", "\x1b[32m", "\x1b[33m", "\x1b[35m", "\x1b[36m"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TAGS = ("[allocate]", "[free]", "[allocate-summary]", "[free-summary]", "[auto_gc]", "[reset]")


def _colored(line, color, tag):
    return tag in line and color in line and line.index(color) < line.index(tag)


def _summary_block(out, header):
    """The lines of the single summary block headed `header`, header line included."""
    lines = out.splitlines()
    starts = [i for i, ln in enumerate(lines) if header in ln]
    assert len(starts) == 1, out
    block = [lines[starts[0]]]
    for ln in lines[starts[0] + 1 :]:
        if any(tag in ln for tag in TAGS):
            break
        block.append(ln)
    return block


def test_silent_without_debug(lord, capsys):
    t = torch.empty(10)
    lord.allocate(t)
    lord.free(t)
    lord.reset()
    lord.allocated()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_silent_with_debug_zero(lord, capsys, monkeypatch):
    monkeypatch.setenv("DEBUG", "0")
    t = torch.empty(10)
    lord.allocate(t)
    lord.free(t)
    lord.reset()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_allocate_line_red_and_one_cyan_summary(lord, capsys, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    lord.allocate(torch.empty(10))
    out = capsys.readouterr().out
    assert any(_colored(ln, RED, "[allocate]") for ln in out.splitlines()), out
    assert out.count("[allocate-summary]") == 1
    assert "[free" not in out
    block = _summary_block(out, "[allocate-summary]")
    assert CYAN in block[0]
    assert any("cpu" in ln for ln in block[1:]), block


def test_free_line_green_and_one_summary(lord, capsys, monkeypatch):
    t = torch.empty(10)
    lord.allocate(t)
    monkeypatch.setenv("DEBUG", "1")
    lord.free(t)
    out = capsys.readouterr().out
    assert any(_colored(ln, GREEN, "[free]") for ln in out.splitlines()), out
    assert out.count("[free-summary]") == 1
    assert "[allocate" not in out
    block = _summary_block(out, "[free-summary]")
    assert CYAN in block[0]
    assert any("cpu" in ln for ln in block[1:])


def test_reset_line_magenta(lord, capsys, monkeypatch):
    lord.allocate(torch.empty(1))
    monkeypatch.setenv("DEBUG", "1")
    lord.reset()
    out = capsys.readouterr().out
    assert any(_colored(ln, MAGENTA, "[reset]") for ln in out.splitlines()), out


def test_exactly_one_summary_per_call_for_many_storages(lord, capsys, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    m = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])
    objs = [m, torch.empty(4), np.zeros(3), fake_cuda(3, 0), fake_cuda(4, 1)]
    for _ in range(3):
        lord.allocate(objs)
    lord.free(objs)
    lord.free(objs[1])
    out = capsys.readouterr().out
    assert out.count("[allocate-summary]") == 3
    assert out.count("[free-summary]") == 2


def test_summary_has_line_per_known_device_and_per_multi_device_type(lord, capsys, monkeypatch):
    lord.allocate([torch.empty(2), fake_cuda(3, 0), fake_cuda(4, 1)])
    monkeypatch.setenv("DEBUG", "1")
    lord.free(torch.empty(1))  # a cpu-only call still summarises every known device
    out = capsys.readouterr().out
    block = [ANSI.sub("", ln) for ln in _summary_block(out, "[free-summary]")[1:]]
    assert any("cuda:0" in ln for ln in block), block
    assert any("cuda:1" in ln for ln in block), block
    assert any("cpu" in ln for ln in block), block
    # one aggregate line for the type "cuda", which has two devices; none for "cpu" alone
    assert any(re.search(r"\bcuda\b(?!:)", ln) for ln in block), block


def test_debug_is_read_at_call_time(lord, capsys, monkeypatch):
    t = torch.empty(3)
    lord.allocate(t)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("DEBUG", "1")
    lord.allocate(t)
    assert "[allocate-summary]" in capsys.readouterr().out
    monkeypatch.delenv("DEBUG")
    lord.allocate(t)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("DEBUG", "1")
    lord.free(t)
    assert "[free-summary]" in capsys.readouterr().out
    monkeypatch.setenv("DEBUG", "0")
    lord.free(t)
    assert capsys.readouterr().out == ""


def test_no_color_removes_every_escape(lord, capsys, monkeypatch):
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    gc_lord = type(lord)(auto_gc_bytes=4)
    t = torch.empty(4)
    lord.allocate([t, fake_cuda(1, 0), fake_cuda(2, 1)])
    lord.free(t)
    lord.reset()
    gc_lord.free(fake_cuda(1, 0))
    out = capsys.readouterr().out
    for tag in (
        "[allocate]",
        "[free]",
        "[allocate-summary]",
        "[free-summary]",
        "[reset]",
        "[auto_gc]",
    ):
        assert tag in out, tag
    assert "\x1b[" not in out


def test_no_log_on_queries(lord, capsys, monkeypatch):
    lord.allocate(torch.empty(3))
    monkeypatch.setenv("DEBUG", "1")
    lord.allocated()
    lord.freed("cpu")
    lord.stats()
    lord.top_alloc_site()
    repr(lord)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("method", ["allocate", "free"])
def test_log_goes_to_sys_stdout_not_stderr(lord, capsys, monkeypatch, method):
    monkeypatch.setenv("DEBUG", "1")
    getattr(lord, method)(torch.empty(3))
    captured = capsys.readouterr()
    assert f"[{method}-summary]" in captured.out
    assert captured.err == ""


def test_long_site_path_not_truncated(lord, capsys, monkeypatch, tmp_path):
    # PySys_WriteStdout truncates at 1000 bytes; a long user path must still be printed whole.
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200) / ("g" * 200)
    deep.mkdir(parents=True)
    script = deep / "user_script_with_a_long_name.py"
    script.write_text("def run(lord, t):\n    lord.allocate(t)\n")
    ns = {}
    exec(compile(script.read_text(), str(script), "exec"), ns)
    monkeypatch.setenv("DEBUG", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    ns["run"](lord, torch.empty(3))
    out = capsys.readouterr().out
    assert "[allocate-summary]" in out
    site = lord.top_alloc_site()[1]
    assert site == f"{script}:2"
    if str(tmp_path) in out:  # when log lines name the site, they name it whole
        assert f"{script}:2" in out
