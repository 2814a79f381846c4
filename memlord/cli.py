"""memlord's command line: profile a script, convert a saved profile.

    python -m memlord run [--html F] [--json F] [--trace F] [--pickle F] [--modules]
                          [--interval S] [--events N] script.py [args...]
    python -m memlord report IN.json [-o OUT.html] [--trace F] [--pickle F]
    python -m memlord gantt IN.json OUT.html

``run`` executes an unmodified script as ``__main__`` with memlord's torch and lifetime
hooks on and writes the requested reports when it ends: normally, by an exception, by
``sys.exit``, or on SIGTERM / SIGINT.  With no output option it writes
``memory_profile_YYYYMMDD_HHMMSS.json`` in the current directory.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMANDS = ("run", "report", "gantt")


def _interval(text: str) -> float | None:
    if text.lower() in ("0", "off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _capacity(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m memlord", description="memlord's memory reports"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="profile a Python script and write reports at its end")
    run.add_argument("--html", metavar="F", help="write the HTML report to F")
    run.add_argument("--json", metavar="F", help="write the JSON profile to F")
    run.add_argument("--trace", metavar="F", help="write a Perfetto trace (.trace.json) to F")
    run.add_argument("--pickle", metavar="F", help="write a torch memory snapshot pickle to F")
    run.add_argument(
        "--modules", action="store_true", help="record an operation per nn.Module call"
    )
    run.add_argument(
        "--interval",
        type=_interval,
        default=5.0,
        metavar="S",
        help="seconds between background snapshots (0: none; default 5)",
    )
    run.add_argument(
        "--events",
        type=_capacity,
        default=None,
        metavar="N",
        help="keep the newest N allocation and free events (64 bytes each; 0: none; "
        "default 262144)",
    )
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    rep = sub.add_parser("report", help="convert a saved JSON profile")
    rep.add_argument("input", help="a profile written by memlord (or the memory profiler)")
    rep.add_argument("-o", "--output", metavar="OUT", help="the HTML report (default IN.html)")
    rep.add_argument("--trace", metavar="F", help="also a Perfetto trace (.trace.json)")
    rep.add_argument("--pickle", metavar="F", help="also a torch memory snapshot pickle")
    gantt = sub.add_parser("gantt", help="the interactive Gantt chart of a saved profile")
    gantt.add_argument("input")
    gantt.add_argument("output")
    return parser


def _say(message: str) -> None:
    print(f"memlord: {message}", file=sys.stderr, flush=True)


# ---- run ----------------------------------------------------------------------------------


class ModuleSpans:
    """Global nn.Module forward hooks that record an operation per module call, named by
    the module's qualified name under the first module called that contains it (the
    root itself by its class name)."""

    def __init__(self, tracker: Any) -> None:
        from torch.nn.modules import module as torch_module

        self.tracker = tracker
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._local = threading.local()
        self._handles = [
            torch_module.register_module_forward_pre_hook(self._pre),
            torch_module.register_module_forward_hook(self._post),
        ]

    def _name(self, module: Any) -> str:
        name = self._names.get(module)
        if name is None:
            name = type(module).__name__
            self._names[module] = name
            for qual, sub in module.named_modules():
                if qual and sub not in self._names:
                    self._names[sub] = qual
        return name

    def _stack(self) -> list[tuple[int, int]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _pre(self, module: Any, args: Any) -> None:
        try:
            token = self.tracker.begin(self._name(module), "module")
            self._stack().append((id(module), token))
        except Exception:  # noqa: BLE001 - never break the model
            pass

    def _post(self, module: Any, args: Any, output: Any) -> None:
        try:
            stack = self._stack()
            key = id(module)
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] == key:
                    token = stack[i][1]
                    del stack[i:]
                    self.tracker.end(token)
                    break
        except Exception:  # noqa: BLE001 - never break the model
            pass

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def run(args: argparse.Namespace) -> int:
    from .profiler import MemoryTracker

    script = Path(args.script)
    if not script.is_file():
        _say(f"script not found: {args.script}")
        return 2
    exports = [Path(p) for p in (args.html, args.trace, args.pickle) if p]
    json_path: Any = args.json
    if json_path is None:
        json_path = False if exports else None
    if args.html:
        try:
            import plotly  # noqa: F401
        except ImportError:
            _say("--html needs plotly: pip install memlord[report]")
            return 2
    title = " ".join(["python -m memlord run", args.script, *args.args])
    tracker = MemoryTracker(
        ".",
        True,
        args.interval,
        exports=exports,
        json_path=json_path,
        torch_hooks=True,
        title=title,
        **({} if args.events is None else {"events": args.events}),
    )
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))
    modules = None
    tracker.start()
    if args.modules:
        modules = ModuleSpans(tracker)
    pending: BaseException | None = None
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        pending = exc
    except KeyboardInterrupt as exc:
        pending = exc
    except BaseException:  # noqa: BLE001 - report it as Python would, then write
        traceback.print_exc()
        code = 1
    finally:
        if modules is not None:
            modules.remove()
        written = tracker.stop()
        for path in written:
            _say(f"wrote {path}")
    if pending is not None:
        raise pending
    return code


# ---- report / gantt ---------------------------------------------------------------------------


def _convert(source: str, outputs: Sequence[str]) -> int:
    """Read ``source`` and write each output; any problem is one line on stderr each
    (no traceback) and exit status 2."""
    from .report import ProfileError, ProgressBar, export, format_of, load

    for out in outputs:
        try:
            format_of(out)
        except ValueError as exc:
            _say(str(exc))
            return 2
    if not os.path.isfile(source):
        _say(f"no such file: {source}")
        return 2
    try:
        doc = load(source)
    except ProfileError as exc:
        for problem in exc.problems:
            _say(f"{source}: {problem}")
        return 2
    except ValueError as exc:
        _say(str(exc))
        return 2
    except OSError as exc:
        _say(f"cannot read {source}: {exc.strerror or exc}")
        return 2
    for out in outputs:
        bar = ProgressBar(f"writing {Path(out).name}")
        try:
            export(doc, out, progress=bar)
        except ImportError as exc:
            _say(str(exc))
            return 2
        except OSError as exc:
            _say(f"cannot write {out}: {exc.strerror or exc}")
            return 2
        finally:
            bar.close()
        _say(f"wrote {out}")
    return 0


def report(args: argparse.Namespace) -> int:
    outputs = [p for p in (args.output, args.trace, args.pickle) if p]
    if not args.output and not outputs:
        outputs = [str(Path(args.input).with_suffix(".html"))]
    return _convert(args.input, outputs)


def gantt(args: argparse.Namespace) -> int:
    return _convert(args.input, [args.output])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return {"run": run, "report": report, "gantt": gantt}[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
