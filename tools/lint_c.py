"""Lint memlord's C sources: clang-format (the checked-in .clang-format) and cppcheck.

    python tools/lint_c.py            # both; exit status 1 on any finding
    python tools/lint_c.py --fix      # rewrite the sources with clang-format instead
    python tools/lint_c.py --no-compile   # without the compilers' pass (below)

cppcheck parses the sources with the CPython and NumPy headers (so it knows
PyObject_HEAD, Py_INCREF and the NumPy C API) for one configuration, x86-64 Linux
with gcc, the one CI builds. Findings inside those third-party headers are not
ours and are suppressed; in src/ nothing is, except what a line says itself with
an inline `// cppcheck-suppress id` and:

* constParameterCallback: CPython fixes the signatures of getters, setters and
  method functions (``PyObject *self``, ``void *closure``); they cannot take const.

Then every C file is compiled (``-fsyntax-only``, the build's warning flags and
``-Werror``) against the headers of each CPython from 3.10 to 3.13 found on this
machine (``python3.X`` on PATH, or under pyenv's root), so that a deprecation in a
version the README names fails here, not in a user's build. ``--no-compile`` skips
that step (tox's lint does: its py, py310, py312 and py313 environments build every C
file with the same flags against their own CPython).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

CPPCHECK_SUPPRESS = ["missingIncludeSystem", "constParameterCallback"]


def sources() -> list[Path]:
    return sorted([*SRC.rglob("*.c"), *SRC.rglob("*.h")])


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"lint_c: {name} not found (pip install {name})")
    return path


def run(cmd: list[str]) -> int:
    print("+", " ".join(cmd if len(cmd) < 12 else [*cmd[:11], "..."]), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def clang_format(files: list[Path], fix: bool) -> int:
    mode = ["-i"] if fix else ["--dry-run", "-Werror"]
    return run([tool("clang-format"), "--style=file", *mode, *map(str, files)])


def cppcheck() -> int:
    py_include = sysconfig.get_paths()["include"]
    np_include = numpy.get_include()
    cmd = [
        tool("cppcheck"),
        "--enable=warning,style,performance,portability",
        "--error-exitcode=1",
        "--inline-suppr",
        "--std=c11",
        "--platform=unix64",
        "--language=c",
        "--quiet",
        "--template={file}:{line}:{column}: {severity}: {message} [{id}]",
        # One configuration: the compiler, target and flags CI builds with (CPython's
        # CFLAGS define NDEBUG for extensions too).
        "-DNDEBUG",
        f"--include={ROOT / 'tools' / 'cppcheck_prelude.h'}",
        "-D__GNUC__=12",
        "-D__x86_64__",
        "-D__linux__",
        "-D__STDC_VERSION__=201112L",
        "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION",
        f"-I{SRC}",
        f"-I{py_include}",
        f"-I{np_include}",
        *(f"--suppress={s}" for s in CPPCHECK_SUPPRESS),
        # Findings inside the CPython and NumPy headers are theirs.
        f"--suppress=*:{py_include}/*",
        f"--suppress=*:{np_include}/*",
        str(SRC),
    ]
    return run(cmd)


#: the CPython versions the README says the extension builds on, warning-free
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: setup.py's extra_compile_args with MEMLORD_WERROR=1 (setup.py cannot be imported: it builds)
WARNINGS = ["-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Werror"]


def python_includes() -> dict[str, str]:
    """Version -> the CPython headers' directory, for each of PYTHONS found here."""
    found = {}
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    for version in PYTHONS:
        candidates = [shutil.which(f"python{version}")]
        for root in filter(None, roots):
            candidates += sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
        for exe in filter(None, candidates):
            out = subprocess.run(
                [exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                capture_output=True,
                text=True,
            )
            include = out.stdout.strip()
            if out.returncode == 0 and Path(include, "Python.h").is_file():
                found[version] = include
                break
    return found


def compile_against_pythons() -> int:
    """Each C file through the compiler with each found CPython's headers."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("lint_c: no C compiler found")
    includes = python_includes()
    failed = 0
    for version, include in includes.items():
        base = [cc, *WARNINGS, "-fsyntax-only", "-DNDEBUG", f"-I{SRC}", f"-I{include}"]
        base += [f"-I{numpy.get_include()}", "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION"]
        for src in sorted(SRC.rglob("*.c")):
            out = subprocess.run([*base, str(src)], capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                failed += 1
                print(f"lint_c: CPython {version}: {src.relative_to(ROOT)}\n{out.stderr}")
    missing = [v for v in PYTHONS if v not in includes]
    print(
        f"lint_c: compiled against CPython {', '.join(includes) or 'none'}"
        + (f" (headers not found here: {', '.join(missing)})" if missing else ""),
        flush=True,
    )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="apply clang-format, skip cppcheck")
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip compiling each file against every CPython's headers (tox's py, py310, "
        "py312 and py313 build the extension with the same -Werror flags)",
    )
    args = parser.parse_args()
    files = sources()
    if not files:
        print("lint_c: no C sources in src/", file=sys.stderr)
        return 1
    if args.fix:
        return clang_format(files, fix=True)
    failed = [
        name
        for name, rc in (
            ("clang-format", clang_format(files, fix=False)),
            ("cppcheck", cppcheck()),
            ("the compilers", 0 if args.no_compile else compile_against_pythons()),
        )
        if rc
    ]
    if failed:
        print(f"lint_c: findings from {' and '.join(failed)}", file=sys.stderr)
        return 1
    headers = "" if args.no_compile else ", every CPython's headers"
    print(f"lint_c: {len(files)} files clean (clang-format, cppcheck{headers})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
