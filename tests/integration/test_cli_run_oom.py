"""``python -m memlord run`` writes a post-mortem for each out-of-memory error of the
script (issue 28, item 1), beside the profile, and says so; ``--no-oom`` turns it off.
A real subprocess and a real OOM from torch's CPU allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import memlord
from memlord.report._postmortem import load_post_mortem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(memlord.__file__)))
SCRIPT = """\
import torch
try:
    torch.empty(1 << 50)
except RuntimeError:
    print("caught")
"""


def _run(tmp_path, *options, script=SCRIPT):
    (tmp_path / "s.py").write_text(script)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["MEMLORD_RUNTIME_DIR"] = str(tmp_path / "rt")
    return subprocess.run(
        [sys.executable, "-m", "memlord", "run", "--interval", "0", *options, "s.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_writes_a_post_mortem(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "caught"
    (name,) = [
        f for f in os.listdir(tmp_path) if f.startswith("memlord-oom-") and f.endswith(".json")
    ]
    assert f"out of memory: post-mortem {name}" in out.stderr
    doc = load_post_mortem(tmp_path / name)
    assert doc["request"]["what"] == "torch.empty"
    assert doc["request"]["site"] == "s.py:3"
    assert (tmp_path / name.replace(".json", ".html")).exists()


def test_no_oom_writes_none(tmp_path):
    out = _run(tmp_path, "--no-oom")
    assert out.returncode == 0, out.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("memlord-oom-")]
    assert "post-mortem" not in out.stderr


def test_the_post_mortem_is_named_from_where_run_started_after_the_script_chdirs(tmp_path):
    """The line that names the post-mortem is read in the shell that started ``run``: its
    path is relative to that folder (where the file is), not to the folder the script
    moved to (which named it ``../memlord-oom-...``)."""
    (tmp_path / "sub").mkdir()
    out = _run(tmp_path, script='import os\nos.chdir("sub")\n' + SCRIPT)
    assert out.returncode == 0, out.stderr
    (name,) = [
        f for f in os.listdir(tmp_path) if f.startswith("memlord-oom-") and f.endswith(".json")
    ]
    assert f"out of memory: post-mortem {name}\n" in out.stderr, out.stderr
