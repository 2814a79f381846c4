"""Several ranks, for real: 2 and 4 processes joined by gloo on the CPU
(tests/support/rank_worker.py), each allocating a different, known amount under a lord.

``lord.gather()`` must hand every rank the summary of every rank, with each rank's own
live and peak bytes equal to the ``nbytes`` of the tensors that rank made (torch's
figure, not memlord's), its own pid and host.  The profiler's per-rank files (named by
their rank) merged by a real ``python -m memlord merge`` must name the rank that
allocated most as the one that peaked, at a wall-clock time inside the window in which
that rank allocated, with an imbalance equal to the ratio of the known amounts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.trace import validate_trace

from memlord import format_bytes

WORKER = Path(__file__).resolve().parents[1] / "support" / "rank_worker.py"
# the worker's (rank + 1) MiB kept and as much again as scratch
MiB = 1 << 20


def _barrier_keeps() -> int:
    """The bytes a gloo ``dist.barrier()`` leaves allocated for good, read from the source
    of the torch that runs (the header it ships): torch 2.11's ``ProcessGroup::barrier()``
    keeps its 1-byte CPU tensor in a function-local static, so a profile that counts op
    outputs has that byte to the end (torch's profiler sees it so: net 1 byte); 2.13's is
    a local, freed when the barrier returns."""
    import torch

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroup.hpp"
    text = header.read_text()
    start = text.index("c10::intrusive_ptr<Work> barrier(")
    body = text[start : text.index("\n  }\n", start)]
    return 1 if "static at::Tensor tensor;" in body else 0


def _run_job(world: int, out: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    # the ranks meet in a file (a FileStore), not on a TCP port: a port found free and
    # released before the ranks bind it can be taken meanwhile by anything else running
    init = (out / "rendezvous").as_uri()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(r), str(world), init, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _merge(files: list[str], output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memlord", "merge", *files, "-o", str(output), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def job(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"job{world}")
    return world, out, _run_job(world, out)


def test_gather_gives_every_rank_every_ranks_own_bytes(job):
    world, _, reports = job
    host = socket.gethostname()
    for me in reports:
        gathered = me["gathered"]
        assert [s["rank"] for s in gathered] == list(range(world))
        for s, owner in zip(gathered, reports, strict=True):
            assert s["pid"] == owner["pid"] and s["host"] == owner["host"] == host
            assert s["world_size"] == world and s["backend"] == "gloo"
            cpu = s["devices"]["cpu"]
            # torch's own nbytes of what that rank kept, and of its peak (kept + scratch)
            assert cpu["allocated"] == owner["kept"] == (owner["rank"] + 1) * MiB
            assert cpu["peak_allocated"] == owner["kept"] + owner["scratch"]
            assert sum(cpu["categories"].values()) == cpu["allocated"]
            assert sum(cpu["peak_categories"].values()) == cpu["peak_allocated"]
            assert s["ooms"] == 0 and cpu["ooms"] == 0
            # the largest allocation site: the worker's two torch.empty lines
            assert s["top_sites"][0]["site"].rpartition(":")[0].endswith("rank_worker.py")
            assert s["top_sites"][0]["bytes"] == owner["kept"]
            assert owner["before"] - 1 <= s["time"]
        # all_gather: every rank holds the same list
        assert gathered == reports[0]["gathered"]
        assert all(len(s["top_sites"]) == 1 for s in me["gathered_top1"])


def test_gather_refuses_bad_arguments_naming_them(job):
    world, _, reports = job
    for me in reports:
        assert me["bad_group"].startswith("TypeError: gather(): argument 'group' must be a ")
        assert "not str" in me["bad_group"]
        assert me["bad_top"] == "ValueError: gather(): argument 'top' must be >= 0, not -1"
        assert me["bad_top_type"] == "TypeError: gather(): argument 'top' must be an int, not float"
    if world > 1:
        # a group of rank 0 alone: rank 0 gathers its own summary; the others are told
        assert [s["rank"] for s in reports[0]["subgroup"]] == [0]
        for me in reports[1:]:
            assert me["not_member"].startswith("ValueError: gather(): this process is not a member")


def test_gather_without_a_process_group_is_a_runtime_error():
    from memlord import MemLord

    with pytest.raises(RuntimeError, match=r"gather\(\): torch.distributed is not initialised"):
        MemLord(auto_gc_bytes=None).gather()


def test_per_rank_files_name_their_rank(job):
    world, _, reports = job
    for me in reports:
        name = Path(me["profile"]).name
        assert re.fullmatch(
            rf"memory_profile_\d{{8}}_\d{{6}}_{me['pid']}_\d+_rank{me['rank']}\.json", name
        )
        md = json.loads(Path(me["profile"]).read_text())["metadata"]
        assert (md["rank"], md["world_size"], md["host"]) == (me["rank"], world, me["host"])


def test_merge_names_the_rank_that_peaked_when_and_the_imbalance(job, tmp_path):
    world, _, reports = job
    files = [r["profile"] for r in reports]
    proc = _merge(files[::-1], tmp_path / "merged.json")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"memlord: wrote {tmp_path / 'merged.json'} ({world} file(s) merged)"
    ]
    doc = json.loads((tmp_path / "merged.json").read_text())
    assert doc["schema"] == "memlord.merge/1"
    assert [r["rank"] for r in doc["ranks"]] == list(range(world))
    t0 = doc["t0_unix"]
    # the profile counts what torch holds too (the worker's barrier: 1 byte on torch 2.11,
    # none on 2.13)
    held = _barrier_keeps()
    for row, me in zip(doc["ranks"], reports, strict=True):
        cpu = row["devices"]["cpu"]
        assert (row["pid"], row["host"], row["kind"]) == (me["pid"], me["host"], "profile")
        assert cpu["peak"] == me["kept"] + me["scratch"] + held
        assert cpu["live"] == me["kept"] + held
        # when it peaked, on the merged clock: inside the window it allocated in
        assert me["before"] - 0.05 <= t0 + cpu["peak_s"] <= me["after"] + 0.05
        assert row["top_sites"][0]["site"].rpartition(":")[0].endswith("rank_worker.py")
    # the ranks peaked one after another (each waited rank * 0.3 s)
    times = [row["devices"]["cpu"]["peak_s"] for row in doc["ranks"]]
    assert times == sorted(times) and times[-1] - times[0] >= 0.2 * (world - 1)
    cpu = doc["imbalance"]["cpu"]
    peaks = (2 * MiB + held, 2 * world * MiB + held)  # about world to 1
    assert cpu["ratio"] == pytest.approx(peaks[1] / peaks[0])
    assert cpu["max"]["rank"] == world - 1 and cpu["min"]["rank"] == 0
    assert doc["peaked"] == {"type": "cpu", **cpu["max"]}
    assert doc["peaked"]["peak"] == peaks[1]


def _merge_trace(files: list[str], trace: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memlord", "merge", *files, "--trace", str(trace)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _peak_ts(events: list[dict], pid: int, nbytes: int) -> float:
    """When the process's cpu counter first reached nbytes (trace microseconds)."""
    return min(
        e["ts"]
        for e in events
        if e["ph"] == "C"
        and e["pid"] == pid
        and e["name"] == "memory cpu"
        and e["args"]["allocated"] >= nbytes
    )


def test_merge_trace_puts_every_rank_on_one_wall_clock(job, tmp_path):
    """``merge --trace``: one Perfetto trace with a process per rank (its pid, named with
    its rank and host, sorted by rank), every rank's time line placed by the wall clock:
    the gap between two ranks' peaks in the trace is the gap the ranks' own clocks
    (time.time() around each allocation) saw."""
    world, _, reports = job
    trace = tmp_path / "ranks.trace.json"
    proc = _merge_trace([r["profile"] for r in reports][::-1], trace)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"memlord: wrote {trace} ({world} file(s) merged)"]
    data = json.loads(trace.read_text())
    events = validate_trace(data)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert sorted(names) == sorted(me["pid"] for me in reports)
    for me in reports:
        assert f"rank {me['rank']} of {world}, {me['host']}" in names[me["pid"]]
        assert order[me["pid"]] == me["rank"]
    first = reports[0]
    t_first = _peak_ts(events, first["pid"], first["kept"] + first["scratch"])
    for me in reports[1:]:
        gap_s = (_peak_ts(events, me["pid"], me["kept"] + me["scratch"]) - t_first) / 1e6
        assert me["before"] - first["after"] - 0.05 <= gap_s <= me["after"] - first["before"] + 0.05
        assert gap_s >= 0.2 * me["rank"]  # each rank waited rank * 0.3 s


