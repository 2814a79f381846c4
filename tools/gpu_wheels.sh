#!/usr/bin/env bash
# Wheels for tools/gpu_check.sh that the device machine lacks (it has no network):
# hypothesis (the suite imports it) and pytest-xdist (the suite in parallel), with what
# they need. Pure-Python wheels, downloaded here into .whl/ (git-ignored through
# .git/info/exclude); the device tool's `carry: [".whl"]` takes them along.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
    hypothesis sortedcontainers attrs pytest-xdist execnet
ls .whl
