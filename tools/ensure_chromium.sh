#!/usr/bin/env bash
# Make sure a headless Chromium is available for the HTML report's browser test
# (tests/integration/test_report_browser.py) and bench/bench_report.py.
#
#   tools/ensure_chromium.sh      prints the browser's path; installs Debian's chromium
#                                 package with apt-get when none is found
#
# Exit status 0 when a browser is available afterwards, 1 otherwise.
set -euo pipefail

find_browser() {
    if [ -n "${MEMLORD_CHROMIUM:-}" ] && [ -x "${MEMLORD_CHROMIUM}" ]; then
        echo "${MEMLORD_CHROMIUM}"
        return 0
    fi
    for name in chromium chromium-browser google-chrome google-chrome-stable; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

if find_browser; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: no chromium found and no apt-get to install it" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo -n"
    else
        echo "ensure_chromium: not root and no sudo: cannot install chromium" >&2
        exit 1
    fi
fi
echo "ensure_chromium: installing Debian's chromium package" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >&2 || true
$SUDO apt-get install -y -qq chromium >&2
find_browser
