"""A Ctrl-C'd profiled program ends with the traceback it has without the profiler: the
profiler's SIGINT handler writes the files, then hands the signal to the handler that was
installed before it (Python's, which raises KeyboardInterrupt, or the program's own)
without a frame of memlord's between the program's frames and that handler's.

Real processes sent a real SIGINT; the reference is the same program run without the
profiler; the frames are compared by file and function (the line the signal lands on in
``work`` may differ from run to run)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent(
    """
    import signal, sys, time
    import torch

    mode, out = sys.argv[1], sys.argv[2]
    # Python's own SIGINT handler, as a program started from a terminal has it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if mode.endswith("own handler"):
        def on_sigint(signum, frame):
            raise RuntimeError("the program's own handler")
        signal.signal(signal.SIGINT, on_sigint)
    if mode.startswith("profiled"):
        from memlord.profiler import initialize_memory_tracker
        initialize_memory_tracker(output_dir=out, interval=None)

    def work():
        keep = torch.zeros(1 << 10)
        print("ready", flush=True)
        while True: time.sleep(0.01)

    work()
    """
)

FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in (?P<name>.+)$', re.MULTILINE)


def _run(tmp_path, mode):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    out = tmp_path / mode.replace(" ", "_")
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), mode, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, err, sorted(p.name for p in out.iterdir())


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("handler", ["", " own handler"])
def test_a_ctrl_c_traceback_has_the_frames_it_has_without_the_profiler(tmp_path, handler):
    ref_rc, ref_err, _ = _run(tmp_path, "plain" + handler)
    rc, err, written = _run(tmp_path, "profiled" + handler)
    assert any(name.endswith(".json") for name in written), err  # the profiler wrote
    # Python ends an uncaught KeyboardInterrupt by SIGINT; the handler's error is status 1
    assert rc == ref_rc == (1 if handler else -signal.SIGINT), (ref_err, err)
    ref_frames = FRAME.findall(ref_err)
    assert ref_frames and ref_frames[-1][1] in ("work", "on_sigint"), ref_err
    assert FRAME.findall(err) == ref_frames, err
    assert err.strip().splitlines()[-1] == ref_err.strip().splitlines()[-1]
