"""memlord's pytest plugin (the ``pytest11`` entry point ``memlord``): memory limits and
leak checks per test, for CPU and CUDA tensors.  See docs/pytest.md.

This module is what pytest loads at startup: options, markers, sizes, the reports.  It
imports only the standard library and pytest.  The measuring half,
``memlord.pytest_plugin``, imports torch and memlord's C core, and is imported only once a
test is measured (``--memlord``, a memory marker, or the ``memlord`` fixture).
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

MARKERS = {
    "limit_memory": (
        "limit_memory(size, device='cpu'): fail when the test call's peak of live tracked "
        "tensor bytes on the device exceeds size (memlord)"
    ),
    "limit_leaks": (
        "limit_leaks(size, device=None, warmups=1): fail when storages created by the test "
        "call and still alive after it exceed size (memlord)"
    ),
    "no_cuda_leaks": (
        "no_cuda_leaks: fail unless torch.cuda.memory_allocated is back to its start value "
        "on every CUDA device after the test call (memlord; skipped without CUDA)"
    ),
}

JSON_VERSION = 1
_UNITS = {
    "": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt]i?)b|(b))?\s*$", re.IGNORECASE)
#: a device as the ledger names it (so a limit on it can match): an ASCII index without
#: a leading zero, nothing after it (``$`` would let a trailing newline through)
_DEVICE = re.compile(r"(cpu|mps|(cuda|xpu)(:(0|[1-9][0-9]*))?)\Z")
_STASH: pytest.StashKey[dict[str, Any]] = pytest.StashKey()
_BAD: pytest.StashKey[str] = pytest.StashKey()


def parse_size(value: object) -> int:
    """A size as bytes: an int or float >= 0, or a string such as ``"24 MB"`` (decimal:
    kB, MB, GB, TB), ``"1.5GiB"`` (binary: KiB, MiB, GiB, TiB), ``"512 B"``, ``"100"``.
    Raises ValueError/TypeError saying what was expected."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(
            f"expected a size (an int, a float or a string like '24 MB'), got "
            f"{type(value).__name__}"
        )
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"expected a size like '24 MB', '1.5GiB' or '512KiB', got {value!r}")
        number = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
        if number == float("inf"):  # more digits than a float holds
            raise ValueError(f"expected a size below 2**1024 bytes, got {value!r}")
        return int(number)
    if value != value or value in (float("inf"), float("-inf")) or value < 0:
        raise ValueError(f"expected a size >= 0, got {value!r}")
    return int(value)


