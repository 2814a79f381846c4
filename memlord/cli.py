"""memlord's command line: profile a script, convert a saved profile.

    python -m memlord run [--html F] [--json F] [--trace F] [--pickle F] [--modules]
                          [--interval S] [--events N] script.py [args...]
    python -m memlord report IN.json [-o OUT.html] [--trace F] [--pickle F]
    python -m memlord gantt IN.json OUT.html
    python -m memlord merge FILES... [-o OUT.json|OUT.html] [--trace F] [--keep-going]

``run`` executes an unmodified script as ``__main__`` with memlord's torch and lifetime
hooks on and writes the requested reports when the program ends, as ``atexit`` sees it
(after its non-daemon threads, with its globals alive): normally, by an exception, by
``sys.exit``, or on SIGTERM / SIGINT.  Output paths are checked before the script runs and
resolved against the directory ``run`` was started in.  With no output option it writes
``memory_profile_YYYYMMDD_HHMMSS_<pid>_<n>.json`` in the current directory.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMANDS = ("run", "report", "gantt", "top", "merge")

#: the longest refresh interval ``top --interval`` takes (a day)
TOP_MAX_INTERVAL_S = 86400.0


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
    run.add_argument(
        "--no-oom",
        action="store_true",
        help="write no post-mortem when memory runs out (default: one per OOM, up to 5, "
        "memlord-oom-*.json beside the profile)",
    )
    run.add_argument(
        "--no-publish",
        action="store_true",
        help="do not publish this run's memory to `python -m memlord top` (default: publish)",
    )
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    rep = sub.add_parser("report", help="convert a saved JSON profile")
    rep.add_argument("input", help="a profile written by memlord (or the memory profiler)")
    top = sub.add_parser(
        "top", help="every process of this user on the host that publishes its memory, live"
    )
    top.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes"
    )
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.add_argument("--json", action="store_true", help="print one JSON document and exit")
    rep.add_argument("-o", "--output", metavar="OUT", help="the HTML report (default IN.html)")
    rep.add_argument("--trace", metavar="F", help="also a Perfetto trace (.trace.json)")
    rep.add_argument("--pickle", metavar="F", help="also a torch memory snapshot pickle")
    gantt = sub.add_parser("gantt", help="the interactive Gantt chart of a saved profile")
    gantt.add_argument("input")
    gantt.add_argument("output")
    mrg = sub.add_parser("merge", help="one report of several ranks' profiles or post-mortems")
    mrg.add_argument("files", nargs="+", metavar="FILE", help="per-rank profiles, post-mortems")
    mrg.add_argument("-o", "--output", metavar="OUT", help="OUT.json or OUT.html")
    mrg.add_argument(
        "--trace", metavar="F", help="one Perfetto trace of every profile (.trace.json)"
    )
    mrg.add_argument("--keep-going", action="store_true", help="merge the good files anyway")
    return parser


def _say(message: str) -> None:
    print(f"memlord: {message}", file=sys.stderr, flush=True)


# ---- run ----------------------------------------------------------------------------------


def _module_spans(tracker: Any) -> Any:
    """``run --modules``: global nn.Module hooks that record an operation per module call
    on the profiler's tracker, named by the module's qualified name under the first
    module called that contains it (the root itself by its class name), and one named
    ``"<name> (backward)"`` for the call's backward: the tracker of
    ``lord.track_modules`` (memlord._regions.ModuleSpans) on every module."""
    from ._regions import ModuleSpans

    return ModuleSpans(functools.partial(tracker.begin, kind="module"), tracker.end)


#: what `run` keeps alive until the report is written at exit: the script's globals (or
#: the exception that ended it, whose traceback holds them), as they are under `python
#: script.py` until the interpreter tears its modules down
_kept: list[Any] = []

#: each ``run`` output option, the format its file must have, and the endings that name it
_OUTPUTS = (
    ("json", "json", ".json"),
    ("html", "html", ".html or .htm"),
    ("trace", "trace", ".trace.json"),
    ("pickle", "pickle", ".pickle or .pkl"),
)


def _misnamed(option: str, path: str, fmt: str, endings: str) -> bool:
    """Whether ``path``, given to ``option`` (``--json``, ``gantt``), names another
    format than the option's (said in one line)."""
    from .report import format_of

    try:
        found = format_of(path)
    except ValueError:
        found = None
    if found != fmt:
        _say(f"{option} {path}: the name must end in {endings}")
        return True
    return False


def _check_outputs(args: argparse.Namespace) -> dict[str, tuple[str, str]] | None:
    """The output options' paths, absolute (against the directory `run` was started in,
    whatever the script's ``os.chdir`` later) -> (option, the path as given); or None
    after saying, in one line, why one cannot be written.  Checked before the script
    runs, so a wrong name costs nothing."""
    from .report._util import check_writable

    given: dict[str, tuple[str, str]] = {}
    for option, fmt, endings in _OUTPUTS:
        path = getattr(args, option)
        if not path:
            continue
        if _misnamed(f"--{option}", path, fmt, endings):
            return None
        given[os.path.abspath(path)] = (f"--{option}", path)  # endings differ: no clash
    if args.html:
        try:
            import plotly  # noqa: F401
        except ImportError:
            _say("--html needs plotly: pip install memlord[report]")
            return None
    # where the default memory_profile_*.json goes when no output is named
    probes = list(given) or [os.path.join(os.getcwd(), "memory_profile.json")]
    for absolute in probes:
        option, path = given.get(absolute, ("the default profile in", os.getcwd()))
        try:
            check_writable(absolute)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            where = f" ({exc.filename})" if exc.filename and exc.filename != absolute else ""
            _say(f"{option} {path}: cannot be written: {reason}{where}")
            return None
    return given


