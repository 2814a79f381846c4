"""A profile says where it was written: ``host`` always, ``rank`` and ``world_size``
when torch.distributed is initialised or a launcher (torchrun) set ``RANK`` and
``WORLD_SIZE``; the profiler's default JSON name then ends in ``_rank<r>``, so the
files of a job's ranks never clash and ``python -m memlord merge`` knows which is which.
(With a real process group: tests/integration/test_ranks_gather.py.)"""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch

from memlord import MemLord
from memlord.profiler import MemoryTracker


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _write(tmp_path):
    tracker = MemoryTracker(tmp_path, True, None, install_handlers=False)
    tracker.start()
    torch.empty(1024)
    (path,) = tracker.stop()
    return path, json.loads(path.read_text())["metadata"]


def test_launcher_rank_in_the_default_name_and_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    path, md = _write(tmp_path)
    assert re.fullmatch(r"memory_profile_\d{8}_\d{6}_\d+_\d+_rank2\.json", path.name), path.name
    assert (md["rank"], md["world_size"], md["host"]) == (2, 4, socket.gethostname())


@pytest.mark.parametrize(
    "env",
    [{}, {"RANK": "1"}, {"RANK": "4", "WORLD_SIZE": "4"}, {"RANK": "x", "WORLD_SIZE": "2"}],
    ids=["none", "rank only", "rank past the world", "not a number"],
)
def test_no_rank_without_a_group_or_a_launcher(tmp_path, monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    path, md = _write(tmp_path)
    assert re.fullmatch(r"memory_profile_\d{8}_\d{6}_\d+_\d+\.json", path.name), path.name
    assert "rank" not in md and "world_size" not in md
    assert md["host"] == socket.gethostname()


def test_lord_export_names_its_rank_in_the_metadata(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    MemLord().export(tmp_path / "p.json")
    md = json.loads((tmp_path / "p.json").read_text())["metadata"]
    assert (md["rank"], md["world_size"], md["host"]) == (0, 2, socket.gethostname())
