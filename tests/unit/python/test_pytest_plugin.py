"""memlord's pytest plugin, run for real: each test writes a small test suite into a
temporary folder and runs pytest on it (in this process, or in a subprocess where the
check needs a fresh interpreter: xdist, and 'nothing imported without --memlord'), then
reads the outcomes, the messages, the table and the JSON file the plugin wrote.

The figures are checked against what the inner tests allocate (torch.zeros(n) of float32
is 4 * n bytes) and the sites against the inner files' own line numbers."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch._dynamo  # noqa: F401

pytest_plugins = ["pytester"]

# torch._dynamo is imported here, before any in-process pytester run: an inner run that
# imported it first (an optimizer's step does) would have it unloaded after, and the next
# inner run's import would register torch's test operator library twice (RuntimeError)


def line_of(source: str, marker: str) -> int:
    """The 1-based line of the inner file holding ``marker`` (pytester drops the
    leading blank lines)."""
    for i, line in enumerate(source.strip("\n").splitlines(), 1):
        if marker in line:
            return i
    raise AssertionError(marker)


PEAK = """
import pytest, torch

@pytest.mark.limit_memory({limit!r})
def test_peak():
    big = torch.zeros(250_000)  # BIG
    del big
    small = torch.zeros(10)
"""


def test_limit_memory_passes_under_the_limit_and_fails_over_it_with_the_sites_at_the_peak(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_peak=PEAK.format(limit="1.5 MB"))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)

    src = PEAK.format(limit="512KiB")
    pytester.makepyfile(test_peak=src)
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(failed=1)
    out = r.stdout.str()
    # the peak is the big tensor (1,000,000 B), not what is left at the end (40 B)
    assert "peak 976.6 KiB (1000000 B) > limit 512.0 KiB (524288 B)" in out
    assert f"976.6 KiB  test_peak.py:{line_of(src, '# BIG')}" in out
    assert "live tracked bytes by site at the peak" in out


def test_limit_memory_counts_only_the_call_not_class_or_module_fixtures(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_fixtures="""
        import pytest, torch

        @pytest.fixture(scope="module")
        def weights():
            return torch.zeros(1_000_000)       # 4 MB, made in setup

        class TestInClass:
            @pytest.fixture(scope="class")
            def table(self):
                return torch.ones(500_000)      # 2 MB

            @pytest.mark.limit_memory("100 kB")
            @pytest.mark.parametrize("n", [10, 20_000])
            def test_small(self, weights, table, n):
                x = torch.zeros(n)
                assert x.numel() == n
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord", "--memlord-json", "o.json")
    r.assert_outcomes(passed=2)
    doc = json.loads((pytester.path / "o.json").read_text())
    peaks = {t["nodeid"].split("::")[-1]: t["peak"] for t in doc["tests"]}
    assert peaks == {"test_small[10]": {"cpu": 40}, "test_small[20000]": {"cpu": 80_000}}


