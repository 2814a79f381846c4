"""The CUDA driver loads on its first use, from whichever entry point comes first.

Each test runs a fresh interpreter (a real subprocess) whose only CUDA driver is the fake
(tests/fakecuda/, named by MEMLORD_CUDA_DRIVER), and makes one of memlord's entry points the
very first thing that needs the driver: device_memory, a deferred move (an event record),
the poll that queries its event, a band decision reading the capacity, "auto", --info.
Each of them loads the driver before it reads the driver's function pointers: device_memory
answers the device's figures, not (None, None, None), and a deferred move waits for its
event instead of being credited at once (repro r41).

A library that is missing, not a library, lacks a symbol, or whose cuInit fails means "no
CUDA driver", never a crash, and _cuda_info / --info say why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fakecuda_driver import GIB, build, run_fresh

from memlord import MemLord, _core

pytestmark = pytest.mark.fakecuda

# The fake's defaults: one device, 16 GiB total, 12 GiB free.
TOTAL, USED = 16 * GIB, 4 * GIB


def fresh(lib, body, env=None) -> dict:
    """Run body in a fresh process; it prints one JSON object last, returned."""
    done = run_fresh(lib, body, env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


CHECKS = """
import json
from memlord import _core
def report(**kw):
    kw.update(misuse=fake.misuse(), depth=fake.ctx_depth(), info=_core._cuda_info())
    print(json.dumps(kw))
"""

STANDINS = """
import torch
from fakecuda_driver import make_standins
streams, names = make_standins(fake)
for name, value in names.items():
    setattr(torch.cuda, name, value)
_core._testing.cuda_standin(streams.source)
from conftest import fake_cuda
"""


def test_device_memory_first(fakecuda_lib):
    out = fresh(
        fakecuda_lib,
        CHECKS
        + """
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
report(mem=lord.device_memory("cuda:0"), init=fake.initialized())
""",
    )
    assert out["mem"] == [TOTAL, USED, 25.0]
    assert out["init"] and out["misuse"] == 0 and out["depth"] == 0
    assert out["info"]["library"] == str(fakecuda_lib)


def test_event_record_first(fakecuda_lib):
    out = fresh(
        fakecuda_lib,
        CHECKS
        + STANDINS
        + """
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_torch()
x = fake_cuda(1024)
x.to("cpu", non_blocking=True)
pending = h.pending("cuda:0")
incomplete = fake.events_incomplete()
freed_before = lord.stats().get("cuda:0", {}).get("freed_total", 0)
torch.cuda.synchronize()
report(pending=pending, incomplete=incomplete, freed_before=freed_before,
       after=h.pending(), freed=lord.stats()["cuda:0"]["freed_total"])
h.disable()
""",
    )
    assert out["pending"] == 4096  # not 0: the move waits for its event
    assert out["incomplete"] == 1 and out["freed_before"] == 0
    assert out["after"] == 0 and out["freed"] == 4096
    assert out["misuse"] == 0 and out["depth"] == 0


def test_event_query_first_at_poll(fakecuda_lib):
    """The poll's event query finds the driver loaded (by the record it follows), and
    credits only once the event completed."""
    out = fresh(
        fakecuda_lib,
        CHECKS
        + STANDINS
        + """
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
h = lord.hook_into_torch()
fake_cuda(256).to("cpu", non_blocking=True)
h.poll()
still = h.pending()
fake.complete()
queries = fake.calls("cuEventQuery")
h.poll()
report(still=still, after=h.pending(), queries=fake.calls("cuEventQuery") - queries)
h.disable()
""",
    )
    assert out["still"] == 1024 and out["after"] == 0 and out["queries"] == 1
    assert out["misuse"] == 0 and out["depth"] == 0


def test_band_decision_first(fakecuda_lib):
    """A band decision reads the built-in capacity: 10 of 16 GiB used (62.5 %) selects the
    upper band, whose 200-byte threshold fires; the lower band's 100 would not have."""
    out = fresh(
        fakecuda_lib,
        CHECKS
        + """
from conftest import fake_cuda
from memlord import MemLord
fake.set_memory(0, 16 << 30, 6 << 30)
fake.set_primary_active(0, True)  # torch initialised the device
band = lambda n: {"metric": "allocated", "threshold": {"bytes": n}}
lord = MemLord(auto_gc_strategy={(0, 50): band(100), (50, 101): band(200)})
lord.allocate(fake_cuda(150, dtype=__import__("torch").uint8))
first = lord.stats()["cuda:0"]["gc_runs"]
lord.allocate(fake_cuda(50, dtype=__import__("torch").uint8))
report(first=first, second=lord.stats()["cuda:0"]["gc_runs"])
""",
    )
    assert out["first"] == 0 and out["second"] == 1
    assert out["info"]["driver"] and out["misuse"] == 0


def test_auto_first(fakecuda_lib):
    out = fresh(
        fakecuda_lib,
        CHECKS
        + """
fake.set_devices(2)
fake.set_memory(1, 6 << 30, 1 << 30)
from memlord import MemLord
report(auto=MemLord("auto").auto_gc_bytes)
""",
    )
    assert out["auto"] == (6 * GIB) // 3  # the smallest device's total // 3


