"""The error `import memlord` raises when the C extension memlord._core cannot be found.

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