def test_a_fixtures_model_stepped_in_the_test_is_not_the_tests_allocation(
    pytester: pytest.Pytester,
) -> None:
    """A model a fixture made, trained for one step in the test: the test's peak is what
    the step makes (gradients, momentum, activations), never the fixture's parameters
    that the optimizer's step finds (torch.profiler's memory timeline is the reference,
    as the plugin's other peak test)."""
    pytester.makepyfile(
        test_fixture_model="""
        import json, pytest, torch

        @pytest.fixture(scope="module")
        def model():
            torch.manual_seed(0)
            return torch.nn.Linear(512, 512)            # 1 MB of parameters, in setup

        @pytest.mark.limit_memory("1 GB")
        def test_step(model):
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                profile_memory=True, record_shapes=True, with_stack=True,
            ) as prof:
                model(torch.ones(4, 512)).sum().backward()
                opt.step()
            net = peak = 0
            for _t, action, _key, size in prof._memory_profile().timeline:
                net += size if action.name == "CREATE" else -size if action.name == "DESTROY" else 0
                peak = max(peak, net)
            with open("torch_peak.json", "w") as f:
                json.dump(peak, f)
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord", "--memlord-json", "o.json")
    r.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "o.json").read_text())
    (test,) = doc["tests"]
    torch_peak = json.loads((pytester.path / "torch_peak.json").read_text())
    params = (512 * 512 + 512) * 4
    assert torch_peak > params  # gradients and momentum: one more copy of the parameters
    assert test["peak"]["cpu"] == torch_peak
    # the categories of that peak: the gradients (accumulated by then) and the momentum
    # the step made, adding up to the peak; not the parameters the step found (counted
    # from then on, in no peak of the test's)
    assert test["categories"] == {"cpu": {"gradient": params, "optimizer_state": params}}
    assert sum(test["categories"]["cpu"].values()) == test["peak"]["cpu"]
    assert test["top_site"]["cpu"].startswith("test_fixture_model.py:")


def test_a_unittest_case_counts_its_test_method_not_its_setup_or_teardown(
    pytester: pytest.Pytester,
) -> None:
    """pytest runs a unittest.TestCase's setUp, test method and tearDown inside the call
    phase; docs/pytest.md promises that setup and teardown are never measured, so only the
    test method is (sync and async), and a storage setUp made that tearDown frees is no
    leak of the test's."""
    pytester.makepyfile(
        test_unit="""
        import unittest
        import pytest, torch

        class TestCase(unittest.TestCase):
            def setUp(self):
                self.weights = torch.zeros(1_000_000)     # 4 MB, made in setUp

            def tearDown(self):
                big = torch.zeros(2_000_000)              # 8 MB, in tearDown
                del big

            @pytest.mark.limit_memory("100 kB")
            def test_small(self):
                x = torch.zeros(1000)
                self.assertEqual(x.numel(), 1000)

            @pytest.mark.limit_leaks("1 kB")
            def test_keeps_what_setup_made(self):
                self.weights.add_(1)

        class TestAsync(unittest.IsolatedAsyncioTestCase):
            async def asyncSetUp(self):
                self.weights = torch.zeros(1_000_000)

            @pytest.mark.limit_memory("100 kB")
            async def test_small(self):
                x = torch.zeros(2000)
                self.assertEqual(x.numel(), 2000)
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord", "--memlord-json", "o.json")
    r.assert_outcomes(passed=3)
    doc = json.loads((pytester.path / "o.json").read_text())
    peaks = {t["nodeid"].split("test_unit.py::")[-1]: t["peak"] for t in doc["tests"]}
    assert peaks == {
        "TestCase::test_small": {"cpu": 4000},
        "TestCase::test_keeps_what_setup_made": {},
        "TestAsync::test_small": {"cpu": 8000},
    }


LEAK = """
import pytest, torch

CACHE = []
RUNS = []

@pytest.mark.limit_leaks("1 KB", warmups={warmups})
def test_fills_a_cache_once():
    RUNS.append(1)
    if not CACHE:
        CACHE.append(torch.ones(1000))          # ONCE

@pytest.mark.limit_leaks({limit!r})
def test_keeps_adding():
    CACHE.append(torch.zeros(500))              # EVERY

def test_runs():
    assert len(RUNS) == {warmups} + 1
"""


def test_limit_leaks_finds_what_the_test_leaves_alive_by_site_and_warmups_settle_caches(
    pytester: pytest.Pytester,
) -> None:
    src = LEAK.format(warmups=0, limit="1 kB")
    pytester.makepyfile(test_leak=src)
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(failed=2, passed=1)
    out = r.stdout.str()
    assert "limit_leaks exceeded: 1 storage(s), 3.9 KiB (4000 B)" in out
    assert f"3.9 KiB     1 x  test_leak.py:{line_of(src, '# ONCE')}" in out
    assert f"2.0 KiB     1 x  test_leak.py:{line_of(src, '# EVERY')}" in out
    assert "torch.float32 [500]" in out

    # one warm-up run fills the cache before the measured run: nothing left by the latter
    pytester.makepyfile(test_leak=LEAK.format(warmups=2, limit=2000))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=3)


def test_no_cuda_leaks_is_skipped_with_a_reason_without_cuda(pytester: pytest.Pytester) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the skip is for machines without it")
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.no_cuda_leaks
        def test_gpu():
            pass
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "-rs")
    r.assert_outcomes(skipped=1)
    r.stdout.fnmatch_lines(["*no_cuda_leaks: CUDA is not available*"])


def test_no_cuda_leaks_compares_the_allocated_bytes_per_device_before_and_after(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison and its message, with memlord's reading of
    torch.cuda.memory_allocated replaced (this machine may have no CUDA)."""
    from memlord import pytest_plugin as heavy

    readings = iter(
        [{"cuda:0": 512, "cuda:1": 0}, {"cuda:0": 512, "cuda:1": 0}]  # test_kept
        + [{"cuda:0": 512, "cuda:1": 0}, {"cuda:0": 512, "cuda:1": 2048}]  # test_leaks
    )
    monkeypatch.setattr(heavy, "cuda_available", lambda: True)
    monkeypatch.setattr(heavy, "cuda_allocated", lambda: next(readings))
    pytester.makepyfile(
        """
        import pytest
        @pytest.mark.no_cuda_leaks
        def test_kept():
            pass
        @pytest.mark.no_cuda_leaks
        def test_leaks():
            pass
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(
        [
            "*memlord: no_cuda_leaks: torch.cuda.memory_allocated changed:",
            "*cuda:1: 0 B before, 2048 B after (+2048 B)",
        ]
    )
    assert "cuda:0: 512 B before" not in r.stdout.str()


def test_the_memlord_fixture_has_both_hooks_on_and_they_are_off_after_the_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import torch
        ORIGINAL_TO = torch.Tensor.to
        LORDS = []

        def test_uses(memlord):
            LORDS.append(memlord)
            x = torch.zeros(100)                    # a factory: lifetime tracking
            y = x.to(torch.float64)                 # a conversion: the torch hooks
            assert memlord.allocated("cpu")[0] == 400 + 800
            assert torch.Tensor.to is not ORIGINAL_TO
            del x, y
            assert memlord.allocated("cpu")[0] == 0

        def test_fails_inside(memlord):
            LORDS.append(memlord)
            keep = torch.zeros(10)
            raise RuntimeError("boom")

        def test_after():
            assert torch.Tensor.to is ORIGINAL_TO
            for lord in LORDS:
                before = lord.allocated()[0]
                t = torch.zeros(1000).to(torch.float64)
                assert lord.allocated()[0] == before
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider")
    r.assert_outcomes(passed=2, failed=1)
    r.stdout.fnmatch_lines(["*RuntimeError: boom*"])


def test_a_failing_test_under_x_stops_the_run_with_its_lord_unhooked(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlord import pytest_plugin as heavy

    made: list[heavy.Measurement] = []

    class Kept(heavy.Measurement):
        def start(self) -> None:
            made.append(self)
            super().start()

    monkeypatch.setattr(heavy, "Measurement", Kept)
    pytester.makepyfile(
        test_a="""
        import pytest, torch

        @pytest.mark.limit_memory("1 GB")
        @pytest.mark.limit_leaks("1 GB", warmups=0)
        def test_raises():
            x = torch.zeros(10).to(torch.float64)
            raise ValueError("inside")

        def test_not_run():
            pass
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "-x")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*ValueError: inside*"])
    assert "memlord:" not in r.stdout.str()  # the test's own error, not a limit's
    [m] = made
    assert m.lord is not None and m.peak == {"cpu": 40 + 80}
    before = m.lord.allocated()[0]
    kept = torch.zeros(1000).to(torch.float64)  # neither hook counts for it any more
    assert m.lord.allocated()[0] == before and kept.numel() == 1000


def test_json_and_the_baseline_fail_a_test_whose_peak_grew(pytester: pytest.Pytester) -> None:
    suite = """
    import torch
    def test_grows():
        x = torch.zeros({n})
    def test_same():
        x = torch.zeros(1000)
    def test_none():
        pass
    """
    pytester.makepyfile(test_suite=suite.format(n=1000))
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "base.json")
    r.assert_outcomes(passed=3)
    doc = json.loads((pytester.path / "base.json").read_text())
    assert doc["version"] == 1
    by_id = {t["nodeid"]: t for t in doc["tests"]}
    assert by_id["test_suite.py::test_grows"]["peak"] == {"cpu": 4000}
    assert by_id["test_suite.py::test_same"]["top_site"] == {"cpu": "test_suite.py:5"}
    assert by_id["test_suite.py::test_none"]["peak"] == {}
    assert [p.name for p in pytester.path.iterdir() if p.name.endswith(".tmp")] == []

    pytester.makepyfile(test_suite=suite.format(n=1150))  # +15 %
    args = ("-p", "no:cacheprovider", "--memlord-baseline", "base.json")
    r = pytester.runpytest(*args, "--memlord-fail-on-increase")  # default 10 %
    r.assert_outcomes(failed=1, passed=2)
    r.stdout.fnmatch_lines(
        ["*peak grew more than 10% over the baseline:*", "*cpu: 4.5 KiB (4600 B), baseline 4000 B*"]
    )
    pytester.runpytest(*args, "--memlord-fail-on-increase=20").assert_outcomes(passed=3)
    r = pytester.runpytest(*args)  # no failure, the growth is listed
    r.assert_outcomes(passed=3)
    r.stdout.fnmatch_lines(["*test_suite.py::test_grows cpu: 4000 B -> 4600 B*"])


def test_memlord_json_makes_a_missing_folder_and_refuses_a_place_it_cannot_write_at_once(
    pytester: pytest.Pytester,
) -> None:
    """``--memlord-json reports/mem.json`` writes into a folder it makes (as ``python -m
    memlord run`` does), and a path no file can take (a folder) is a usage error before
    any test runs, not a traceback after the whole run."""
    pytester.makepyfile(test_a="import torch\ndef test_a():\n    x = torch.zeros(1000)\n")
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "reports/mem.json")
    r.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "reports" / "mem.json").read_text())
    assert [(t["nodeid"], t["peak"]) for t in doc["tests"]] == [
        ("test_a.py::test_a", {"cpu": 4000})
    ]

    (pytester.path / "taken").mkdir()
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "taken")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: --memlord-json: cannot write taken: *folder*"])
    assert "Traceback" not in r.stderr.str() + r.stdout.str()
    assert "passed" not in r.stdout.str()  # nothing ran
    assert list((pytester.path / "taken").iterdir()) == []


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"version": 1, "tests": 3}, "tests"),
        ({"version": 1, "tests": [3]}, "tests[0]"),
        ({"version": 1, "tests": [{}]}, "tests[0]"),
        ({"version": 1, "tests": [{"nodeid": "a", "peak": [1]}]}, "tests[0]"),
        ({"version": 1, "tests": [{"nodeid": "a", "peak": {"cpu": "x"}}]}, "tests[0]"),
        ({"version": 1, "tests": [{"nodeid": "a"}, {"nodeid": 3, "peak": {}}]}, "tests[1]"),
    ],
)
def test_a_malformed_baseline_is_a_usage_error_naming_the_entry(
    pytester: pytest.Pytester, doc: object, where: str
) -> None:
    """A baseline with the right version but a broken body (hand-edited, a merge
    conflict resolved badly) is a usage error naming the file and the entry, not an
    INTERNALERROR traceback."""
    pytester.makepyfile("def test_a():\n    pass\n")
    (pytester.path / "b.json").write_text(json.dumps(doc))
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-baseline", "b.json")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    prefix = "ERROR: --memlord-baseline: b.json is not a memlord --memlord-json file: "
    assert f"{prefix}{where} is not " in r.stderr.str(), r.stderr.str()
    assert "INTERNALERROR" not in r.stdout.str() + r.stderr.str()


