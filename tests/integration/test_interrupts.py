"""A Ctrl-C, or a signal handler's sys.exit(), that lands while memlord's own Python code
runs inside a hooked call (a DEBUG log line, a category source) reaches the program, as
it does when it lands in the program's own code: raised right after the hooked call, the
call's result dropped. memlord reports its own failures instead of raising them
(``sys.unraisablehook``); an interrupt is no failure of memlord's, and before this it was
reported there too, and the program went on as if no Ctrl-C had been pressed.

Real signals, in real processes (``signal.raise_signal`` from a logging handler: where
in the program's Python code a signal's handler runs is where the interpreter next checks
for signals). The reference is the same program with the handler reached from the
program's own logging call instead of memlord's."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
from support import warm

PROGRAM = textwrap.dedent(
    """
    import io, logging, signal, sys
    import torch
    from memlord import MemLord

    SIG = signal.SIG{sig}
    # Python's own SIGINT handler, as a program started from a terminal has it (a parent
    # that ignores SIGINT, such as a shell's background job, leaves it ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if SIG == signal.SIGTERM:
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))  # a program's clean exit

    class Landing(logging.Handler):
        fired = False

        def emit(self, record):  # the signal lands while this line is written
            if not Landing.fired:
                Landing.fired = True
                signal.raise_signal(SIG)

    for name in ("memlord", "app"):
        logging.getLogger(name).addHandler(Landing())
        logging.getLogger(name).setLevel(logging.DEBUG)
    lord = MemLord(auto_gc_bytes=None)
    t = torch.ones(8)
    buf = io.BytesIO()
    torch.save({{"w": t}}, buf)
    reached = []
    try:
        with lord.hook_into_torch(), lord.hook_into_python():
            {call}
            reached.append("after")
    except KeyboardInterrupt:
        print("KeyboardInterrupt", reached, flush=True)
    else:
        print("not interrupted", reached, flush=True)
    """
)

CALLS = {
    # the reference: the program's own logging call, no memlord code between
    "program's own line": 'logging.getLogger("app").debug("x")',
    "factory": "torch.empty(10)",
    "cast": "t.half()",
    "torch.load": "buf.seek(0); torch.load(buf)",
}


def _run(sig: str, call: str) -> tuple[int, str, str]:
    out = warm.run(
        [sys.executable, "-c", PROGRAM.format(sig=sig, call=call)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DEBUG": "1"},
    )
    return out.returncode, out.stdout, out.stderr


@pytest.mark.parametrize("call", list(CALLS))
def test_a_ctrl_c_inside_memlords_log_line_reaches_the_program(call: str) -> None:
    rc, stdout, stderr = _run("INT", CALLS[call])
    assert rc == 0, stderr
    # the call raised KeyboardInterrupt: the line after it never ran
    assert stdout.strip() == "KeyboardInterrupt []", stderr
    assert "Exception ignored" not in stderr


@pytest.mark.parametrize("call", list(CALLS))
def test_a_signal_handlers_sys_exit_inside_memlords_log_line_ends_the_program(call: str) -> None:
    rc, stdout, stderr = _run("TERM", CALLS[call])
    assert rc == 3, stderr
    assert stdout == ""  # neither branch printed: SystemExit ended the program
    assert "Exception ignored" not in stderr
