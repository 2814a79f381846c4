"""The OOM post-mortem's HTML page in a real browser (headless Chromium, every host
unresolvable): it loads with no console message, shows the failed request and the
largest storages by the names a person knows, and a user string (a region name that
looks like markup) stays text.  A screenshot is written (to $MEMLORD_SCREENSHOT_DIR when
set, to look at).  The page needs no plotly: it is plain HTML in the report's style."""

from __future__ import annotations

import html
import os
from pathlib import Path

import pytest
import torch
from support.browser import load_page
from torch import nn

from memlord import MemLord
from memlord.report._postmortem import build_post_mortem, write_post_mortem

EVIL = "</td><img src=x onerror=alert(1)>"


def test_post_mortem_page_loads_in_chromium(browser, tmp_path):
    lord = MemLord()
    with lord.hook_into_python(ops=True):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters())
        with lord.region(EVIL):
            model(torch.randn(8, 32)).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError) as err:
            torch.empty(1 << 50)
        doc = build_post_mortem(
            [lord],
            {"device": "cpu", "bytes": 1 << 52, "what": "torch.empty", "error": str(err.value)},
        )
    paths = write_post_mortem(doc, tmp_path, "pm-1")
    shot_dir = Path(os.environ.get("MEMLORD_SCREENSHOT_DIR") or tmp_path)
    loaded = load_page(paths["html"], browser=browser, screenshot=shot_dir / "memlord_oom.png")
    assert loaded.console == [], loaded.console
    assert loaded.ready_ms is not None  # the page's one script ran
    dom = loaded.dom
    assert "out of memory on cpu" in dom
    assert "4 PiB" in dom
    # the one-sentence verdict: the request, what memlord counts, the largest holder
    assert "4 PiB requested on cpu; memlord counts " in dom
    assert "the largest storage: 0.weight (8 KiB)" in dom
    for name in ("0.weight", "grad of 0.weight", "optimizer state exp_avg of 0.weight"):
        assert f"<td>{name}</td>" in dom, name
    # the region name is text, not markup: no <img> element was made from it
    assert "<img" not in dom
    assert html.escape(EVIL, quote=True) in dom or html.escape(EVIL, quote=False) in dom
    assert (shot_dir / "memlord_oom.png").stat().st_size > 0