def test_fail_on_increase_refuses_nan(pytester: pytest.Pytester) -> None:
    """``--memlord-fail-on-increase=nan`` would never fail a test (every comparison with
    nan is false): a usage error, as a negative percentage is."""
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "base.json")
    args = ("-p", "no:cacheprovider", "--memlord-baseline", "base.json")
    for value in ("nan", "-5"):
        r = pytester.runpytest(*args, f"--memlord-fail-on-increase={value}")
        assert r.ret == pytest.ExitCode.USAGE_ERROR, value
        r.stderr.fnmatch_lines(
            [f"ERROR: --memlord-fail-on-increase: expected a percentage >= 0, got {value}*"]
        )


def test_the_table_lists_the_highest_peaks_with_their_site(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_table="""
        import pytest, torch
        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_n(n):
            x = torch.zeros(n * 1000)
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord", "--memlord-top", "2")
    r.assert_outcomes(passed=3)
    r.stdout.fnmatch_lines(
        [
            "*memlord: 3 tests measured*",
            "cpu: the 2 highest peaks",
            "*11.7 KiB  test_table.py::test_n[[]3[]]  (test_table.py:4)",
            "*7.8 KiB  test_table.py::test_n[[]2[]]  (test_table.py:4)",
        ]
    )
    assert "test_n[1]" not in r.stdout.str()


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        ('limit_memory("24 XB")', "limit_memory: size: expected a size like '24 MB'"),
        ('limit_leaks("1 MB", warmups=-1)', "warmups: expected an int >= 0, got -1"),
    ],
)
def test_a_bad_marker_argument_is_a_usage_error_naming_the_test(
    pytester: pytest.Pytester, mark: str, message: str
) -> None:
    pytester.makepyfile(
        test_bad=f"""
        import pytest
        def test_fine():
            pass
        @pytest.mark.{mark}
        def test_wrong():
            pass
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines([f"*test_bad.py::test_wrong: *{message}*"])


class _Marked:
    """What read_markers reads of a test item: its node id and its markers."""

    nodeid = "test_x.py::test_y"

    def __init__(self, mark: pytest.MarkDecorator) -> None:
        self.mark = mark.mark

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self.mark if self.mark.name == name else None


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        (pytest.mark.limit_memory(), "limit_memory: missing the size"),
        (pytest.mark.limit_memory("1 MB", "cuda", 3), "takes at most 2 positional arguments"),
        (pytest.mark.limit_memory("1 MB", device="gpu"), "device: expected 'cpu', 'cuda'"),
        # devices no key of the ledger is ever named: the limit would check nothing
        (pytest.mark.limit_memory("1 MB", device="cuda:01"), "device: expected 'cpu', 'cuda'"),
        (pytest.mark.limit_leaks("1 MB", device="cuda:1\n"), "device: expected 'cpu', 'cuda'"),
        (pytest.mark.limit_memory("1 MB", device="cuda:\u0661"), "device: expected 'cpu'"),
        (pytest.mark.limit_memory("9" * 400), "size: expected a size"),
        (pytest.mark.limit_memory(b"1 MB"), "size: expected a size (an int, a float or"),
        (pytest.mark.limit_leaks("1 MB", colour=1), "unexpected argument 'colour'"),
        (pytest.mark.limit_leaks(1, size=2), "argument 'size' given twice"),
        (pytest.mark.limit_leaks(1, warmups=True), "warmups: expected an int >= 0, got True"),
        (pytest.mark.no_cuda_leaks(1), "no_cuda_leaks: takes no arguments"),
    ],
)
def test_each_bad_marker_argument_is_named(mark: pytest.MarkDecorator, message: str) -> None:
    import pytest_memlord

    with pytest.raises(pytest.UsageError, match=re.escape("test_x.py::test_y: @pytest.mark.")):
        pytest_memlord.read_markers(_Marked(mark))  # type: ignore[arg-type]
    with pytest.raises(pytest.UsageError, match=re.escape(message)):
        pytest_memlord.read_markers(_Marked(mark))  # type: ignore[arg-type]