def format_size(n: int) -> str:
    """Bytes as a short binary string (memlord's format_bytes without importing it)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _check_device(where: str, device: object, allow_none: bool) -> str | None:
    if device is None and allow_none:
        return None
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise ValueError(f"{where}: device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def _marker_args(where: str, mark: pytest.Mark, names: tuple[str, ...]) -> dict[str, Any]:
    if len(mark.args) > len(names):
        raise TypeError(f"{where}: takes at most {len(names)} positional arguments")
    out = dict(zip(names, mark.args, strict=False))
    for k, v in mark.kwargs.items():
        if k not in names:
            raise TypeError(f"{where}: unexpected argument {k!r}")
        if k in out:
            raise TypeError(f"{where}: argument {k!r} given twice")
        out[k] = v
    return out


def read_markers(item: pytest.Item) -> dict[str, Any]:
    """The test's memory markers, validated: ``{"limit_memory": (bytes, device),
    "limit_leaks": (bytes, device or None, warmups), "no_cuda_leaks": True}``.  Raises
    pytest.UsageError naming the test for a bad argument."""
    out: dict[str, Any] = {}
    try:
        m = item.get_closest_marker("limit_memory")
        if m is not None:
            where = "@pytest.mark.limit_memory"
            a = _marker_args(where, m, ("size", "device"))
            if "size" not in a:
                raise TypeError(f"{where}: missing the size")
            size = _size(where, a["size"])
            out["limit_memory"] = (size, _check_device(where, a.get("device", "cpu"), False))
        m = item.get_closest_marker("limit_leaks")
        if m is not None:
            where = "@pytest.mark.limit_leaks"
            a = _marker_args(where, m, ("size", "device", "warmups"))
            if "size" not in a:
                raise TypeError(f"{where}: missing the size")
            size = _size(where, a["size"])
            warmups = a.get("warmups", 1)
            if isinstance(warmups, bool) or not isinstance(warmups, int) or warmups < 0:
                raise ValueError(f"{where}: warmups: expected an int >= 0, got {warmups!r}")
            out["limit_leaks"] = (size, _check_device(where, a.get("device"), True), warmups)
        m = item.get_closest_marker("no_cuda_leaks")
        if m is not None:
            if m.args or m.kwargs:
                raise TypeError("@pytest.mark.no_cuda_leaks: takes no arguments")
            out["no_cuda_leaks"] = True
    except (TypeError, ValueError) as e:
        raise pytest.UsageError(f"{item.nodeid}: {e}") from None
    return out


def _size(where: str, value: object) -> int:
    try:
        return parse_size(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{where}: size: {e}") from None


# --- options and markers -----------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memlord", "memory limits and leak checks per test (memlord)")
    group.addoption(
        "--memlord",
        action="store_true",
        default=False,
        help="measure every test's peak of live tensor bytes per device and report the "
        "largest at the end",
    )
    group.addoption(
        "--memlord-top",
        type=int,
        default=10,
        metavar="N",
        help="how many tests the --memlord table lists (default 10)",
    )
    group.addoption(
        "--memlord-json",
        metavar="PATH",
        default=None,
        help="write every measured test's peaks, leaks and limit results to PATH "
        "(implies --memlord)",
    )
    group.addoption(
        "--memlord-baseline",
        metavar="PATH",
        default=None,
        help="a file written by --memlord-json on an earlier run, to compare peaks with "
        "(implies --memlord)",
    )
    group.addoption(
        "--memlord-fail-on-increase",
        nargs="?",
        type=float,
        const=10.0,
        default=None,
        metavar="PERCENT",
        help="fail tests whose peak grew more than PERCENT (default 10) over "
        "--memlord-baseline; write it as --memlord-fail-on-increase=PERCENT",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    opt = config.option
    if getattr(opt, "memlord_fail_on_increase", None) is not None:
        if not opt.memlord_baseline:
            raise pytest.UsageError("--memlord-fail-on-increase needs --memlord-baseline PATH")
        if not opt.memlord_fail_on_increase >= 0:  # nan too: it would never fail a test
            raise pytest.UsageError(
                "--memlord-fail-on-increase: expected a percentage >= 0, got "
                f"{opt.memlord_fail_on_increase:g}"
            )
    if getattr(opt, "memlord_top", 10) < 0:
        raise pytest.UsageError("--memlord-top: expected an int >= 0")
    if getattr(opt, "memlord_json", None):
        check_writable(opt.memlord_json)
    baseline: dict[str, Any] = {}
    if getattr(opt, "memlord_baseline", None):
        baseline = load_baseline(opt.memlord_baseline)
    active = bool(
        getattr(opt, "memlord", False)
        or getattr(opt, "memlord_json", None)
        or getattr(opt, "memlord_baseline", None)
    )
    config.stash[_STASH] = {"active": active, "records": [], "baseline": baseline}


def check_writable(path: str) -> None:
    """A usage error, before any test runs, unless ``--memlord-json`` can write ``path``:
    not a folder, and its folder (made when missing, as the write at the end would) takes
    a new file, tried for real (memlord.report._util.check_writable, which this module
    cannot import without torch)."""
    target = Path(path)
    try:
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{target.name[:120]}.", dir=target.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != path else ""
        raise pytest.UsageError(
            f"--memlord-json: cannot write {path}: {e.strerror or e}{where}"
        ) from None


def load_baseline(path: str) -> dict[str, dict[str, int]]:
    """``{nodeid: {device: peak}}`` from a file --memlord-json wrote."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise pytest.UsageError(f"--memlord-baseline: no such file: {path}") from None
    except (OSError, ValueError) as e:
        raise pytest.UsageError(f"--memlord-baseline: cannot read {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != JSON_VERSION:
        raise pytest.UsageError(
            f"--memlord-baseline: {path} is not a memlord --memlord-json file (version "
            f"{JSON_VERSION})"
        )
    bad = f"--memlord-baseline: {path} is not a memlord --memlord-json file: "
    tests = doc.get("tests", [])
    if not isinstance(tests, list):
        raise pytest.UsageError(bad + "tests is not a list")
    out = {}
    for i, t in enumerate(tests):
        peak = t.get("peak", {}) if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("nodeid"), str)
            or not isinstance(peak, dict)
            or not all(
                isinstance(d, str) and isinstance(v, int) and not isinstance(v, bool)
                for d, v in peak.items()
            )
        ):
            raise pytest.UsageError(
                bad + f'tests[{i}] is not {{"nodeid": str, "peak": {{device: int}}, ...}}'
            )
        out[t["nodeid"]] = dict(peak)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    in_worker = hasattr(config, "workerinput")
    for item in items:
        try:
            item.stash[_STASH] = read_markers(item)
        except pytest.UsageError as e:
            if not in_worker:
                raise
            # an xdist worker cannot stop the run at collection (xdist reports a crash):
            # the test errors at its setup instead, with the same message
            item.stash[_BAD] = str(e)


