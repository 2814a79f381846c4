"""pip install through a wheelhouse kept between runs, with the CUDA libraries shared:
tox's install command for the py310, py312 and py313 environments.

    python tools/wheelhouse.py install [pip options] PACKAGE...

On Linux, PyPI has torch 2.13.0 as a CPU build for CPython 3.11 only (the one that lies on
this kind of machine's disk); for 3.10, 3.12 and 3.13 it has the CUDA build, which pulls in
2.7 GB of ``nvidia-*`` libraries. Installed by pip into each of the three environments,
with the downloaded wheels kept beside them, that was some 18 GB of disk, enough to fill
a CI machine. Here:

- The requirements are resolved once per interpreter (``pip install --dry-run --report``,
  which reads PyPI's metadata files and downloads no wheel) and the pins recorded, so a
  later run asks PyPI nothing.
- The ``nvidia-*`` and ``cuda-toolkit`` distributions are ``py3-none``: the same files for
  every interpreter. They are installed once (``pip install --target``) into a shared
  folder beside the wheelhouse, and each environment's site-packages gets a symbolic link
  to each of that folder's entries (``nvidia/`` and the ``*.dist-info`` folders). torch
  finds its libraries there as it always does (its RPATH is
  ``$ORIGIN/../../nvidia/.../lib``), and ``pip check`` sees them installed.
- Everything else is downloaded once into the wheelhouse (``$MEMLORD_WHEELHOUSE``, else
  ``~/.cache/memlord/wheelhouse``) and installed from there (``--no-index --no-deps``, the
  recorded pins).

Two environments set up at once (tox runs two at a time) take turns under a file lock
for the downloads. A failed step leaves no record: the next run tries again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

#: distributions that are the same files for every interpreter, installed once and linked
SHARED_PREFIXES = ("nvidia-", "cuda-toolkit")


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


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def is_shared(name: str) -> bool:
    return canonical(name).startswith(SHARED_PREFIXES)


def resolve(pip: list[str], reqs: list[str]) -> list[str]:
    """Every distribution ``reqs`` needs on this interpreter, as ``name==version`` pins."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        subprocess.run(
            [
                *pip,
                "install",
                "-q",
                "--dry-run",
                "--ignore-installed",
                "--only-binary=:all:",
                "--report",
                str(report),
                *reqs,
            ],
            check=True,
        )
        data = json.loads(report.read_text())
    pins = []
    for item in data["install"]:
        meta = item["metadata"]
        pins.append(f"{canonical(meta['name'])}=={meta['version']}")
    return sorted(pins)


def ensure_shared(pip: list[str], house: Path, pins: list[str]) -> Path:
    """The folder holding the shared distributions ``pins``, installed there once."""
    key = hashlib.sha256("\n".join(pins).encode()).hexdigest()[:16]
    final = house / f"shared-{key}"
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".shared-{key}-", dir=house))
    try:
        print(
            f"wheelhouse: installing {len(pins)} shared CUDA distributions into {final}", flush=True
        )
        subprocess.run(
            [
                *pip,
                "install",
                "-q",
                "--no-deps",
                "--no-compile",
                "--only-binary=:all:",
                "--find-links",
                str(house),
                "--target",
                str(tmp),
                *pins,
            ],
            check=True,
        )
        if (tmp / "bin").exists():  # console scripts, of no use through a link
            shutil.rmtree(tmp / "bin")
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def link_shared(shared: Path) -> None:
    """A symbolic link in this environment's site-packages to each entry of ``shared``."""
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in sorted(shared.iterdir()):
        link = site / entry.name
        if link.is_symlink():
            if link.resolve() == entry.resolve():
                continue
            link.unlink()
        elif link.exists():
            raise SystemExit(f"wheelhouse: {link} exists and is not a link to {entry}")
        link.symlink_to(entry, target_is_directory=entry.is_dir())


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
    record = house / f".pins-{tag}-{key}.json"
    with open(house / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if record.exists():
                pins = json.loads(record.read_text())
            else:
                print(f"wheelhouse: resolving {' '.join(reqs)} for {tag}", flush=True)
                pins = resolve(pip, reqs)
            own = [p for p in pins if not is_shared(p.split("==")[0])]
            shared = [p for p in pins if is_shared(p.split("==")[0])]
            shared_dir = ensure_shared(pip, house, shared) if shared else None
            if not record.exists():
                print(
                    f"wheelhouse: downloading {len(own)} wheels for {tag} into {house}", flush=True
                )
                subprocess.run(
                    [
                        *pip,
                        "download",
                        "-q",
                        "--no-deps",
                        "--only-binary=:all:",
                        "-d",
                        str(house),
                        *own,
                    ],
                    check=True,
                )
                record.write_text(json.dumps(pins, indent=1) + "\n")
        except subprocess.CalledProcessError as e:
            return e.returncode or 1
    # --no-compile: torch's thousands of modules are byte-compiled when first imported,
    # not all at install (which took minutes of the environment's set-up)
    rc = subprocess.call(
        [
            *pip,
            "install",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--find-links",
            str(house),
            *opts,
            *own,
        ]
    )
    if rc == 0 and shared_dir is not None:
        link_shared(shared_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