def test_good_marker_arguments_are_read_as_bytes() -> None:
    import pytest_memlord

    read = pytest_memlord.read_markers
    assert read(_Marked(pytest.mark.limit_memory("1.5GiB", device="cuda:1"))) == {  # type: ignore[arg-type]
        "limit_memory": (3 * 2**29, "cuda:1")
    }
    assert read(_Marked(pytest.mark.limit_leaks(size="2 kB", warmups=0))) == {  # type: ignore[arg-type]
        "limit_leaks": (2000, None, 0)
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24 MB", 24_000_000),
        ("24MiB", 24 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("512KiB", 512 * 1024),
        ("2 kB", 2000),
        ("10 B", 10),
        ("100", 100),
        (4096, 4096),
        (1.5e3, 1500),
    ],
)
def test_sizes_are_decimal_or_binary(text: object, expected: int) -> None:
    import pytest_memlord

    assert pytest_memlord.parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1, ValueError, "expected a size >= 0, got -1"),
        (float("nan"), ValueError, "expected a size >= 0"),
        ("1.5 GB!", ValueError, "expected a size like '24 MB'"),
        ("9" * 400 + " MB", ValueError, "expected a size"),  # no float: OverflowError
        ("MB", ValueError, "expected a size like '24 MB'"),
        (True, TypeError, "got bool"),
        (None, TypeError, "got NoneType"),
    ],
)
def test_a_bad_size_says_what_was_expected(value: object, error: type, message: str) -> None:
    import pytest_memlord

    with pytest.raises(error, match=re.escape(message)):
        pytest_memlord.parse_size(value)


