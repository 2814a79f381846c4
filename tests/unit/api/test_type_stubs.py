"""The type stubs against the module they describe, where the test suite runs.

`tox -e lint` holds every stub to the build with `python -m mypy.stubtest memlord`; these
checks are its fast part, run with every test run: the private stub of the C extension
(memlord/_core.pyi) names exactly what the extension has, and MemLord's constructor has
the parameters its public stub's overloads name (stubtest cannot check that one: see
tools/stubtest_allowlist.txt).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import memlord
from memlord import _core
from memlord._regions import REGION_HISTORY

PACKAGE = Path(memlord.__file__).resolve().parent


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _stub_names(body: list[ast.stmt]) -> set[str]:
    """The runtime names a stub body declares: functions, classes, annotated constants and
    aliases of another name (``TorchHooks = Hooks``). Type aliases and TypeVars
    (``_Device = str | torch.device``) exist for type checkers only."""
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not _is_dunder(n)}


def _runtime_names(obj: object) -> set[str]:
    own = vars(obj) if isinstance(obj, type) else dict.fromkeys(dir(obj))
    return {n for n in own if not _is_dunder(n)}


def test_the_core_stub_names_what_the_extension_has() -> None:
    tree = ast.parse((PACKAGE / "_core.pyi").read_text(encoding="utf-8"))
    assert _stub_names(tree.body) == _runtime_names(_core)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            assert _stub_names(node.body) == _runtime_names(getattr(_core, node.name)), node.name


def test_memlord_constructor_has_the_parameters_of_its_stub() -> None:
    tree = ast.parse((PACKAGE / "__init__.pyi").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemLord")
    overloads = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    in_stub: dict[str, object] = {}
    for fn in overloads:
        args = fn.args
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        pairs = list(zip(positional, defaults, strict=True))
        pairs += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
        for arg, default in pairs[1:] if pairs[0][0].arg == "self" else pairs:
            if default is not None:
                in_stub[arg.arg] = ast.literal_eval(default)
            else:
                in_stub.setdefault(arg.arg, inspect.Parameter.empty)
    params = inspect.signature(memlord.MemLord).parameters
    assert set(params) == set(in_stub)
    assert params["auto_gc_bytes"].default == in_stub["auto_gc_bytes"] == "auto"
    assert params["track_callsite"].default is in_stub["track_callsite"] is True
    # a sentinel at run time (leaving it out keeps bytes mode; None is the default bands)
    assert in_stub["auto_gc_strategy"] is inspect.Parameter.empty
    # a sentinel at run time, standing for REGION_HISTORY
    assert in_stub["region_history"] == REGION_HISTORY
    kinds = {p.name: p.kind for p in params.values()}
    assert kinds == {
        "auto_gc_bytes": inspect.Parameter.POSITIONAL_OR_KEYWORD,
        "auto_gc_strategy": inspect.Parameter.KEYWORD_ONLY,
        "track_callsite": inspect.Parameter.KEYWORD_ONLY,
        "region_history": inspect.Parameter.KEYWORD_ONLY,
    }
