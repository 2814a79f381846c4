"""Check the link graph of memlord's C sources: layered and free of cycles.

    python tools/check_links.py           # exit status 1 on any finding

tools/check_includes.py reads the includes; a function declared in a low header
and defined high up, or two files calling each other, pass it.  This check reads
the symbols instead: every ``src/**/*.c`` is compiled on its own (``gcc -c``, the
include directories and macros of setup.py, no link-time optimisation) into a
temporary directory, and ``nm`` lists what each object defines and what it uses.
Each used symbol that another object defines is an edge from the using file to
the defining one.  Findings:

* a file using a symbol defined in a folder that is not below its own (the
  layers of tools/check_includes.py; folders of one rank are independent);
* a cycle among files, anywhere (also inside one folder).

A lower layer reaches a higher one only through what the higher one registers
(a function pointer in a table it fills at init), which no symbol shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"


def _includes_module():
    spec = importlib.util.spec_from_file_location(
        "check_includes", ROOT / "tools" / "check_includes.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_INCLUDES = _includes_module()
LAYERS: dict[str, int] = _INCLUDES.LAYERS
find_cycles = _INCLUDES.find_cycles
cycle_in = _INCLUDES.cycle_in

#: setup.py's compile flags that change which symbols an object defines or uses
#: (setup.py cannot be imported: it builds).  No -flto: each object keeps its calls.
CFLAGS = [
    "-std=c11",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-DNDEBUG",
    "-DNPY_NO_DEPRECATED_API=NPY_1_7_API_VERSION",
]


def include_dirs(src: Path) -> list[str]:
    dirs = [str(src), sysconfig.get_paths()["include"]]
    try:
        import numpy

        dirs.append(numpy.get_include())
    except ImportError:  # a synthetic tree needs none
        pass
    return dirs


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SystemExit("check_links: no C compiler found")
    return cc


# The compiler and nm run without what a sanitized test run preloads: under tox's asan
# environment LD_PRELOAD carries the ASan runtime, whose leak check fails gcc at exit
# (its report goes to ASan's log file, so the compile "fails" with nothing on stderr).
_NOT_FOR_TOOLS = ("LD_PRELOAD", "ASAN_OPTIONS", "LSAN_OPTIONS", "UBSAN_OPTIONS")
TOOL_ENV = {k: v for k, v in os.environ.items() if k not in _NOT_FOR_TOOLS}


def build_objects(src: Path, out: Path) -> dict[str, Path]:
    """src-relative path of each .c -> its object, compiled into out."""
    cc = compiler()
    flags = [*CFLAGS, *(f"-I{d}" for d in include_dirs(src))]
    sources = sorted(src.rglob("*.c"))

    def one(path: Path) -> tuple[str, Path, subprocess.CompletedProcess[str]]:
        rel = path.relative_to(src).as_posix()
        obj = out / (rel.replace("/", "__") + ".o")
        r = subprocess.run(
            [cc, *flags, "-c", str(path), "-o", str(obj)],
            capture_output=True,
            text=True,
            env=TOOL_ENV,
        )
        return rel, obj, r

    objects: dict[str, Path] = {}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for rel, obj, r in pool.map(one, sources):
            if r.returncode != 0:
                raise SystemExit(
                    f"check_links: src/{rel} does not compile (exit status {r.returncode}):"
                    f"\n{r.stderr}"
                )
            objects[rel] = obj
    return objects


def symbols(obj: Path) -> tuple[set[str], set[str]]:
    """The global symbols obj defines, and those it uses without defining."""
    nm = shutil.which("nm")
    if nm is None:
        raise SystemExit("check_links: nm not found (binutils)")
    r = subprocess.run(
        [nm, "-P", str(obj)], capture_output=True, text=True, check=True, env=TOOL_ENV
    )
    defined, undefined = set(), set()
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind == "U":
            undefined.add(name)
        elif kind.isupper() or kind in ("v", "w"):  # global: T D B R C V W ...
            defined.add(name)
    return defined, undefined


def folder_of(rel: str) -> str:
    return rel.rpartition("/")[0]


def link_graph(
    objects: dict[str, Path],
) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]], list[str]]:
    """File -> files whose symbols it uses, the symbols of each edge, findings."""
    findings: list[str] = []
    defs: dict[str, set[str]] = {}
    uses: dict[str, set[str]] = {}
    owner: dict[str, str] = {}
    for rel, obj in objects.items():
        defs[rel], uses[rel] = symbols(obj)
        for name in defs[rel]:
            if name in owner:
                findings.append(f"{name} is defined in src/{owner[name]} and src/{rel}")
            owner.setdefault(name, rel)
    graph: dict[str, set[str]] = {rel: set() for rel in objects}
    via: dict[tuple[str, str], list[str]] = {}
    for rel in sorted(objects):
        for name in sorted(uses[rel]):
            target = owner.get(name)
            if target is None or target == rel:
                continue  # CPython, libc, NumPy: outside src/
            graph[rel].add(target)
            via.setdefault((rel, target), []).append(name)
    return graph, via, findings


def check_layers(graph: dict[str, set[str]], via: dict[tuple[str, str], list[str]]) -> list[str]:
    findings = []
    for rel in sorted(graph):
        folder = folder_of(rel)
        if folder not in LAYERS:
            findings.append(f"src/{rel}: folder {folder!r} is not in the layer table")
            continue
        for target in sorted(graph[rel]):
            tfolder = folder_of(target)
            if tfolder == folder or tfolder not in LAYERS:
                continue
            if LAYERS[tfolder] >= LAYERS[folder]:
                names = ", ".join(via[(rel, target)][:4])
                findings.append(
                    f"src/{rel} (layer {folder or 'src'!r}, rank {LAYERS[folder]}) uses "
                    f"src/{target} (layer {tfolder!r}, rank {LAYERS[tfolder]}): {names}"
                )
    return findings


def check_cycles(graph: dict[str, set[str]], via: dict[tuple[str, str], list[str]]) -> list[str]:
    findings = []
    for comp in find_cycles(graph):
        cycle = cycle_in(graph, set(comp))
        steps = [f"{a} ({via[(a, b)][0]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        findings.append(f"link cycle among {', '.join(comp)}: {' -> '.join(steps)} -> {cycle[-1]}")
    return findings


def check(src: Path) -> tuple[list[str], dict[str, set[str]]]:
    with tempfile.TemporaryDirectory(prefix="check_links_") as tmp:
        objects = build_objects(src, Path(tmp))
        graph, via, findings = link_graph(objects)
    findings += check_layers(graph, via)
    findings += check_cycles(graph, via)
    return findings, graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=SRC, help="the source tree (default: src/)")
    args = parser.parse_args()
    findings, graph = check(args.src.resolve())
    for f in findings:
        print(f, file=sys.stderr)
    if findings:
        print(f"check_links: {len(findings)} findings", file=sys.stderr)
        return 1
    edges = sum(len(v) for v in graph.values())
    print(f"check_links: {len(graph)} files, {edges} edges, layered, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
