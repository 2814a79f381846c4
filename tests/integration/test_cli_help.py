"""``python -m memlord --help`` names every command (run, report, gantt, top, merge), so
a new user finds them; each command's own --help works."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from memlord.__main__ import main


def _help(capsys, argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys, ["--help"])
    for command in ("run", "report", "gantt", "top", "merge"):
        assert re.search(rf"^  {command} ", out, re.M), out
    assert "{run,report,gantt,top,merge}" in out, out
    assert "--layers" in out and "--info" in out


@pytest.mark.parametrize("command", ["run", "report", "gantt", "top", "merge"])
def test_each_command_has_its_help(capsys, command):
    out = _help(capsys, [command, "--help"])
    assert out.startswith(f"usage: python -m memlord {command}")


def test_help_in_a_real_process():
    proc = subprocess.run(
        [sys.executable, "-m", "memlord", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert all(f"  {c} " in proc.stdout for c in ("run", "report", "gantt")), proc.stdout


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("argv", [["--info"], [], ["top", "--once"]])
def test_a_reader_that_goes_away_ends_the_output_quietly(argv, buffered, tmp_path):
    """``python -m memlord ... | head -1``: when the reader of stdout is gone, the
    command stops without a BrokenPipeError traceback (neither from a print nor from the
    flush at exit), as other command-line tools do."""
    env = dict(os.environ, MEMLORD_RUNTIME_DIR=str(tmp_path / "rt"))
    # a pipe is block-buffered: short output is written by the flush at the end
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "memlord", *argv],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=env,
        )
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
