"""pip install through a wheelhouse kept between runs: tox's install command for the
py310, py312 and py313 environments.

    python tools/wheelhouse.py install [pip options] PACKAGE...

On Linux, PyPI has torch 2.13.0 as a CPU build for CPython 3.11 only (the one that lies on
this kind of machine's disk); for 3.10, 3.12 and 3.13 it has the CUDA build, which pulls in
about 3 GB of ``nvidia-*`` wheels. PyPI's answers are not cached by pip here, so each new
environment would download them again: some ten minutes each. This wrapper downloads every
wheel the requirements need, for the running interpreter, once into a folder that outlives
the environments (``$MEMLORD_WHEELHOUSE``, else ``~/.cache/memlord/wheelhouse``), and then
installs from that folder only (``--no-index``). The ``nvidia-*`` wheels serve every
interpreter (they are ``py3-none``), so each further interpreter adds only its torch wheel.

A stamp file per interpreter and requirement set records a complete download, so a later
run asks PyPI nothing. Two environments that fill the folder at once (tox runs two at a
time) take turns under a file lock. A failed download leaves no stamp: the next run tries
again, and pip skips the wheels it already has.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path


def wheelhouse() -> Path:
    env = os.environ.get("MEMLORD_WHEELHOUSE")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(cache, "memlord", "wheelhouse")


def split(args: list[str]) -> tuple[list[str], list[str]]:
    """(pip options, requirements) of tox's ``{opts} {packages}``."""
    opts, reqs = [], []
    for a in args:
        (opts if a.startswith("-") else reqs).append(a)
    return opts, reqs


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "install":
        print("usage: wheelhouse.py install [pip options] PACKAGE...", file=sys.stderr)
        return 2
    opts, reqs = split(argv[1:])
    pip = [sys.executable, "-m", "pip"]
    if not reqs:
        return subprocess.call([*pip, "install", *opts])
    house = wheelhouse()
    house.mkdir(parents=True, exist_ok=True)
    tag = f"{sys.implementation.name}{sys.version_info[0]}{sys.version_info[1]}"
    key = hashlib.sha256("\n".join(sorted(reqs)).encode()).hexdigest()[:16]
    stamp = house / f".complete-{tag}-{key}"
    with open(house / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists():
            print(f"wheelhouse: downloading {' '.join(reqs)} for {tag} into {house}", flush=True)
            rc = subprocess.call(
                [*pip, "download", "-q", "--only-binary=:all:", "-d", str(house), *reqs]
            )
            if rc != 0:
                return rc
            stamp.write_text("\n".join(sorted(reqs)) + "\n")
    # --no-compile: torch's thousands of modules are byte-compiled when first imported,
    # not all at install (which took minutes of the environment's set-up)
    return subprocess.call(
        [*pip, "install", "--no-index", "--no-compile", "--find-links", str(house), *opts, *reqs]
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
