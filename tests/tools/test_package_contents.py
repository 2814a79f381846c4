"""What the memlord package holds: the library, not its test support.  The headless
browser driver and the synthetic profile live in tests/support/ (the benchmarks read
them from there), so the wheel, which packs memlord/ and memlord/report/, has neither."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import memlord

PACKAGE = Path(memlord.__file__).resolve().parent


def test_test_support_is_not_in_the_package() -> None:
    for name in ("memlord.report._browser", "memlord.report._synthetic"):
        assert importlib.util.find_spec(name) is None, name
    assert importlib.util.find_spec("support.browser") is not None
    assert importlib.util.find_spec("support.synthetic") is not None


def test_nothing_in_the_package_imports_test_support() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+(support|tests)\b|_browser|_synthetic", re.M)
    hits = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py*")
        if p.suffix in (".py", ".pyi") and pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert hits == []