def run(args: argparse.Namespace) -> int:
    """Run the script as ``__main__`` under a tracker; the reports are written by an
    ``atexit`` handler when the interpreter ends (called in-process, at that process's
    end), or by the tracker's signal handlers.  Returns the exit status for the script
    that raised (1) or ended normally (0); a ``SystemExit`` or ``KeyboardInterrupt`` of
    the script is raised again."""
    from .profiler import MemoryTracker

    script = Path(args.script)
    if not script.is_file():
        _say(f"script not found: {args.script}")
        return 2
    outputs = _check_outputs(args)
    if outputs is None:
        return 2
    by_option = {option: absolute for absolute, (option, _) in outputs.items()}
    exports = [by_option[o] for o in ("--html", "--trace", "--pickle") if o in by_option]
    json_path: Any = by_option.get("--json")
    if json_path is None:
        json_path = False if exports else None
    title = " ".join(["python -m memlord run", args.script, *args.args])
    tracker = MemoryTracker(
        os.getcwd(),
        True,
        args.interval,
        exports=exports,
        json_path=json_path,
        torch_hooks=True,
        title=title,
        oom=not args.no_oom,
        **({} if args.events is None else {"events": args.events}),
    )
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(script.resolve().parent))
    modules = None
    try:
        tracker.start()
    except MemoryError as exc:  # the event ring, allocated at start (nothing else is on)
        _say(f"--events {tracker.events}: {exc}")
        return 2
    if not args.no_publish and tracker.source is not None:
        from ._publish import cooperate_from_env

        try:
            # publish() again sets cooperate: keep what MEMLORD_COOPERATE says
            tracker.source.lord.publish(
                " ".join([args.script, *args.args])[:127], cooperate=cooperate_from_env()
            )
        except Exception as exc:  # noqa: BLE001 - publishing is an aid, never the run's end
            _say(f"not publishing to `memlord top`: {exc}")
    if args.modules:
        modules = _module_spans(tracker)
    pid = os.getpid()
    started_in = os.getcwd()  # the shell's folder, whatever the script's os.chdir

    def finish() -> None:
        # at exit, as atexit sees the program: after the script's non-daemon threads
        # ended and its own exit handlers ran (registered later, they run first), with
        # its globals alive; only in the process that started the run (a child the
        # script forked ends here too, and writes nothing)
        if os.getpid() != pid:
            return
        if modules is not None:
            modules._remove_hooks()
        shown = {path: given for path, (_, given) in outputs.items()}
        default = tracker.json_path()  # the default name, fixed now
        if default is not None and str(default) not in shown:
            shown[str(default)] = default.name  # in the directory run was started in
        written = tracker.stop()
        for path in written:
            _say(f"wrote {shown.get(str(path), path)}")
        for post_mortem in tracker.oom_post_mortems:
            _say(f"out of memory: post-mortem {os.path.relpath(post_mortem, started_in)}")
        for name, given in shown.items():
            if Path(name) not in written:
                _say(f"{given} was not written (the error is above)")

    atexit.register(finish)
    pending: BaseException | None = None
    code = 0
    try:
        _kept.append(runpy.run_path(str(script), run_name="__main__"))
    except (SystemExit, KeyboardInterrupt) as exc:
        _kept.append(exc)
        pending = exc
    except BaseException as exc:  # noqa: BLE001 - report it as Python would
        _kept.append(exc)
        # as Python keeps an uncaught exception (and so the frames it ended) until exit
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        traceback.print_exc()
        code = 1
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
    if os.path.isdir(source):
        _say(f"{source}: is a folder, not a file")
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
    # --trace and --pickle name their format, as run's options do (-o takes any format)
    for option, fmt, endings in _OUTPUTS:
        path = getattr(args, option) if option in ("trace", "pickle") else None
        if path and _misnamed(f"--{option}", path, fmt, endings):
            return 2
    outputs = [p for p in (args.output, args.trace, args.pickle) if p]
    if not args.output and not outputs:
        outputs = [str(Path(args.input).with_suffix(".html"))]
    return _convert(args.input, outputs)


def gantt(args: argparse.Namespace) -> int:
    if _misnamed("gantt", args.output, "html", ".html or .htm"):  # the HTML report only
        return 2
    return _convert(args.input, [args.output])


def top(args: argparse.Namespace) -> int:
    """``python -m memlord top``: see memlord/_top.py."""
    from . import _top

    # time.sleep takes no infinity and nothing past the platform's time_t; a refresh
    # interval longer than a day is no live view anyway
    if not 0 < args.interval <= TOP_MAX_INTERVAL_S:
        _say(
            f"--interval must be a number of seconds > 0 and at most "
            f"{TOP_MAX_INTERVAL_S:g}, got {args.interval:g}"
        )
        return 2
    return _top.main(args.interval, once=args.once, as_json=args.json)


def merge(args: argparse.Namespace) -> int:
    from .report._merge import command

    return command(args.files, args.output, keep_going=args.keep_going, say=_say, trace=args.trace)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    commands = {"run": run, "report": report, "gantt": gantt, "top": top, "merge": merge}
    return commands[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
