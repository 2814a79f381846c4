"""tox's inline plugin (tox 4 loads ``toxfile.py`` from the project root).

The py310, py312 and py313 environments need ``python3.10``, ``python3.12`` and
``python3.13``. Under pyenv those commands exist as shims that answer only for the
versions the shell has selected (``pyenv global``/``PYENV_VERSION``), so on a machine
where the interpreters are installed but not selected, a plain ``tox`` (the README's test
command) would not find them. Here every installed CPython 3.10, 3.12 and 3.13 is selected
behind the current default, for tox and everything it starts; ``python3`` stays the
default interpreter. Without pyenv this does nothing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

WANTED = re.compile(r"^3\.(10|12|13)\.\d+$")


def _pyenv(*args: str) -> list[str]:
    try:
        out = subprocess.run(
            ["pyenv", *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def select_other_pythons() -> None:
    if shutil.which("pyenv") is None:
        return
    current = os.environ.get("PYENV_VERSION") or ":".join(_pyenv("version-name"))
    selected = [v for v in current.split(":") if v]
    if not selected:
        return
    newest: dict[str, str] = {}
    for version in _pyenv("versions", "--bare"):
        if WANTED.match(version):
            minor = ".".join(version.split(".")[:2])
            key = tuple(int(x) for x in version.split("."))
            if minor not in newest or key > tuple(int(x) for x in newest[minor].split(".")):
                newest[minor] = version
    extra = [v for v in sorted(newest.values()) if v not in selected]
    if extra:
        os.environ["PYENV_VERSION"] = ":".join(selected + extra)


select_other_pythons()
