"""One byte formatter: the C core's (src/base/format.c).  What Python shows (the public
``format_bytes``, ``memlord._bytes.human_bytes`` that the reports and the memory API
use, the HTML report's tables) equals what C writes itself (``allocated()``'s human
string, ``repr``-free) and what the DEBUG log prints, for a table of sizes."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from memlord import MemLord, format_bytes
from memlord._bytes import human_bytes

# size -> the documented string (docs/api.md#format_bytes)
SIZES = {
    0: "0 B",
    1: "1 B",
    1023: "1023 B",
    1024: "1 KiB",
    1536: "1.5 KiB",
    1025: "1 KiB",
    1029: "1 KiB",
    1030: "1.01 KiB",
    10**6: "976.56 KiB",
    1048570: "1023.99 KiB",
    2**20 - 1: "1 MiB",
    2**20 + 5 * 2**10: "1 MiB",
    2**20 + 2**14: "1.02 MiB",
    2**30 - 1: "1 GiB",
    2**30: "1 GiB",
    3 * 2**30 // 2: "1.5 GiB",
    5 * 2**40: "5 TiB",
    2**63 - 1: "8 EiB",
}


def _nbytes(n: int) -> np.ndarray:
    """An array memlord counts as n bytes, holding one real byte."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(n,), strides=(0,))


@pytest.mark.parametrize("n", list(SIZES))
def test_python_formatter_equals_c_and_the_debug_log(n: int, caplog) -> None:
    text = SIZES[n]
    assert format_bytes(n) == text
    assert human_bytes(n) == text
    if n < 2**53:
        assert human_bytes(float(n)) == text
    if n:
        assert human_bytes(-n) == "-" + text
    lord = MemLord()
    caplog.set_level(logging.DEBUG, logger="memlord")
    arr = _nbytes(n)
    lord.allocate(arr)
    assert lord.allocated("cpu") == (n, text)  # written by C (ml_format_bytes)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[allocate]")]
    if n == 0:
        assert lines == []  # no storage of 0 bytes is counted, so none is logged
        return
    assert len(lines) == 1, lines
    m = re.match(r"\[allocate\] cpu \+(.+?) \(1 storage\).*; cpu allocated (.+)$", lines[0])
    assert m is not None, lines[0]
    assert m.group(1) == m.group(2) == text
    lord.free(arr)


@pytest.mark.parametrize("n", [1536, 10**6, 2**30 - 1, 5 * 2**40])
def test_html_report_shows_the_c_strings(n: int, tmp_path) -> None:
    pytest.importorskip("plotly")
    lord = MemLord()
    lord.allocate(_nbytes(n))
    out = tmp_path / "r.html"
    lord.export(str(out))
    page = out.read_text(encoding="utf-8")
    # the device table: peak, final, allocated total
    cells = re.findall(r"<td[^>]*>([^<]*iB|[^<]* B)</td>", page)
    assert SIZES[n] in cells, cells[:20]
    assert all(c in {SIZES[n], "0 B"} for c in cells), cells[:20]