def test_without_memlord_the_plugin_imports_neither_torch_nor_memlord(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import sys
        def test_nothing_heavy():
            assert "pytest_memlord" in sys.modules       # the plugin is loaded ...
            assert "torch" not in sys.modules            # ... and imports nothing heavy
            assert "memlord" not in sys.modules
        """
    )
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    r.assert_outcomes(passed=1)


def test_with_memlord_off_no_lord_is_made(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memlord import pytest_plugin as heavy

    made: list[object] = []
    real = heavy.Measurement

    class Counting(real):  # type: ignore[misc,valid-type]
        def start(self) -> None:
            made.append(self)
            super().start()

    monkeypatch.setattr(heavy, "Measurement", Counting)
    pytester.makepyfile("def test_a():\n    pass\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert made == []
    pytester.runpytest("-p", "no:cacheprovider", "--memlord").assert_outcomes(passed=1)
    assert len(made) == 1


def test_xdist_workers_results_are_merged_into_one_table_and_json(
    pytester: pytest.Pytester,
) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(
        """
        import pytest, torch
        @pytest.mark.parametrize("n", range(1, 7))
        def test_n(n):
            x = torch.zeros(n * 1000)

        @pytest.mark.limit_memory("1 kB")
        def test_over():
            x = torch.zeros(1000)

        @pytest.mark.limit_leaks("1 XB")
        def test_bad_size():
            pass
        """
    )
    r = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "2", "--memlord", "--memlord-json", "x.json"
    )
    # a bad marker argument cannot stop an xdist run at collection: the test errors
    r.assert_outcomes(passed=6, failed=1, errors=1)
    r.stdout.fnmatch_lines(
        [
            "*UsageError: test_*.py::test_bad_size: @pytest.mark.limit_leaks: size:*",
            "*limit_memory exceeded on cpu*",
            "*memlord: 7 tests measured*",
        ]
    )
    doc = json.loads((pytester.path / "x.json").read_text())
    peaks = {t["nodeid"].split("::")[-1]: t["peak"].get("cpu") for t in doc["tests"]}
    assert peaks == {**{f"test_n[{n}]": 4000 * n for n in range(1, 7)}, "test_over": 4000}


OPS = """
import pytest, torch

@pytest.mark.limit_memory("512KiB")
def test_op_peak():
    x = torch.ones(500, 500)       # 1,000,000 B: a factory
    y = x @ x                      # OP-PEAK: 1,000,000 B made by an operator
    del y

LEAK = []

@pytest.mark.limit_leaks("1 KiB", warmups=0)
def test_op_leak():
    a = torch.ones(1000)
    LEAK.append(a * 2)             # OP-LEAK: an operator's output kept

def test_fixture(memlord):
    a = torch.ones(1000)
    before = memlord.allocated("cpu")[0]
    b = a + a
    assert memlord.allocated("cpu")[0] - before == b.untyped_storage().nbytes()
"""


def test_operator_outputs_count_in_peaks_leaks_categories_and_the_fixture(
    pytester: pytest.Pytester,
) -> None:
    """The plugin hooks with ops=True: the product of two tensors is in the peak, a kept
    operator output is a leak named by its line, the failure and the JSON give the
    categories at the peak, and the fixture's lord counts operator outputs."""
    pytester.makepyfile(test_ops=OPS)
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "o.json")
    r.assert_outcomes(passed=1, failed=2)
    out = r.stdout.str()
    assert "peak 1.9 MiB (2000000 B) > limit 512.0 KiB (524288 B)" in out
    assert f"976.6 KiB  test_ops.py:{line_of(OPS, '# OP-PEAK')}" in out
    assert "categories at the peak:" in out
    assert re.search(r"1\.9 MiB  activation", out), out
    assert "limit_leaks exceeded: 1 storage(s), 3.9 KiB (4000 B)" in out
    assert f"test_ops.py:{line_of(OPS, '# OP-LEAK')}" in out
    doc = json.loads((pytester.path / "o.json").read_text())
    by_name = {t["nodeid"].split("::")[-1]: t for t in doc["tests"]}
    assert by_name["test_op_peak"]["categories"] == {"cpu": {"activation": 2_000_000}}
    assert by_name["test_op_peak"]["peak"] == {"cpu": 2_000_000}


