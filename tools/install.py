"""Build memlord._core and install memlord into the running interpreter's environment.

Used by tox (see tox.ini). It never resolves dependencies: tox installs the pinned
torch==2.13.0, numpy and setuptools first, so no unpinned torch can ever be pulled
in by the project's own ``torch>=2.10`` requirement; ``pip check`` then confirms
that the installed set satisfies the project's metadata.

Every call builds in a fresh temporary directory. setuptools skips an extension
whose output is newer than its sources whatever the compiler flags were, so a
shared ``build/`` would let a plain build stand in for a sanitizer build (or the
other way round).

    python tools/install.py [--sanitize] [--werror]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sanitize", action="store_true", help="build with ASan+UBSan (MEMLORD_SANITIZE=1)"
    )
    parser.add_argument("--werror", action="store_true", help="turn warnings into errors")
    args = parser.parse_args()

    env = dict(os.environ)
    for flag, name in ((args.sanitize, "MEMLORD_SANITIZE"), (args.werror, "MEMLORD_WERROR")):
        if flag:
            env[name] = "1"
        else:
            env.pop(name, None)
    # The build must not run under a sanitizer runtime preloaded by the caller.
    env.pop("LD_PRELOAD", None)

    with tempfile.TemporaryDirectory(prefix="memlord-build-") as tmp:
        cfg = Path(tmp, "build.cfg")
        cfg.write_text(f"[build]\nbuild_base = {tmp}/build\n")
        env["DIST_EXTRA_CONFIG"] = str(cfg)
        pip = [sys.executable, "-m", "pip"]
        subprocess.run(
            [*pip, "install", "--no-build-isolation", "--no-deps", "-q", str(ROOT)],
            env=env,
            check=True,
        )
    subprocess.run([*pip, "check"], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
