"""``python -m memlord merge`` reads out-of-memory post-mortems (schema
``memlord.oom/1``, docs/oom.md) beside profiles: a rank that died of an OOM still has
its row, with the ledger's peak and live bytes at the OOM, one OOM, and the sites of
the live bytes."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from memlord import MemLord
from memlord.cli import main

MiB = 1 << 20


def _profile(path, nbytes):
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python():
        t = torch.empty(nbytes, dtype=torch.uint8)
        lord.export(path)
        return t.untyped_storage().nbytes()


def _documented_post_mortem(rank, live, peak):
    """A post-mortem with the top-level keys docs/oom.md documents (the ones the merge
    reads, and the ones the post-mortem's own check requires)."""
    cats = {"other": 0, "activation": live}
    return {
        "schema": "memlord.oom/1",
        "time": 1_700_000_000.5,
        "time_iso": "2023-11-14T22:13:20.500000+00:00",
        "host": "node7",
        "pid": 4242,
        "rank": rank,
        "world_size": 4,
        "request": {"device": "cpu", "bytes": 1 << 50},
        "devices": {
            "cpu": {
                "ledger": {
                    "allocated": live,
                    "peak_allocated": peak,
                    "categories": cats,
                    "peak_categories": {"other": 0, "activation": peak},
                },
                "categories": cats,
                "by_site": {
                    "top": [
                        {"name": "train.py:12", "bytes": live - 1024, "count": 1},
                        {"name": None, "bytes": 1024, "count": 3},
                    ],
                    "rest": {"groups": 0, "bytes": 0, "count": 0},
                },
            }
        },
        "notes": [],
    }


def test_a_documented_post_mortem_is_a_row_beside_the_profiles(capsys, tmp_path):
    sizes = [_profile(tmp_path / f"p_rank{r}.json", (r + 1) * MiB) for r in range(2)]
    pm = tmp_path / "memlord-oom-node7-4242-rank3-1.json"
    pm.write_text(json.dumps(_documented_post_mortem(3, 5 * MiB, 6 * MiB)))
    out = tmp_path / "m.json"
    files = [str(tmp_path / f"p_rank{r}.json") for r in range(2)] + [str(pm)]
    assert main(["merge", *files, "-o", str(out)]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert [(r["rank"], r["kind"]) for r in doc["ranks"]] == [
        (0, "profile"),
        (1, "profile"),
        (3, "post-mortem"),
    ]
    row = doc["ranks"][2]
    assert (row["host"], row["pid"], row["world_size"], row["ooms"]) == ("node7", 4242, 4, 1)
    cpu = row["devices"]["cpu"]
    assert (cpu["peak"], cpu["live"], cpu["ooms"], cpu["peak_s"]) == (6 * MiB, 5 * MiB, 1, None)
    assert cpu["peak_categories"]["activation"] == 6 * MiB
    assert row["top_sites"] == [
        {"device": "cpu", "site": "train.py:12", "bytes": 5 * MiB - 1024},
        {"device": "cpu", "site": "(no site)", "bytes": 1024},
    ]
    assert row["sites"] == "live at the OOM"
    assert doc["peaked"]["rank"] == 3
    assert doc["imbalance"]["cpu"]["ratio"] == pytest.approx(6 * MiB / sizes[0])


def test_a_post_mortem_with_odd_values_still_merges_what_it_can(capsys, tmp_path):
    doc = _documented_post_mortem(1, MiB, MiB)
    doc["rank"] = "one"  # not an int: the rank comes from the file name
    doc["devices"]["cpu"]["by_site"] = "?"
    doc["devices"]["cpu"]["ledger"]["peak_allocated"] = None  # the live bytes stand in
    pm = tmp_path / "memlord-oom-node7-4242-rank1-1.json"
    pm.write_text(json.dumps(doc))
    out = tmp_path / "m.json"
    assert main(["merge", str(pm), "-o", str(out)]) == 0, capsys.readouterr().err
    row = json.loads(out.read_text())["ranks"][0]
    assert row["rank"] == 1 and row["top_sites"] == []
    assert row["devices"]["cpu"]["peak"] == MiB


def test_a_post_mortem_without_devices_is_a_bad_file(capsys, tmp_path):
    doc = _documented_post_mortem(0, MiB, MiB)
    doc["devices"] = ["cpu"]
    pm = tmp_path / "pm.json"
    pm.write_text(json.dumps(doc))
    assert main(["merge", str(pm), "-o", str(tmp_path / "m.json")]) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith(f"memlord: {pm}: ") and "devices" in first


def test_a_real_post_mortem_merges(capsys, tmp_path):
    """The post-mortem memlord writes at a real CPU OOM."""
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(), lord.watch_oom(tmp_path, html=False) as watch:
        kept = torch.empty(3 * MiB, dtype=torch.uint8)
        with pytest.raises(RuntimeError):
            torch.empty(1 << 60, dtype=torch.uint8)
        nbytes = kept.untyped_storage().nbytes()
    assert len(watch.written) == 1
    pm = watch.written[0]["json"]
    out = tmp_path / "m.json"
    assert main(["merge", pm, "-o", str(out)]) == 0, capsys.readouterr().err
    row = json.loads(out.read_text())["ranks"][0]
    assert (row["kind"], row["pid"], row["host"]) == (
        "post-mortem",
        os.getpid(),
        socket.gethostname(),
    )
    assert row["devices"]["cpu"]["live"] == nbytes and row["ooms"] == 1
    assert row["top_sites"][0]["bytes"] == nbytes


def test_names_from_the_files_stay_text_in_the_page(tmp_path):
    pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")
    doc = _documented_post_mortem(0, MiB, MiB)
    doc["host"] = "<b>node</b>"
    doc["devices"]["cpu"]["by_site"]["top"][0]["name"] = "<script>alert(1)</script>:1"
    pm = tmp_path / "<i>pm.json"
    pm.write_text(json.dumps(doc))
    out = tmp_path / "m.html"
    assert main(["merge", str(pm), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<b>node</b>" not in page and "&lt;b&gt;node&lt;/b&gt;" in page
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page
    assert "<i>pm" not in page and "&lt;i&gt;pm.json" in page


def test_a_rank_whose_profile_and_post_mortem_tie_peaked_when_its_profile_says(capsys, tmp_path):
    """``merge memory_profile_*.json memlord-oom-*.json`` (docs/ranks.md's command) of a
    rank that ran out of memory after its peak: its profile and its post-mortem have the
    same ledger peak, and the post-mortem (first by name) was taken as the one that
    peaked, whose time is unknown: the report said who peaked, but not when, though the
    profile says. Of equal peaks, the one that knows when is named."""
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(1024)
    with lord.hook_into_python(), lord.watch_oom(tmp_path, html=False) as watch:
        kept = torch.empty(3 * MiB, dtype=torch.uint8)
        with pytest.raises(RuntimeError):
            torch.empty(1 << 60, dtype=torch.uint8)
        profile = tmp_path / "memory_profile_20250101_000000_1_1.json"
        lord.export(profile)
    (pm,) = [w["json"] for w in watch.written]
    out = tmp_path / "m.json"
    assert main(["merge", str(profile), pm, "-o", str(out)]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    peaks = {r["kind"]: r["devices"]["cpu"]["peak"] for r in doc["ranks"]}
    assert peaks == {"profile": kept.untyped_storage().nbytes(), "post-mortem": 3 * MiB}
    peaked = doc["peaked"]
    assert (peaked["file"], peaked["peak"]) == (str(profile), 3 * MiB)
    assert peaked["peak_s"] is not None
    assert doc["imbalance"]["cpu"]["max"]["peak_s"] is not None


def test_merge_trace_leaves_a_post_mortem_out_and_says_so(capsys, tmp_path):
    """A post-mortem has no time line: ``merge --trace`` draws the profiles, says the
    post-mortem is left out, and ``-o`` beside it still has the post-mortem's row; only
    post-mortems: nothing written."""
    from support.trace import validate_trace

    size = _profile(tmp_path / "p_rank0.json", MiB)
    pm = tmp_path / "memlord-oom-node7-4242-rank3-1.json"
    pm.write_text(json.dumps(_documented_post_mortem(3, 5 * MiB, 6 * MiB)))
    trace, out = tmp_path / "all.trace.json", tmp_path / "m.json"
    files = [str(tmp_path / "p_rank0.json"), str(pm)]
    assert main(["merge", *files, "-o", str(out), "--trace", str(trace)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "memlord: --trace: 1 post-mortem(s) have no time line: not in the trace",
        f"memlord: wrote {out} (2 file(s) merged)",
        f"memlord: wrote {trace} (2 file(s) merged)",
    ]
    events = validate_trace(json.loads(trace.read_text()))
    assert {e["pid"] for e in events} == {os.getpid()}
    assert max(e["args"]["allocated"] for e in events if e["ph"] == "C") == size
    assert [r["kind"] for r in json.loads(out.read_text())["ranks"]] == ["profile", "post-mortem"]
    alone = tmp_path / "alone.trace.json"
    assert main(["merge", str(pm), "--trace", str(alone)]) == 2
    assert "no profile among the files" in capsys.readouterr().err
    assert not alone.exists()
