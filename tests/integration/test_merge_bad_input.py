"""``python -m memlord merge`` given files that are not per-rank profiles or
post-mortems: one line per bad file on stderr naming the file and why, exit status 2
and nothing written; with ``--keep-going`` the report of the good files is written (the
bad ones listed in it) and the exit status is 1.  A wrong output name is refused before
any file is read.  The good files are real: ``lord.export`` of a lord that allocated a
known amount, and a real out-of-memory post-mortem where memlord writes them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from memlord import MemLord
from memlord.cli import main

MiB = 1 << 20


def _export(path, nbytes):
    lord = MemLord(auto_gc_bytes=None)
    lord.record_events(1 << 10)
    with lord.hook_into_python():
        t = torch.empty(nbytes, dtype=torch.uint8)
        lord.export(path)
        size = t.untyped_storage().nbytes()
    return size


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Two real profiles, ranks named only by their file names (no process group)."""
    d = tmp_path_factory.mktemp("good")
    sizes = [_export(d / f"step_rank{r}.json", (r + 1) * MiB) for r in range(2)]
    return [str(d / f"step_rank{r}.json") for r in range(2)], sizes


@pytest.fixture
def bad(tmp_path):
    files = {
        "text": ("notes.json", "this is not JSON\n"),
        "list": ("list.json", "[1, 2, 3]"),
        "other": ("config.json", '{"lr": 0.1}'),
        "schema": ("trace.json", '{"schema": "something.else/2"}'),
        "merged": ("merged.json", '{"schema": "memlord.merge/1", "ranks": []}'),
        "broken": ("broken.json", '{"schema": "memlord.profile", "memlord": {"counters": []}}'),
        "binary": ("binary.json", b"\xff\xfe\x00garbage"),
    }
    out = {}
    for key, (name, content) in files.items():
        p = tmp_path / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        out[key] = str(p)
    out["missing"] = str(tmp_path / "missing_rank3.json")
    out["folder"] = str(tmp_path)
    return out


WHY = {
    "text": "not JSON (Expecting value at line 1)",
    "list": "not a memlord profile or post-mortem (the JSON is a list)",
    "other": "not a memlord profile or post-mortem (no 'schema' key; expected "
    "'memlord.profile' or 'memlord.oom/1')",
    "schema": "not a memlord profile or post-mortem (schema 'something.else/2'; expected "
    "'memlord.profile' or 'memlord.oom/1')",
    "merged": "a merged report already: merge the per-rank files instead",
    "broken": "not a readable memlord profile: memlord.counters: expected an object, got a list",
    "binary": "not JSON (not UTF-8 text)",
    "missing": "no such file",
    "folder": "is a folder, not a file",
}


def _merge(capsys, *argv):
    code = main(["merge", *argv])
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("key", sorted(WHY))
def test_a_bad_file_is_one_line_naming_it_and_nothing_is_written(capsys, good, bad, key, tmp_path):
    out = tmp_path / "out.json"
    code, lines = _merge(capsys, *good[0], bad[key], "-o", str(out))
    assert code == 2
    assert lines == [
        f"memlord: {bad[key]}: {WHY[key]}",
        "memlord: nothing written: 1 bad file(s) (--keep-going merges the others)",
    ]
    assert not out.exists()


def test_keep_going_writes_the_good_ones_and_exits_1(capsys, good, bad, tmp_path):
    out = tmp_path / "out.json"
    files, sizes = good
    bad_files = [bad[k] for k in sorted(WHY)]
    code, lines = _merge(capsys, files[1], *bad_files, files[0], "-o", str(out), "--keep-going")
    assert code == 1
    assert lines[:-1] == [f"memlord: {bad[k]}: {WHY[k]}" for k in sorted(WHY)]
    assert lines[-1] == f"memlord: wrote {out} (2 file(s) merged, {len(WHY)} left out)"
    doc = json.loads(out.read_text())
    assert doc["inputs"] == files
    assert doc["bad_inputs"] == [{"file": bad[k], "problem": WHY[k]} for k in sorted(WHY)]
    # the good ones, ranks from their names, bytes as torch made them
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert [r["devices"]["cpu"]["peak"] for r in doc["ranks"]] == sizes
    assert doc["imbalance"]["cpu"]["ratio"] == pytest.approx(sizes[1] / sizes[0]) == 2.0
    assert doc["peaked"]["rank"] == 1


def test_keep_going_with_no_good_file_writes_nothing(capsys, bad, tmp_path):
    out = tmp_path / "out.json"
    code, lines = _merge(capsys, bad["text"], bad["missing"], "-o", str(out), "--keep-going")
    assert code == 2 and not out.exists()
    assert lines[-1] == "memlord: nothing written: no file could be merged"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("out.txt", "the name must end in .json, .html or .htm"),
        ("out.trace.json", "a merged report is .json or .html, not a trace (--trace writes one)"),
    ],
)
def test_a_wrong_output_name_is_refused_first(capsys, good, tmp_path, name, why):
    out = tmp_path / name
    code, lines = _merge(capsys, *good[0], str(tmp_path / "missing.json"), "-o", str(out))
    assert code == 2 and lines == [f"memlord: -o {out}: {why}"]
    assert not out.exists()


def test_output_and_files_are_required(capsys, good):
    assert main(["merge", *good[0]]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "memlord: merge: -o OUT (.json or .html) or --trace F (.trace.json), or both"
    ]
    with pytest.raises(SystemExit) as info:
        main(["merge", "-o", "x.json"])
    assert info.value.code == 2
    assert "the following arguments are required: FILE" in capsys.readouterr().err


def test_in_a_real_process_the_exit_status_and_lines(good, bad, tmp_path):
    out = tmp_path / "sub" / "merged.json"  # a missing folder is made
    cmd = [sys.executable, "-m", "memlord", "merge", *good[0], bad["list"], "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.splitlines()[0] == f"memlord: {bad['list']}: {WHY['list']}"
    proc = subprocess.run([*cmd, "--keep-going"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(out.read_text())["bad_inputs"][0]["file"] == bad["list"]
    proc = subprocess.run(
        [sys.executable, "-m", "memlord", "merge", *good[0], "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["bad_inputs"] == []


def test_html_without_plotly_is_refused_first(capsys, good, tmp_path, no_plotly):
    out = tmp_path / "out.html"
    code, lines = _merge(capsys, *good[0], str(tmp_path / "missing.json"), "-o", str(out))
    assert code == 2 and not out.exists()  # said before any file is read
    assert lines == [
        "memlord: the HTML report needs plotly, an optional extra: pip install memlord[report]"
    ]


def test_an_output_that_cannot_be_written_is_one_line(capsys, good, tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out.json"  # its folder is a file
    code, lines = _merge(capsys, *good[0], "-o", str(out))
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"memlord: cannot write {out}: ")