def test_cuda_info_first(fakecuda_lib):
    out = fresh(fakecuda_lib, CHECKS + "report()")
    info = out["info"]
    assert info["driver"] is True and info["reason"] is None
    assert info["library"] == str(fakecuda_lib)
    assert info["device_count"] == 1 and info["min_total"] == TOTAL


def _info(env: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "memlord", "--info"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _env(monkeypatch, **kw) -> dict:
    import os

    env = dict(os.environ)
    env.pop("MEMLORD_DISABLE_CUDA", None)
    env.pop("MEMLORD_CUDA_DRIVER", None)
    env.update(kw)
    return env


def test_info_first_names_the_library(fakecuda_lib, monkeypatch):
    out = _info(_env(monkeypatch, MEMLORD_CUDA_DRIVER=str(fakecuda_lib)))
    assert f"CUDA driver: loaded from {fakecuda_lib}, 1 visible device(s)" in out
    assert "cuda:0" in out and "4 GiB used of" in out and "16 GiB (25.0%)" in out


# --info's reasons, in this process: _testing.cuda_driver() starts over as a fresh process would.


def _info_here(capsys) -> str:
    from memlord.__main__ import info

    capsys.readouterr()
    assert info() == 0
    return capsys.readouterr().out


def test_info_says_why_none_missing_library(fakecuda, tmp_path, capsys):
    missing = tmp_path / "nope.so"
    _core._testing.cuda_driver(str(missing))
    out = _info_here(capsys)
    assert f"CUDA driver: not available (cannot load {missing}:" in out
    assert "cuda:0" not in out


def test_info_says_why_none_disabled(fakecuda, monkeypatch, capsys):
    monkeypatch.setenv("MEMLORD_DISABLE_CUDA", "1")
    _core._testing.cuda_driver(fakecuda.path)
    assert "CUDA driver: not available (MEMLORD_DISABLE_CUDA is set)" in _info_here(capsys)
    assert fakecuda.calls() == 0  # not even loaded


def test_info_says_cuinit_failed_with_its_code(fakecuda, capsys):
    fakecuda.fail("cuInit", 100)
    assert "CUDA driver: not available (cuInit failed with code 100)" in _info_here(capsys)
    assert fakecuda.calls("cuDeviceGetCount") == 0


def test_missing_library_is_no_driver_and_moves_credit_at_once(tmp_path, fakecuda_lib):
    missing = tmp_path / "libcuda-missing.so"
    out = fresh(
        fakecuda_lib,
        CHECKS
        + STANDINS
        + """
from memlord import MemLord
lord = MemLord(auto_gc_bytes=None)
mem = lord.device_memory("cuda:0")
h = lord.hook_into_torch()
fake_cuda(1024).to("cpu", non_blocking=True)
report(mem=mem, pending=h.pending(), freed=lord.stats()["cuda:0"]["freed_total"],
       auto=MemLord("auto").auto_gc_bytes, calls=fake.calls())
h.disable()
""",
        env={"MEMLORD_CUDA_DRIVER": str(missing)},
    )
    assert out["mem"] == [None, None, None]
    assert out["pending"] == 0 and out["freed"] == 4096
    assert out["auto"] is None and out["calls"] == 0
    assert out["info"]["driver"] is False and out["info"]["library"] is None
    assert str(missing) in out["info"]["reason"]


# ---- in-process: _testing.cuda_driver(path) starts over as a fresh process would --------


def test_not_a_library_is_no_driver(fakecuda, tmp_path):
    bogus = tmp_path / "libcuda.so.1"
    bogus.write_text("not an ELF file\n")
    _core._testing.cuda_driver(str(bogus))
    info = _core._cuda_info()
    assert info["driver"] is False and info["device_count"] == 0
    assert info["reason"].startswith(f"cannot load {bogus}:")
    assert MemLord(auto_gc_bytes=None).device_memory("cuda:0") == (None, None, None)


def test_a_directory_is_no_driver(fakecuda, tmp_path):
    _core._testing.cuda_driver(str(tmp_path))
    assert _core._cuda_info()["driver"] is False


@pytest.mark.parametrize("symbol", ["cuEventQuery", "cuCtxGetCurrent"])
def test_missing_symbol(fakecuda, symbol):
    """Every entry point memlord calls is required but cuCtxGetCurrent, which only saves the
    context push: without it memlord pushes, balanced, every time."""
    lib = build(omit=(symbol,))
    _core._testing.cuda_driver(str(lib))
    info = _core._cuda_info()
    if symbol == "cuEventQuery":
        assert info["driver"] is False and info["reason"] == "missing symbol cuEventQuery"
        assert MemLord(auto_gc_bytes=None).device_memory("cuda:0") == (None, None, None)
    else:
        assert info["driver"] is True and info["library"] == str(lib)
        assert MemLord(auto_gc_bytes=None).device_memory("cuda:0")[0] == TOTAL


def test_path_is_decoded_like_a_file_name(fakecuda):
    with pytest.raises(TypeError):
        _core._testing.cuda_driver(42)
    _core._testing.cuda_driver(Path(fakecuda.path))
    assert _core._cuda_info()["library"] == fakecuda.path