OTHER_PLUGIN = """
import pytest, torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SEEN = {"dispatch": [], "function": []}


class Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        SEEN["dispatch"].append(str(func))
        return func(*args, **(kwargs or {}))


class Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        SEEN["function"].append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    # another plugin's modes, entered around every test call (outside memlord's)
    with Dispatch(), Function():
        return (yield)
"""

UNDER_MODES = """
import pytest, torch
from conftest import SEEN

@pytest.mark.limit_memory("512KiB")
def test_product_under_modes():
    x = torch.ones(500, 500)
    y = x @ x                    # 1,000,000 B made by an operator, seen by both
    assert y[0, 0].item() == 500.0

def test_other_modes_saw_what_they_see_bare():
    assert "aten.mm.default" in SEEN["dispatch"]
    assert "matmul" in SEEN["function"] or "__matmul__" in SEEN["function"]
"""


def test_beside_another_plugins_dispatch_and_function_modes(pytester: pytest.Pytester) -> None:
    """Another plugin's TorchDispatchMode and TorchFunctionMode, entered around each test
    call, see the test's operators and values as they do bare, and memlord still counts
    the operator's output into the peak (its mode sits beneath theirs)."""
    pytester.makeconftest(OTHER_PLUGIN)
    pytester.makepyfile(test_modes=UNDER_MODES)
    r = pytester.runpytest("-p", "no:cacheprovider")
    # the limit fails the product; the other plugin's modes saw mm and matmul
    r.assert_outcomes(passed=1, failed=1)
    assert "peak 1.9 MiB (2000000 B) > limit 512.0 KiB (524288 B)" in r.stdout.str()


