"""python -m memlord run / report / gantt on a real training-loop script, in real
processes: reports are written when the script ends normally, raises, calls sys.exit,
or gets SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from memlord import __main__ as memlord_main
from memlord.cli import main as cli_main
from memlord.report import load, memory_series

SCRIPT = """
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
for step in range(5):  # plain SGD (torch.optim's first step imports torch._dynamo: slow)
    loss = model(torch.randn(16, 32)).pow(2).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
print("trained", sys.argv[1:], flush=True)
mode = sys.argv[1]
if mode == "raise":
    raise RuntimeError("boom from the script")
if mode == "exit":
    sys.exit(3)
if mode == "wait":
    print("ready", flush=True)
    time.sleep(60)
"""

HAVE_PLOTLY = True
try:
    import plotly  # noqa: F401
except ImportError:  # pragma: no cover - tox installs the report extra
    HAVE_PLOTLY = False


def _start(tmp_path, mode, *options):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cmd = [sys.executable, "-m", "memlord", "run", *options, str(script), mode]
    return subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _module_counts(doc):
    counts = {}
    for s in doc.operations:
        if s.kind == "module":
            counts[s.name] = counts.get(s.name, 0) + 1
    return counts


def test_run_writes_every_report_with_module_operations(tmp_path):
    html = ["--html", "r.html"] if HAVE_PLOTLY else []
    proc = _start(
        tmp_path,
        "ok",
        *("--modules", "--events", "5000", "--json", "p.json", "--trace", "p.trace.json"),
        *html,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "trained ['ok']" in out  # the script saw its own argv
    doc = load(tmp_path / "p.json")
    # the events are the lord's ring: the script's operators and deaths, at its lines
    assert doc.metadata["events_capacity"] == 5000 and doc.metadata["events_dropped"] == 0
    assert {"op", "death"} <= set(doc.events.decode("source"))
    sites = set(doc.events.decode("site"))
    assert {"train.py:4", "train.py:6"} <= sites, sites
    final = doc.counters["cpu"]["allocated"]
    assert int(memory_series(doc)["cpu"].allocated[-1]) == final
    names = ("Sequential", "0", "1", "2")
    assert _module_counts(doc) == {n: 5 for n in (*names, *(n + " (backward)" for n in names))}
    inner = [s for s in doc.operations if s.name == "0"]
    assert all(s.depth == 1 for s in inner)
    # run counts op outputs: each call of the first Linear leaves its output, 16 x 64
    # floats (torch's own nbytes)
    out_bytes = torch.empty(16, 64).untyped_storage().nbytes()
    assert [s.delta for s in inner] == [{"cpu": out_bytes}] * 5
    assert all(s.finished for s in doc.operations)
    assert doc.metadata["title"].startswith("python -m memlord run")
    trace = json.loads((tmp_path / "p.trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 40  # forward and backward of 4 modules, 5 steps
    if HAVE_PLOTLY:
        assert (tmp_path / "r.html").stat().st_size > 1_000_000
    assert f"wrote {'p.json'}" in err


def test_run_writes_when_the_script_raises(tmp_path):
    proc = _start(tmp_path, "raise", "--modules", "--json", "p.json")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "RuntimeError: boom from the script" in err
    assert _module_counts(load(tmp_path / "p.json"))["Sequential"] == 5


def test_run_writes_on_sys_exit_and_keeps_the_code(tmp_path):
    proc = _start(tmp_path, "exit", "--interval", "0.05")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    (path,) = tmp_path.glob("memory_profile_*.json")  # the default name
    doc = load(path)
    assert doc.snapshots and doc.snapshots[-1]["checkpoint_name"] == "stop"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_run_writes_on_sigterm(tmp_path):
    proc = _start(tmp_path, "wait", "--modules", "--json", "p.json", "--pickle", "p.pickle")
    while True:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if line.strip() == "ready":
            break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, err
    assert _module_counts(load(tmp_path / "p.json"))["2"] == 5
    assert (tmp_path / "p.pickle").stat().st_size > 0


def test_report_and_gantt_convert_a_saved_profile(tmp_path, capsys):
    from support.synthetic import synthetic_profile

    from memlord.report import export

    export(synthetic_profile(2000, steps=3), tmp_path / "in.json")
    outputs = ["--trace", str(tmp_path / "o.trace.json"), "--pickle", str(tmp_path / "o.pkl")]
    if HAVE_PLOTLY:
        outputs += ["-o", str(tmp_path / "o.html")]
    assert cli_main(["report", str(tmp_path / "in.json"), *outputs]) == 0
    assert (tmp_path / "o.trace.json").exists() and (tmp_path / "o.pkl").exists()
    if HAVE_PLOTLY:
        assert cli_main(["gantt", str(tmp_path / "in.json"), str(tmp_path / "g.html")]) == 0
        assert "Operations and regions" in (tmp_path / "g.html").read_text()
    err = capsys.readouterr().err
    assert "wrote" in err and "[" not in err  # no progress bar when stderr is not a TTY


def _memlord(cwd, *args: str) -> subprocess.CompletedProcess:
    """``python -m memlord ARGS`` run in ``cwd``, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "memlord", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("option", "name", "endings"),
    [("--trace", "t.json", ".trace.json"), ("--pickle", "p.html", ".pickle or .pkl")],
)
def test_report_output_option_refuses_a_name_of_another_format(tmp_path, option, name, endings):
    """``report --trace F`` writes a trace and ``--pickle F`` a pickle, as ``run``'s
    options do: a name that picks another writer (``--trace t.json`` would be a JSON
    profile, ``--pickle p.html`` an HTML page) is refused in one line, nothing written."""
    from support.synthetic import synthetic_profile

    from memlord.report import export

    export(synthetic_profile(200, steps=1), tmp_path / "in.json")
    proc = _memlord(tmp_path, "report", "in.json", option, name)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"memlord: {option} {name}: the name must end in {endings}\n"
    assert not (tmp_path / name).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