# --- measuring the call phase ------------------------------------------------------------


def _state(config: pytest.Config) -> dict[str, Any]:
    return config.stash[_STASH]


def pytest_runtest_setup(item: pytest.Item) -> None:
    bad = item.stash.get(_BAD, None)
    if bad is not None:
        raise pytest.UsageError(bad)
    marks = item.stash.get(_STASH, {})
    if marks.get("no_cuda_leaks"):
        from memlord import pytest_plugin as heavy

        if not heavy.cuda_available():
            pytest.skip("no_cuda_leaks: CUDA is not available")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    state = _state(item.config)
    marks = item.stash.get(_STASH, {})
    if not state["active"] and not marks:
        return (yield)
    from memlord import pytest_plugin as heavy

    leaks = marks.get("limit_leaks")
    if leaks:  # warm-up runs first, unmeasured: caches filled on a first call settle
        for _ in range(leaks[2]):
            item.runtest()
    cuda_before = heavy.cuda_allocated() if marks.get("no_cuda_leaks") else None
    m = heavy.Measurement(item.nodeid, leaks=bool(leaks), sites_at_peak="limit_memory" in marks)
    ran: dict[str, bool] = {}
    method = _unittest_method(item)
    if method is None:
        m.start()
        try:
            result = yield
        except BaseException:
            m.stop()
            _record(item, m, None, marks, failed=True)
            raise
        m.stop()
    else:
        # pytest runs a unittest.TestCase's setUp, test method and tearDown in the call
        # phase: only the method is measured, as only a test function's call is
        _measure_method(item, method, m, ran)
        try:
            result = yield
        finally:
            _unmeasure_method(item, method)
        if not ran:  # setUp raised or skipped: nothing was measured
            return result
        if ran.get("raised"):  # unittest reports the method's error; the limits say nothing
            _record(item, m, None, marks, failed=True)
            return result
    failures: list[str] = []
    cuda_after = None
    if cuda_before is not None:
        heavy.collect()
        cuda_after = heavy.cuda_allocated()
    failures = _record(item, m, (cuda_before, cuda_after), marks, failed=False)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    return result


def _unittest_method(item: pytest.Item) -> Any:
    """The bound test method of a unittest.TestCase item (what pytest calls between setUp
    and tearDown), else None."""
    import unittest

    instance = getattr(item, "instance", None)
    name = getattr(item, "name", None)
    if not isinstance(instance, unittest.TestCase) or not isinstance(name, str):
        return None
    return getattr(item, "obj", None)


def _measure_method(item: pytest.Item, method: Any, m: Any, ran: dict[str, bool]) -> None:
    """item's test method, measured by m: pytest calls item.obj (a synchronous method),
    unittest the instance's attribute (an async one, which pytest leaves to unittest)."""
    import functools
    import inspect

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def measured(*args: Any, **kwargs: Any) -> Any:
            ran["ran"] = True
            m.start()
            try:
                return await method(*args, **kwargs)
            except BaseException:
                ran["raised"] = True
                raise
            finally:
                m.stop()

    else:

        @functools.wraps(method)
        def measured(*args: Any, **kwargs: Any) -> Any:
            ran["ran"] = True
            m.start()
            try:
                return method(*args, **kwargs)
            except BaseException:
                ran["raised"] = True
                raise
            finally:
                m.stop()

    item.obj = measured  # type: ignore[attr-defined]
    setattr(item.instance, item.name, measured)  # type: ignore[attr-defined]