def test_a_test_that_raised_has_no_limit_judged_in_the_json(pytester: pytest.Pytester) -> None:
    """A test that raised over its limit: the JSON keeps the peak measured and judges
    nothing, the test's `passed` and its limit's both null (the limit said false, though
    no limit is judged for a test that raised); the same test not raising is false."""
    pytester.makepyfile(
        """
        import pytest, torch

        @pytest.mark.limit_memory("1 KB")
        def test_raises():
            x = torch.ones(10000)
            raise ValueError("boom")

        @pytest.mark.limit_memory("1 KB")
        def test_over():
            x = torch.ones(10000)
        """
    )
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "x.json")
    r.assert_outcomes(failed=2)
    doc = json.loads((pytester.path / "x.json").read_text())
    by_name = {t["nodeid"].split("::")[-1]: t for t in doc["tests"]}
    raised, over = by_name["test_raises"], by_name["test_over"]
    assert raised["passed"] is None and over["passed"] is False
    assert raised["limits"]["limit_memory"] == {
        "limit": 1000,
        "device": "cpu",
        "peak": 40000,  # torch's own nbytes of the 10,000 floats
        "passed": None,
    }
    assert over["limits"]["limit_memory"]["passed"] is False
    assert over["limits"]["limit_memory"]["peak"] == 40000


def test_a_training_steps_peak_is_torch_profilers(pytester: pytest.Pytester) -> None:
    """The peak the plugin reports for a test that builds a model and runs a forward and
    backward is the peak of torch.profiler's own memory timeline of the same call (the
    inner test records it and writes it beside the JSON): activations and gradients
    included, since the plugin counts op outputs."""
    suite = """
    import json, torch

    def test_step():
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            profile_memory=True, record_shapes=True, with_stack=True,
        ) as prof:
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
            )
            loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
            del loss, model
        net = peak = 0
        for _t, action, _key, size in prof._memory_profile().timeline:
            net += {"CREATE": size, "DESTROY": -size}.get(action.name, 0)
            peak = max(peak, net)
        with open("torch_peak.json", "w") as f:
            json.dump(peak, f)
    """
    pytester.makepyfile(test_suite=suite)
    r = pytester.runpytest("-p", "no:cacheprovider", "--memlord-json", "m.json")
    r.assert_outcomes(passed=1)
    theirs = json.loads((pytester.path / "torch_peak.json").read_text())
    (entry,) = json.loads((pytester.path / "m.json").read_text())["tests"]
    assert theirs > 0
    assert entry["peak"] == {"cpu": theirs}