def test_gantt_refuses_an_output_that_is_no_html_page(tmp_path):
    """``gantt IN.json OUT.html`` writes the HTML report: ``OUT`` named for another
    format (``g.json`` wrote a JSON profile) is refused in one line, nothing written."""
    from support.synthetic import synthetic_profile

    from memlord.report import export

    export(synthetic_profile(200, steps=1), tmp_path / "in.json")
    proc = _memlord(tmp_path, "gantt", "in.json", "g.json")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "memlord: gantt g.json: the name must end in .html or .htm\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


@pytest.mark.parametrize("command", [["report", "in.json"], ["gantt", "in.json", "g.html"]])
def test_report_of_a_folder_says_it_is_a_folder(tmp_path, command):
    """An input that is a folder exists: ``report``/``gantt`` say it is a folder (as
    ``merge`` does), not "no such file"."""
    (tmp_path / "in.json").mkdir()
    proc = _memlord(tmp_path, *command)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "memlord: in.json: is a folder, not a file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


def test_run_with_an_event_ring_larger_than_memory_ends_in_one_line(tmp_path):
    """``run --events N`` with a ring the machine cannot hold (64 bytes a record) ends
    ``run`` before the script starts, with exit status 2 and one line naming the option,
    not a MemoryError traceback."""
    (tmp_path / "s.py").write_text("print('script ran')\n")
    proc = _memlord(tmp_path, "run", "--events", str(2**60), "--json", "p.json", "s.py")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"memlord: --events {2**60}: ") and proc.stderr.count("\n") == 1
    assert "more than this machine's memory" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.py"]


def test_cli_errors_are_clear(tmp_path, capsys):
    assert cli_main(["run", str(tmp_path / "missing.py")]) == 2
    assert "script not found" in capsys.readouterr().err
    (tmp_path / "in.json").write_text("{}")
    assert cli_main(["report", str(tmp_path / "in.json"), "-o", str(tmp_path / "x.csv")]) == 2
    assert "unknown report format" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path / "nope.json")]) == 2
    with pytest.raises(SystemExit):
        cli_main(["run", "--interval", "-1", "x.py"])
    with pytest.raises(SystemExit):
        cli_main(["run", "--events", "-1", "x.py"])


def test_the_demo_says_how_to_get_a_report(capsys):
    assert memlord_main.main(["--layers", "2"]) == 0
    assert "python -m memlord run --html" in capsys.readouterr().out


def test_run_attributes_no_site_to_memlord_itself(tmp_path):
    """No site is memlord's own `python -m memlord` frame (frees of the script's globals
    were put at memlord/__main__.py, then at `<frozen runpy>`; the report is now written
    while the globals are alive: tests/integration/test_cli_run_files.py)."""
    script = tmp_path / "keep.py"
    script.write_text("import torch\nkeep = [torch.empty(1024) for _ in range(4)]\n")
    r = subprocess.run(
        [sys.executable, "-m", "memlord", "run", "--interval", "0", "--json", "p.json"]
        + [str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    hotspots = load(tmp_path / "p.json").hotspots
    by_kind = {(h["kind"], h["site"]): h["bytes"] for h in hotspots}
    assert by_kind[("alloc", "keep.py:2")] == 4 * 4096
    assert not [site for _, site in by_kind if "memlord" in site], hotspots


def test_the_demo_names_its_own_lines_as_user_code(capsys):
    """The demo is memlord's code run as a user's: its sites are its own lines."""
    assert memlord_main.main(["--layers", "2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("top allocation site:"))
    assert "_demo.py:" in line, line