def _unmeasure_method(item: pytest.Item, method: Any) -> None:
    item.obj = method  # type: ignore[attr-defined]
    try:
        delattr(item.instance, item.name)  # type: ignore[attr-defined]
    except AttributeError:
        pass  # pytest removed it already


def _device_matches(selector: str | None, dev: str) -> bool:
    if selector is None:
        return True
    if ":" in selector:
        return dev == selector
    return dev == selector or dev.startswith(selector + ":")


def _record(
    item: pytest.Item, m: Any, cuda: Any, marks: dict[str, Any], *, failed: bool
) -> list[str]:
    """Checks the limits, stores the test's record; returns the failure messages."""
    failures: list[str] = []
    limits: dict[str, Any] = {}
    if "limit_memory" in marks:
        size, sel = marks["limit_memory"]
        devs = [d for d in m.peak if _device_matches(sel, d)]
        worst = max(devs, key=lambda d: m.peak[d], default=None)
        peak = m.peak[worst] if worst else 0
        ok = peak <= size
        limits["limit_memory"] = {"limit": size, "device": sel, "peak": peak, "passed": ok}
        if not ok and not failed:
            lines = [
                f"memlord: limit_memory exceeded on {worst}: peak {format_size(peak)} "
                f"({peak} B) > limit {format_size(size)} ({size} B)",
                "  live tracked bytes by site at the peak:"
                if m.sites_exact
                else "  the sites that allocated the most (the event ring overflowed):",
            ]
            for site, nbytes in m.sites.get(worst, []):
                lines.append(f"    {format_size(nbytes):>12}  {site or '<unknown site>'}")
            cats = m.categories.get(worst) or {}
            if cats:
                lines.append("  categories at the peak:")
                for name, nbytes in sorted(cats.items(), key=lambda kv: -kv[1]):
                    lines.append(f"    {format_size(nbytes):>12}  {name}")
            failures.append("\n".join(lines))
    leaked_json = None
    if m.leaked is not None:
        size, sel, _warm = marks["limit_leaks"]
        mine = [e for e in m.leaked if _device_matches(sel, e["device"])]
        total = sum(int(e["nbytes"]) for e in mine)
        by_site: dict[str, dict[str, int]] = {}
        for e in mine:
            s = by_site.setdefault(e["site"] or "<unknown site>", {"bytes": 0, "count": 0})
            s["bytes"] += int(e["nbytes"])
            s["count"] += 1
        leaked_json = {"bytes": total, "count": len(mine), "by_site": by_site}
        ok = total <= size
        limits["limit_leaks"] = {"limit": size, "device": sel, "leaked": total, "passed": ok}
        if not ok and not failed:
            lines = [
                f"memlord: limit_leaks exceeded: {len(mine)} storage(s), {format_size(total)} "
                f"({total} B) created by the test still alive > limit {format_size(size)} "
                f"({size} B)",
                "  by site:",
            ]
            ranked = sorted(by_site.items(), key=lambda kv: -kv[1]["bytes"])
            for site, s in ranked[:10]:
                lines.append(f"    {format_size(s['bytes']):>12}  {s['count']:>4} x  {site}")
            for e in mine[:5]:
                shape = "x".join(map(str, e["shape"])) if e["shape"] is not None else "?"
                lines.append(
                    f"    largest: {format_size(int(e['nbytes']))} {e['device']} {e['dtype']} "
                    f"[{shape}] {e['site']}"
                )
            failures.append("\n".join(lines))
    if cuda is not None and cuda[0] is not None:
        before, after = cuda
        changed = {d: (before.get(d, 0), after.get(d, 0)) for d in after}
        bad = {d: v for d, v in changed.items() if v[0] != v[1]}
        limits["no_cuda_leaks"] = {
            "before": before,
            "after": after,
            "passed": not bad,
        }
        if bad and not failed:
            lines = ["memlord: no_cuda_leaks: torch.cuda.memory_allocated changed:"]
            for d, (b, a) in bad.items():
                lines.append(f"    {d}: {b} B before, {a} B after ({a - b:+d} B)")
            failures.append("\n".join(lines))
    baseline = _state(item.config)["baseline"].get(item.nodeid)
    pct = item.config.option.memlord_fail_on_increase
    if baseline is not None:
        grew = {}
        for dev, peak in m.peak.items():
            base = baseline.get(dev, 0)
            if peak > base * (1 + (pct if pct is not None else 10.0) / 100):
                grew[dev] = (base, peak)
        limits["baseline"] = {
            "percent": pct,
            "grew": {d: {"baseline": b, "peak": p} for d, (b, p) in grew.items()},
            "passed": not grew or pct is None,
        }
        if grew and pct is not None and not failed:
            lines = [f"memlord: peak grew more than {pct:g}% over the baseline:"]
            for d, (b, p) in grew.items():
                lines.append(f"    {d}: {format_size(p)} ({p} B), baseline {b} B")
            failures.append("\n".join(lines))
    if failed:  # what was measured stays; no limit is judged on a test that raised
        for entry in limits.values():
            entry["passed"] = None
    record = {
        "nodeid": item.nodeid,
        "peak": dict(m.peak),
        "categories": dict(m.categories),
        "top_site": dict(m.top_site),
        "leaks": leaked_json,
        "limits": limits,
        # None: the test raised (failed, errored or skipped itself); no limit failed it
        "passed": None if failed else not failures,
    }
    _state(item.config)["records"].append(record)
    return failures


