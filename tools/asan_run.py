"""Run a command (by default the test suite) under AddressSanitizer + UBSan.

    python tools/asan_run.py [pytest arguments]         # pytest -q tests by default
    python tools/asan_run.py --cmd python -c "..."      # any other command

memlord._core must have been built with MEMLORD_SANITIZE=1 (``tox -e asan`` does
that through tools/install.py --sanitize). The interpreter itself is not
instrumented, so the gcc sanitizer runtimes are preloaded; PYTHONMALLOC=malloc
sends every Python allocation through ASan's malloc.

Every sanitizer writes its reports to files in a private log directory rather
than to stderr: pytest captures file descriptor 2, and a report printed there by
a process that then aborts would be lost with the capture. After the command
exits, every report found there (from the test process or any child it started)
is printed and the run fails, whatever the command's own exit status was.

Leak detection is on. tools/lsan.supp suppresses leaks whose allocating code is
in the interpreter, torch, numpy or the C runtimes, and nothing else: see the
comment at its top. Set ASAN_OPTIONS / LSAN_OPTIONS / UBSAN_OPTIONS in the
environment to add options; they are appended to ours, so they win. For example
ASAN_OPTIONS=malloc_context_size=30 shows deeper allocation stacks while
debugging a report, but then every stack reaches into libpython and the
suppressions hide memlord's leaks too: never leave it set for a real check.

Python processes started under it get PYTHONSAFEPATH=1 (the installed, sanitized
memlord, never the source tree in their working directory) and tools/asan_site/
on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
SITE = TOOLS / "asan_site"
SUPPRESSIONS = TOOLS / "lsan.supp"

ASAN_OPTIONS = {
    "detect_leaks": "1",
    # Two frames: the allocator and the code that called it (see tools/lsan.supp).
    "malloc_context_size": "2",
    "halt_on_error": "1",
    "abort_on_error": "0",
    # Out-of-memory tests ask for absurd sizes: fail the allocation like glibc does.
    "allocator_may_return_null": "1",
    "detect_stack_use_after_return": "0",
}
LSAN_OPTIONS = {"print_suppressions": "0"}
UBSAN_OPTIONS = {"print_stacktrace": "1", "halt_on_error": "1"}


def runtime_library(name: str) -> str:
    """The path of a gcc sanitizer runtime (libasan.so, libubsan.so)."""
    cc = os.environ.get("CC", "gcc").split()[0]
    out = subprocess.run(
        [cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not os.path.isabs(out) or not os.path.exists(out):
        raise SystemExit(f"asan_run: {cc} has no {name} (got {out!r}); install gcc's sanitizers")
    return os.path.realpath(out)


def _options(ours: dict[str, str], name: str, log_dir: Path, prefix: str) -> str:
    opts = dict(ours)
    opts["log_path"] = str(log_dir / prefix)
    joined = ":".join(f"{k}={v}" for k, v in opts.items())
    extra = os.environ.get(name, "")
    return f"{joined}:{extra}" if extra else joined


def sanitizer_env(log_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a sanitized run whose reports go to files in log_dir."""
    env = dict(os.environ if base is None else base)
    preload = [runtime_library("libasan.so"), runtime_library("libubsan.so")]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    env["LD_PRELOAD"] = ":".join(preload)
    env["PYTHONMALLOC"] = "malloc"
    env["ASAN_OPTIONS"] = _options(ASAN_OPTIONS, "ASAN_OPTIONS", log_dir, "asan")
    lsan = dict(LSAN_OPTIONS, suppressions=str(SUPPRESSIONS))
    env["LSAN_OPTIONS"] = _options(lsan, "LSAN_OPTIONS", log_dir, "lsan")
    env["UBSAN_OPTIONS"] = _options(UBSAN_OPTIONS, "UBSAN_OPTIONS", log_dir, "ubsan")
    # libubsan ignores that log_path next to libasan: asan_site/sitecustomize.py sets it.
    env["MEMLORD_UBSAN_LOG_PATH"] = str(log_dir / "ubsan")
    # sitecustomize.py, and the pytest plugin that checks the sanitized build is the one
    # under test.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    # Python processes that the tests start must import the installed (sanitized)
    # memlord, not the source tree in their working directory (Python >= 3.11).
    env["PYTHONSAFEPATH"] = "1"
    return env


# Lines a sanitizer writes that report no error, each for a known reason:
# - allocator_may_return_null=1 (above) makes ASan warn when it returns NULL for an
#   absurd request, which the out-of-memory tests make on purpose (and check the error);
# - LeakSanitizer's exit-time check in a process whose other threads it could not stop
#   (a forked child, a process ending with threads running) says its result may
#   include false leaks; a leak it finds is still an ERROR report of its own.
BENIGN = re.compile(
    r"==\d+==WARNING: AddressSanitizer failed to allocate 0x[0-9a-f]+ bytes"
    r"|==\d+==Running thread \d+ was not suspended\. False leaks are possible\."
)


def collect_reports(log_dir: Path) -> list[tuple[str, str]]:
    """(file name, text) of every sanitizer report in log_dir that says more than the
    BENIGN warnings (an error, a leak, a runtime error)."""
    reports = []
    for path in sorted(log_dir.iterdir()):
        text = path.read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if any(not BENIGN.fullmatch(ln.strip()) for ln in lines):
            reports.append((path.name, text))
    return reports


def run_sanitized(
    cmd: list[str], cwd: Path = ROOT, extra_env: dict[str, str] | None = None
) -> tuple[int, list[tuple[str, str]]]:
    """Run cmd under the sanitizers; return its exit status and the reports it left."""
    with tempfile.TemporaryDirectory(prefix="memlord-asan-") as tmp:
        log_dir = Path(tmp)
        env = sanitizer_env(log_dir)
        env.update(extra_env or {})
        proc = subprocess.run(cmd, cwd=cwd, env=env)
        return proc.returncode, collect_reports(log_dir)


def pytest_command(args: list[str]) -> list[str]:
    # The console script, not `python -m pytest`: -m would put the working directory
    # (the source tree, with an unsanitized or no _core) first on sys.path.
    script = Path(sys.executable).parent / "pytest"
    head = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "pytest"]
    return [*head, "-p", "memlord_asan_plugin", *(args or ["-q", "tests"])]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cmd"]:
        cmd = argv[1:]
    else:
        cmd = pytest_command(argv)
    status, reports = run_sanitized(cmd)
    for name, text in reports:
        print(f"\n===== sanitizer report {name} =====\n{text}", file=sys.stderr)
    if reports:
        print(
            f"asan_run: FAILED: {len(reports)} sanitizer report(s) (command exit status {status})",
            file=sys.stderr,
        )
        return status or 1
    print(f"asan_run: no sanitizer reports (command exit status {status})")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