@pytest.mark.parametrize("job", [2], indirect=True, ids=["2 ranks"])
def test_merge_trace_gives_ranks_sharing_a_pid_a_process_each(job, tmp_path):
    """Ranks on different hosts may have the same pid (containers often do): each still
    gets a process of its own in the merged trace, named with its host; a post-mortem
    among the files has no time line and is said to be left out."""
    _, _, reports = job
    src = json.loads(Path(reports[1]["profile"]).read_text())
    src["metadata"]["pid"] = reports[0]["pid"]
    src["metadata"]["host"] = "other-host"
    twin = tmp_path / "twin.json"
    twin.write_text(json.dumps(src))
    trace = tmp_path / "twins.trace.json"
    proc = _merge_trace([reports[0]["profile"], str(twin)], trace)
    assert proc.returncode == 0, proc.stderr
    events = validate_trace(json.loads(trace.read_text()))
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert len(names) == 2 and reports[0]["pid"] in names
    (other,) = [p for p in names if p != reports[0]["pid"]]
    assert "other-host" in names[other] and reports[0]["host"] in names[reports[0]["pid"]]
    assert {e["pid"] for e in events if e["ph"] == "C"} == set(names)


def test_merge_trace_refuses_bad_names_and_needs_an_output(tmp_path):
    some = str(tmp_path / "missing.json")
    for args, words in (
        (["--trace", str(tmp_path / "t.json")], "must end in .trace.json"),
        ([], "-o OUT (.json or .html) or --trace F"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "memlord", "merge", some, *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("job", [2], indirect=True, ids=["2 ranks"])
def test_merged_html_in_a_browser(job, tmp_path, browser):
    pytest.importorskip("plotly", reason="the HTML report needs the report extra (plotly)")
    from support.browser import load_page, probe_charts

    world, _, reports = job
    page = tmp_path / "merged.html"
    proc = _merge([r["profile"] for r in reports], page)
    assert proc.returncode == 0, proc.stderr
    loaded = load_page(page, browser=browser)
    assert loaded.console == [], f"console messages: {loaded.console}"
    assert loaded.ready_ms is not None, "the page's script did not finish"
    dom = loaded.dom
    peaked = dom.partition('id="peaked"')[2].partition("</p>")[0]
    assert f"rank {world - 1} peaked highest on cpu: {format_bytes(2 * world * MiB)}" in peaked
    ranks = dom.partition('id="ranks"')[2].partition("</section>")[0]
    for me in reports:
        row = ranks.partition(f"<td>rank {me['rank']}</td>")[2].partition("</tr>")[0]
        assert f"<td>{me['host']}</td>" in row and str(me["pid"]) in row
        assert format_bytes(me["kept"] + me["scratch"]) in row and format_bytes(me["kept"]) in row
    imbalance = dom.partition('id="imbalance"')[2].partition("</section>")[0]
    assert f">{float(world):.3f}<" in imbalance
    # the chart drew a stacked bar per rank
    chart = dom.partition('id="peaks"')[2].partition("</section>")[0]
    assert len(re.findall(r'class="point"', chart)) >= world
    # the y axis's margin is fixed (with the legend's, it could keep plotly redrawing);
    # every label shows, none over another (plotly's own record and the drawn boxes)
    got = probe_charts(page, browser, ("peaks",))["peaks"]
    assert "y.automargin" not in got["pushers"], got["pushers"]
    assert got["outside"] == [] and got["overlaps"] == [], got


TRAIN = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
kept = torch.empty((dist.get_rank() + 1) << 20, dtype=torch.uint8)
dist.barrier()
dist.destroy_process_group()  # the profile is written at exit, after this
"""


def test_torchrun_memlord_run_writes_a_file_per_rank_that_merge_reads(tmp_path):
    """``torchrun -m memlord run train.py``: each rank's profile is written at exit, after
    the script destroyed its process group, and still names its rank (the launcher's
    RANK and WORLD_SIZE)."""
    (tmp_path / "train.py").write_text(TRAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    # --standalone: torchrun binds a free port itself (a port this test found free could be
    # taken before torchrun binds it)
    launch += ["--standalone", "-m", "memlord", "run", "train.py"]
    proc = subprocess.run(
        launch, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(tmp_path.glob("memory_profile_*.json"))
    assert [re.search(r"_rank(\d)\.json$", f.name).group(1) for f in files] == ["0", "1"]
    out = tmp_path / "merged.json"
    merged = _merge([str(f) for f in files], out)
    assert merged.returncode == 0, merged.stderr
    doc = json.loads(out.read_text())
    assert [(r["rank"], r["world_size"]) for r in doc["ranks"]] == [(0, 2), (1, 2)]
    # what each rank kept, and what torch keeps of its barrier
    held = _barrier_keeps()
    assert [r["devices"]["cpu"]["live"] for r in doc["ranks"]] == [MiB + held, 2 * MiB + held]
    # the peaks also hold the few bytes the barrier's operators make (run counts op
    # outputs): the ratio is theirs, within a few bytes of 2
    peaks = [r["devices"]["cpu"]["peak"] for r in doc["ranks"]]
    assert MiB <= peaks[0] < MiB + 4096 and 2 * MiB <= peaks[1] < 2 * MiB + 4096
    assert doc["peaked"]["rank"] == 1
    assert doc["imbalance"]["cpu"]["ratio"] == peaks[1] / peaks[0] == pytest.approx(2.0, rel=1e-3)
