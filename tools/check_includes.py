"""Check the include graph of memlord's C sources: layered and free of cycles.

    python tools/check_includes.py        # exit status 1 on any finding

src/ has one folder per layer (docs/architecture.md).  A unit is a folder and a
file stem: ``core/ledger.c`` and ``core/ledger.h`` are the unit ``core/ledger``.
Every ``#include "..."`` in src/ is an edge from the including unit to the
included one.  Findings:

* an include that does not name a file under src/ by its folder ("core/event.h");
* a file including a header of a folder that is not below its own in LAYERS
  (a folder may include its own headers, and those of lower layers);
* a cycle among units, anywhere (also inside one folder);
* a private header (PRIVATE) included from outside the folders that may.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

#: Folder of src/ -> rank.  A file may include headers of its own folder or of a
#: folder of a strictly lower rank: folders of one rank are independent.
LAYERS = {
    "platform": 0,  # the dlopen'd CUDA driver
    "base": 1,  # module state, device keys, formatting, small helpers
    "core": 2,  # the seam (events, ml_emit, the book, the safe point), ledger, sites, hotspot table
    "torch": 2,  # sizing: how big a tensor is, the stable-ABI reader beneath
    "sinks": 3,  # every sink: hotspots, the DEBUG log, auto-GC (policy, capacity), regions, ring
    "hooks": 4,  # the sources: torch hooks, lifetime tracking (a birth names its region)
    "api": 5,  # the Lord type and its handles, snapshots
    "": 6,  # module.c
}

#: Header -> folders allowed to include it.  The stable-ABI reader is sizing's
#: fast path: everything else asks torch/sizing.h how big a tensor is.
PRIVATE = {
    "torch/tensorabi.h": {"torch", ""},
    "torch/getters.h": {"torch"},  # torch's getters called fast: the walker and meta.c
}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def folder_of(rel: str) -> str:
    return rel.rpartition("/")[0]


def unit_of(rel: str) -> str:
    return rel.rsplit(".", 1)[0]


def read_graph(src: Path) -> tuple[dict[str, set[str]], list[str]]:
    """Unit -> units it includes, and findings about single includes."""
    graph: dict[str, set[str]] = {}
    findings: list[str] = []
    files = sorted(p for p in src.rglob("*") if p.suffix in (".c", ".h"))
    for path in files:
        rel = path.relative_to(src).as_posix()
        unit = unit_of(rel)
        graph.setdefault(unit, set())
        folder = folder_of(rel)
        if folder not in LAYERS:
            findings.append(f"src/{rel}: folder {folder!r} is not in the layer table")
            continue
        text = path.read_text(encoding="utf-8")
        for match in INCLUDE.finditer(text):
            name = match.group(1)
            line = text.count("\n", 0, match.start()) + 1
            where = f"src/{rel}:{line}"
            if not (src / name).is_file() or ".." in name.split("/"):
                findings.append(f'{where}: #include "{name}" names no file under src/')
                continue
            target = folder_of(name)
            if target not in LAYERS:
                findings.append(f'{where}: #include "{name}": folder not in the layer table')
                continue
            if target != folder and LAYERS[target] >= LAYERS[folder]:
                findings.append(
                    f'{where}: #include "{name}": layer {folder or "src"!r} '
                    f"(rank {LAYERS[folder]}) includes layer {target!r} (rank {LAYERS[target]})"
                )
            allowed = PRIVATE.get(name)
            if allowed is not None and folder not in allowed:
                findings.append(f'{where}: #include "{name}" is private to {sorted(allowed)}')
            if unit_of(name) != unit:
                graph[unit].add(unit_of(name))
    return graph, findings


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit: each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is small
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    cycle = " -> ".join(cycle_in(graph, set(comp)))
    if len(comp) == 2:
        return f"include cycle: {cycle}"
    return f"include cycle among {', '.join(comp)}: e.g. {cycle}"


def cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the first unit of a strongly connected component."""
    start = min(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return sorted(comp)  # not reached: a component of more than one unit has a cycle


def check(src: Path) -> list[str]:
    graph, findings = read_graph(src)
    for comp in find_cycles(graph):
        findings.append(describe(graph, comp))
    return findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=SRC, help="the source tree (default: src/)")
    args = parser.parse_args()
    findings = check(args.src)
    for f in findings:
        print(f, file=sys.stderr)
    if findings:
        print(f"check_includes: {len(findings)} findings", file=sys.stderr)
        return 1
    graph, _ = read_graph(args.src)
    edges = sum(len(v) for v in graph.values())
    print(f"check_includes: {len(graph)} units, {edges} edges, layered, no cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
