"""The errors `import memlord` raises when the C extension memlord._core cannot be found,
and when the torch it finds is older than memlord supports.

Python imports the folder `memlord/` it finds first on `sys.path`. Run from the root of a
source checkout, that is the source folder itself, which holds no compiled `_core` until
it is built in place (`pip install -e .`); the error then says exactly what to run. This
module imports nothing from memlord, so it works when the rest of the package cannot.
"""

from __future__ import annotations

import importlib.machinery
import os
import shlex
import sys


def _quote(path: str) -> str:
    return shlex.quote(path)


def missing_core_error() -> ImportError | None:
    """An ImportError that says how to get memlord._core, or None when a _core for this
    interpreter is there (it then failed to load for a reason of its own, to be kept)."""
    package = os.path.dirname(os.path.abspath(__file__))
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    if any(os.path.exists(os.path.join(package, "_core" + s)) for s in suffixes):
        return None
    others = sorted(
        name
        for name in os.listdir(package)
        if name.startswith("_core.") and name.endswith((".so", ".pyd"))
    )
    python = _quote(sys.executable)
    wanted = "_core" + suffixes[0]
    lines = [
        f"memlord's C extension is not built for this Python: {package} has no {wanted}"
        + (f" (only {', '.join(others)}, built for another Python)" if others else "")
        + "."
    ]
    root = os.path.dirname(package)
    is_checkout = all(
        os.path.exists(os.path.join(root, name)) for name in ("pyproject.toml", "setup.py", "src")
    )
    if is_checkout:
        lines += [
            "This is memlord's source folder. Build the extension in place with:",
            f"    cd {_quote(root)} && {python} -m pip install -e .",
            "or run Python from another folder to import an installed memlord.",
        ]
    else:
        lines += [
            "Reinstall memlord with this Python:",
            f"    {python} -m pip install --force-reinstall --no-deps memlord",
            "(or, from a source checkout: python -m pip install -e .).",
        ]
    return ImportError("\n".join(lines), name="memlord._core", path=package)


#: The oldest torch memlord runs on (README, Install). Lifetime tracking follows each
#: storage through its Python object, which torch keeps alive for as long as the storage
#: lives: torch 2.1 does not (memlord crashed there), and releases before this one fail
#: memlord's tests (measured on 2.1.2, 2.2.2, 2.9.1, 2.10.0, 2.11, 2.13 and 2.14.1).
TORCH_MIN = (2, 10)


def old_torch_error(torch: object) -> ImportError | None:
    """An ImportError naming the torch found and what to install when it is older than
    TORCH_MIN, else None (a version it cannot read, a source build's included, passes)."""
    version = str(getattr(torch, "__version__", ""))
    parts = version.split("+", 1)[0].split(".")
    try:
        found = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None
    if found >= TORCH_MIN:
        return None
    want = ".".join(map(str, TORCH_MIN))
    where = os.path.dirname(str(getattr(torch, "__file__", "") or "")) or "?"
    return ImportError(
        f"memlord needs torch {want} or newer; this Python has torch {version} ({where}). "
        f"Upgrade it: {_quote(sys.executable)} -m pip install 'torch>={want}'"
    )