# --- the fixture -------------------------------------------------------------------------


@pytest.fixture
def memlord() -> Iterator[Any]:
    """A ``MemLord`` with ``hook_into_torch()`` and ``hook_into_python()`` on, disabled
    after the test whatever happens."""
    from memlord import pytest_plugin as heavy

    lord, handles = heavy.fixture_lord()
    try:
        yield lord
    finally:
        heavy.close_handles(handles)


# --- xdist: workers send their records to the controller ---------------------------------


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    state = config.stash.get(_STASH, None)
    if state is None:
        return
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput["memlord_records"] = json.dumps(state["records"])
        return
    path = config.option.memlord_json
    if path and state["active"]:
        write_json(path, state["records"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    state = node.config.stash.get(_STASH, None)
    out = getattr(node, "workeroutput", None) or {}
    if state is not None and "memlord_records" in out:
        state["records"].extend(json.loads(out["memlord_records"]))


def write_json(path: str, records: list[dict[str, Any]]) -> None:
    """Every measured test, sorted by node id, written atomically."""
    from memlord.report._util import atomic_write

    doc = {"version": JSON_VERSION, "tests": sorted(records, key=lambda r: r["nodeid"])}
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # made at start, unless removed since
    with atomic_write(os.fspath(path)) as f:
        f.write(text)


# --- the table at the end ----------------------------------------------------------------


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash.get(_STASH, None)
    if state is None or not state["active"] or getattr(config, "workeroutput", None):
        return
    records = state["records"]
    tr = terminalreporter
    top = config.option.memlord_top
    tr.write_sep("=", f"memlord: {len(records)} tests measured")
    devices = sorted({d for r in records for d in r["peak"]})
    if not devices:
        tr.write_line("no tracked tensor memory in any test")
    for dev in devices:
        ranked = sorted(
            (r for r in records if dev in r["peak"]), key=lambda r: (-r["peak"][dev], r["nodeid"])
        )[:top]
        if not ranked:
            continue
        tr.write_line(f"{dev}: the {len(ranked)} highest peaks")
        for r in ranked:
            site = r["top_site"].get(dev) or "-"
            tr.write_line(f"  {format_size(r['peak'][dev]):>12}  {r['nodeid']}  ({site})")
    grew = [r for r in records if r["limits"].get("baseline", {}).get("grew")]
    if grew:
        tr.write_line(f"peaks above the baseline: {len(grew)}")
        for r in grew:
            for d, g in r["limits"]["baseline"]["grew"].items():
                tr.write_line(f"  {r['nodeid']} {d}: {g['baseline']} B -> {g['peak']} B")
    if config.option.memlord_json:
        tr.write_line(f"memlord: wrote {config.option.memlord_json}")
