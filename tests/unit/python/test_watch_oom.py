"""lord.watch_oom() end to end (issue 28, items 1, 3 and 6): a real OOM from torch's CPU
allocator through a hook writes one post-mortem (JSON, HTML, memory_viz pickle), read
back by memlord's loader and by torch's own memory_viz; at most ``limit`` per process;
a directory that cannot be written is logged and the error reaches the caller untouched;
bad arguments install nothing.  The document's content is tested in
test_post_mortem.py."""

from __future__ import annotations

import logging
import os
import pickle
import threading

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from torch import nn

import memlord
from memlord import MemLord, _oom
from memlord.report._postmortem import load_post_mortem

HUGE = 1 << 50


@pytest.fixture(autouse=True)
def fresh_count(monkeypatch):
    """The limit is per process: each test starts from none written."""
    monkeypatch.setattr(_oom, "_written", 0)


def _oom_now():
    try:
        torch.empty(HUGE)
    except RuntimeError as e:
        return e
    raise AssertionError("no OOM")


def test_one_post_mortem_per_oom_with_its_files(tmp_path):
    lord = MemLord()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with lord.hook_into_python(ops=True), lord.watch_oom(tmp_path) as watch:
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        bare = _oom_now()
    assert not watch.enabled
    (paths,) = watch.written
    assert set(paths) == {"json", "html", "pickle"}
    assert all(os.path.dirname(p) == str(tmp_path) for p in paths.values())
    name = os.path.basename(paths["json"])
    assert name.startswith("memlord-oom-") and f"-{os.getpid()}-" in name
    doc = load_post_mortem(paths["json"])
    assert doc["request"]["bytes"] == HUGE * 4
    assert doc["request"]["what"] == "torch.empty"
    assert doc["request"]["site"].endswith(f"test_watch_oom.py:{bare.__traceback__.tb_lineno}")
    # the ledger at the OOM, as the lord itself says it now (nothing changed since)
    assert doc["devices"]["cpu"]["ledger"]["allocated"] == lord.stats()["cpu"]["allocated"]
    with open(paths["pickle"], "rb") as f:
        snap = pickle.load(f)
    assert memory_viz.segsum(snap)  # torch's own reader
    html = open(paths["html"], encoding="utf-8").read()
    assert "0.weight" in html
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths.values())


def test_at_most_limit_per_process(tmp_path):
    a, b = MemLord(), MemLord()
    with a.hook_into_python(), a.watch_oom(tmp_path / "a", limit=3) as wa:
        with b.watch_oom(tmp_path / "b", limit=3) as wb:
            for _ in range(4):
                _oom_now()
    # both lords see every OOM (b watches); the process writes 3 in all
    assert a.stats()["cpu"]["ooms"] == b.stats()["cpu"]["ooms"] == 4
    assert len(wa.written) + len(wb.written) == 3
    files = [f for d in ("a", "b") if (tmp_path / d).exists() for f in os.listdir(tmp_path / d)]
    assert len([f for f in files if f.endswith(".json")]) == 3


def test_a_json_path_names_the_first(tmp_path):
    lord = MemLord()
    target = tmp_path / "crash.json"
    with lord.hook_into_python(), lord.watch_oom(target, html=False) as watch:
        _oom_now()
        _oom_now()
    first, second = watch.written
    assert first["json"] == str(target)
    assert os.path.basename(second["json"]).startswith("crash-")
    assert "html" not in first


def test_unwritable_directory_is_logged_and_the_error_untouched(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    lord = MemLord()
    bare = _oom_now()
    with caplog.at_level(logging.WARNING, logger="memlord"):
        with lord.hook_into_python(), lord.watch_oom(blocker / "sub") as watch:
            got = _oom_now()
    assert type(got) is type(bare) and str(got) == str(bare)
    assert got.__context__ is None and not getattr(got, "__notes__", None)
    assert watch.written == []
    assert any("could not write the OOM post-mortem" in r.getMessage() for r in caplog.records)
    assert lord.stats()["cpu"]["ooms"] == 1
    assert _oom._written == 0  # a failed write does not count against the limit


def test_threads_each_write_their_own(tmp_path):
    lord = MemLord()
    errors = []
    with lord.hook_into_python(), lord.watch_oom(tmp_path, html=False) as watch:
        threads = [threading.Thread(target=lambda: errors.append(_oom_now())) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(errors) == 3
    names = {p["json"] for p in watch.written}
    assert len(names) == 3
    # by name: an ended thread's ident is given to the next one
    threads_named = {load_post_mortem(n)["request"]["thread"]["name"] for n in names}
    assert threads_named == {t.name for t in threads}


def test_watch_is_one_per_lord_and_disable_is_idempotent(tmp_path):
    lord = MemLord()
    w1 = lord.watch_oom(tmp_path, top=5)
    w2 = lord.watch_oom(tmp_path / "x", top=7)
    try:
        assert w1 is w2 and w1.top == 7 and w1.path == tmp_path / "x"
        assert "OOMWatch on" in repr(w1)
    finally:
        w1.disable()
        w1.disable()
    assert _oom.watch_of(lord) is None
    with lord.hook_into_python():
        _oom_now()
    assert w1.written == []


def test_retry_note_names_the_post_mortem(tmp_path):
    lord = MemLord()
    with lord.hook_into_python(), lord.watch_oom(tmp_path, html=False) as watch:
        with pytest.raises(RuntimeError) as info:
            memlord.retry_on_oom(lambda: torch.empty(HUGE), attempts=2, backoff=0)
    (note,) = info.value.__notes__
    assert watch.written[-1]["json"] in note


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"path": 3}, TypeError, ["'path'", "int"]),
        ({"html": "yes"}, TypeError, ["'html'", "str"]),
        ({"top": 0}, ValueError, ["'top'", ">= 1"]),
        ({"top": True}, TypeError, ["'top'", "bool"]),
        ({"top": 2.0}, TypeError, ["'top'", "float"]),
        ({"limit": -1}, ValueError, ["'limit'", ">= 0"]),
        ({"limit": "5"}, TypeError, ["'limit'", "str"]),
    ],
)
def test_bad_input_installs_nothing(kwargs, exc, words):
    lord = MemLord()
    with pytest.raises(exc) as info:
        lord.watch_oom(**kwargs)
    for w in words:
        assert w in str(info.value)
    assert _oom.watch_of(lord) is None
