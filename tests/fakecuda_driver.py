"""The fake CUDA driver (tests/fakecuda/fakecuda.c) for the tests marked ``fakecuda``.

* ``build(omit=())`` compiles the fake with the system C compiler into a temporary folder,
  cached by a hash of the source and flags (built atomically: concurrent pytest workers
  share it).  ``omit`` leaves driver entry points out (a driver missing a symbol).
* ``FakeCuda(path)`` drives it through ctypes: devices, memory, primary-context state,
  events that stay incomplete until completed, injected errors, call counters.
* Fixtures (imported into conftest.py):

  - ``fakecuda_lib``: the built library's path (session).  Fails, never skips, when it
    cannot be built: a C compiler is part of the build requirements.
  - ``fakecuda``: memlord's driver switched to the fake, as in a fresh process (nothing
    loaded until first use), the fake reset, every poll asking the driver
    (``_testing.pending_poll_age(0)``); after the test: nothing pending, every pushed
    context popped, no driver rule broken, and memlord back to its usual driver search.
  - ``fake_torch_cuda``: stand-ins for torch's current stream, ``torch.cuda.synchronize``,
    ``Stream`` and ``Event`` (CPU torch has none that work) tied to the fake's events, and
    memlord told to use them (``_core._testing.cuda_standin``) when its torch hooks install.

memlord's driver state is process-wide; ``_core._testing.cuda_driver(path)`` resets it, so every
test starts as a fresh process would, whatever ran before in this one.  The library itself
is loaded once per process (ctypes and memlord's dlopen share it) and reset per test.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import cbuild, warm

SOURCE = Path(__file__).resolve().parent / "fakecuda" / "fakecuda.c"
FLAGS = ["-shared", "-fPIC", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-pthread"]
FLAGS += ["-fvisibility=hidden"]

ENTRY_POINTS = (
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxGetCurrent",
    "cuMemGetInfo_v2",
    "cuDevicePrimaryCtxGetState",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuStreamQuery",
)

# CUresult codes the tests inject
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_LAUNCH_FAILED = 719

GIB = 1 << 30


def build(omit: tuple[str, ...] = ()) -> Path:
    """Path of the fake driver built from SOURCE (without the entry points in omit)."""
    flags = FLAGS + [f"-DFAKECUDA_OMIT_{name}" for name in omit]
    return cbuild.build(SOURCE, flags, "libfakecuda.so", "memlord-fakecuda")


class FakeCuda:
    """The fake driver's control functions."""

    def __init__(self, path: Path | str):
        self.path = str(path)
        lib = self.lib = ctypes.CDLL(self.path)
        for name, res, args in (
            ("fakecuda_reset", None, []),
            ("fakecuda_calls", ctypes.c_long, [ctypes.c_char_p]),
            ("fakecuda_clear_calls", None, []),
            ("fakecuda_fail", ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
            ("fakecuda_misuse", ctypes.c_long, []),
            ("fakecuda_set_devices", ctypes.c_int, [ctypes.c_int]),
            ("fakecuda_set_memory", ctypes.c_int, [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]),
            ("fakecuda_set_primary_active", ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
            ("fakecuda_primary_active", ctypes.c_int, [ctypes.c_int]),
            ("fakecuda_retains", ctypes.c_int, [ctypes.c_int]),
            ("fakecuda_initialized", ctypes.c_int, []),
            ("fakecuda_ctx_depth", ctypes.c_int, []),
            ("fakecuda_set_current", ctypes.c_int, [ctypes.c_int]),
            ("fakecuda_current_device", ctypes.c_int, []),
            ("fakecuda_events_created", ctypes.c_int, []),
            ("fakecuda_events_incomplete", ctypes.c_int, []),
            ("fakecuda_record_seq", ctypes.c_long, []),
            ("fakecuda_set_auto_complete", None, [ctypes.c_int]),
            ("fakecuda_enqueue", ctypes.c_long, [ctypes.c_int, ctypes.c_size_t]),
            ("fakecuda_stream_busy", ctypes.c_int, [ctypes.c_int, ctypes.c_size_t]),
            (
                "fakecuda_complete",
                ctypes.c_int,
                [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_long],
            ),
        ):
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args

    # ---- state
    def reset(self) -> None:
        self.lib.fakecuda_reset()

    def set_devices(self, n: int) -> None:
        assert self.lib.fakecuda_set_devices(n) == 0

    def set_memory(self, dev: int, total: int, free: int) -> None:
        assert self.lib.fakecuda_set_memory(dev, total, free) == 0

    def set_primary_active(self, dev: int, active: bool) -> None:
        assert self.lib.fakecuda_set_primary_active(dev, int(active)) == 0

    def primary_active(self, dev: int) -> bool:
        return bool(self.lib.fakecuda_primary_active(dev))

    def retains(self, dev: int) -> int:
        return self.lib.fakecuda_retains(dev)

    def initialized(self) -> bool:
        return bool(self.lib.fakecuda_initialized())

    def set_current(self, dev: int | None) -> None:
        """Make dev's primary context current on this thread, as torch running on it does."""
        assert self.lib.fakecuda_set_current(-1 if dev is None else dev) == 0

    def current_device(self) -> int | None:
        d = self.lib.fakecuda_current_device()
        return None if d < 0 else d

    # ---- calls and errors
    def calls(self, name: str | None = None) -> int:
        """Calls of one entry point, or of all of them."""
        if name is None:
            return sum(self.calls(n) for n in ENTRY_POINTS)
        n = self.lib.fakecuda_calls(name.encode())
        assert n >= 0, f"unknown entry point {name}"
        return n

    def counts(self) -> dict:
        return {n: c for n in ENTRY_POINTS if (c := self.calls(n))}

    def clear_calls(self) -> None:
        self.lib.fakecuda_clear_calls()

    def fail(self, name: str, code: int, times: int = -1) -> None:
        """The next `times` calls of `name` (every one when -1) return `code`."""
        assert self.lib.fakecuda_fail(name.encode(), code, times) == 0, name

    def heal(self) -> None:
        for name in ENTRY_POINTS:
            self.fail(name, 0, 0)

    def misuse(self) -> int:
        """Calls that broke a driver rule (no context current, unbalanced pop, ...)."""
        return self.lib.fakecuda_misuse()

    def ctx_depth(self) -> int:
        return self.lib.fakecuda_ctx_depth()

    # ---- events
    def events_created(self) -> int:
        return self.lib.fakecuda_events_created()

    def events_incomplete(self) -> int:
        return self.lib.fakecuda_events_incomplete()

    def record_seq(self) -> int:
        return self.lib.fakecuda_record_seq()

    def set_auto_complete(self, on: bool) -> None:
        self.lib.fakecuda_set_auto_complete(int(on))

    def enqueue(self, dev: int, stream: int) -> int:
        """A copy queued on `stream` of `dev`: busy for cuStreamQuery until completed."""
        seq = self.lib.fakecuda_enqueue(dev, stream)
        assert seq > 0, "the fake's table of streams is full"
        return seq

    def stream_busy(self, dev: int, stream: int) -> bool:
        return bool(self.lib.fakecuda_stream_busy(dev, stream))

    def complete(self, dev: int | None = None, stream: int | None = None, upto: int = -1) -> int:
        """Complete the recorded events and the queued work (of one device, one stream, up to
        a record); returns how many events it completed."""
        return self.lib.fakecuda_complete(
            -1 if dev is None else dev, stream is None, stream or 0, upto
        )


@pytest.fixture(scope="session")
def fakecuda_lib() -> Path:
    return build()


def _hooks_left() -> bool:
    from memlord import _core

    left = _core._hooks_info()["installed"]
    if left:
        for obj in gc.get_objects():
            if type(obj).__name__ == "TorchHooks" and obj.enabled:
                obj.disable()
    return left


@pytest.fixture
def fakecuda(fakecuda_lib, monkeypatch):
    """memlord on the fake driver, fresh: loaded at its first use, the fake reset."""
    from memlord import _core

    assert not _core._hooks_info()["installed"], "a previous test left hooks installed"
    monkeypatch.delenv("MEMLORD_DISABLE_CUDA", raising=False)
    monkeypatch.setenv("MEMLORD_CUDA_DRIVER", str(fakecuda_lib))  # for subprocesses
    drv = FakeCuda(fakecuda_lib)
    _core._testing.cuda_driver(str(fakecuda_lib))
    drv.reset()
    # every poll asks the driver, whatever the oldest entry's age: the tests count the
    # calls of each poll (the age rule has tests of its own)
    age = _core._testing.pending_poll_age(0)
    try:
        yield drv
        left = _hooks_left()
        assert not left, "the test left hooks installed"
        assert _core._hooks_info()["pending"] == 0
        assert drv.ctx_depth() == 0, "contexts pushed and not popped"
        assert drv.misuse() == 0, "memlord broke a driver rule"
    finally:
        _hooks_left()
        drv.heal()
        drv.complete()
        _core._testing.cuda_driver(None)
        _core._testing.pending_poll_age(age)


class _Streams:
    """torch.cuda's stream and event API, stood in for on the fake's events."""

    def __init__(self, drv: FakeCuda):
        self.drv = drv
        self.next_handle = 0x5000
        self.current = {}  # device index -> Stream
        self.device = 0
        # Each device's default stream is a handle of its own (0x100, 0x200, ...): for
        # memlord a stream like any side stream, which gets an event per deferred move.
        # legacy_default() makes it 0, torch's legacy default stream, as on a GPU.
        self.default_handle = None

    def legacy_default(self) -> None:
        """Every device's default stream is the legacy one (handle 0), as torch's is."""
        self.default_handle = 0
        self.current.clear()

    def copied(self, index: int) -> None:
        """A copy off device `index` was queued on its current stream (conftest's CudaLike)."""
        self.drv.enqueue(index, self.source(index))

    def handle(self) -> int:
        self.next_handle += 0x10
        return self.next_handle

    def current_stream(self, device=None):
        index = self.device if device is None else torch.device("cuda", device).index
        index = self.device if index is None else index
        if index not in self.current:
            self.current[index] = self.Stream(device=index, _default=True)
        return self.current[index]

    def source(self, index: int) -> int:
        """What memlord calls: the current stream of device `index`, as an int."""
        return self.current_stream(index).cuda_stream


def make_standins(drv: FakeCuda):
    streams = _Streams(drv)

    class Stream:
        def __init__(self, device=None, priority=0, _default=False):
            index = streams.device if device is None else torch.device("cuda", device).index
            self.device_index = streams.device if index is None else index
            if not _default:
                self.cuda_stream = streams.handle()
            elif streams.default_handle is not None:
                self.cuda_stream = streams.default_handle
            else:
                self.cuda_stream = 0x100 * (self.device_index + 1)

        def synchronize(self):
            drv.complete(self.device_index, self.cuda_stream)

        def wait_stream(self, other):
            pass

        def query(self):
            return True

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            self.stream = None
            self.seq = 0

        def record(self, stream=None):
            self.stream = stream or streams.current_stream()
            self.seq = drv.record_seq()

        def synchronize(self):
            if self.stream is not None:
                drv.complete(self.stream.device_index, self.stream.cuda_stream, self.seq)

        def query(self):
            return True

    def synchronize(device=None):
        index = streams.device if device is None else torch.device("cuda", device).index
        drv.complete(streams.device if index is None else index)

    class stream:  # noqa: N801 (torch.cuda.stream)
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            self.prev = streams.current_stream(self.s.device_index)
            streams.current[self.s.device_index] = self.s

        def __exit__(self, *exc):
            streams.current[self.s.device_index] = self.prev

    streams.Stream = Stream
    return streams, {
        "Stream": Stream,
        "Event": Event,
        "synchronize": synchronize,
        "current_stream": streams.current_stream,
        "stream": stream,
    }


@contextlib.contextmanager
def standins(drv: FakeCuda):
    """torch.cuda's synchronize, Stream, Event, current_stream and stream() stood in for on
    the fake driver, memlord told to read its current stream from them, and conftest's
    fake-cuda tensors reporting their work to the fake's streams; all undone after (the
    torch hooks must be off by then).  Yields the streams."""
    import conftest

    from memlord import _core

    streams, names = make_standins(drv)
    saved = {name: getattr(torch.cuda, name) for name in names}
    for name, value in names.items():
        setattr(torch.cuda, name, value)
    _core._testing.cuda_standin(streams.source)
    conftest.COPY_OBSERVERS.append(streams.copied)
    try:
        yield streams
    finally:
        conftest.COPY_OBSERVERS.remove(streams.copied)
        _core._testing.cuda_standin(None)
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@pytest.fixture
def fake_torch_cuda(fakecuda):
    """torch.cuda's stand-ins on the fake driver (standins()); memlord's torch hooks take the
    stream source at install."""
    with standins(fakecuda) as streams:
        try:
            yield streams
        finally:
            _hooks_left()


def run_fresh(lib: Path | str, body: str, env: dict | None = None, timeout: int = 120):
    """Run `body` in a fresh interpreter where MEMLORD_CUDA_DRIVER names `lib` and `fake` is
    a FakeCuda on it, loaded before memlord touches the driver; returns the CompletedProcess.

    The process is a child of the warm interpreter (tests/support/warm.py): memlord and
    torch are imported, which loads no CUDA driver (memlord loads it at its first use, the
    contract these runs test), and nothing has run yet. MEMLORD_CUDA_DRIVER is read when
    the driver is loaded, from the child's environment: every path shares one zygote."""
    here = Path(__file__).resolve().parent
    prelude = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(here)!r})
        from fakecuda_driver import FakeCuda
        fake = FakeCuda({str(lib)!r})
        """
    )
    full_env = {**os.environ, "MEMLORD_CUDA_DRIVER": str(lib)}
    full_env.pop("MEMLORD_DISABLE_CUDA", None)
    full_env.update(env or {})
    for k in [k for k, v in full_env.items() if v is None]:
        del full_env[k]
    return warm.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def stat(lord, dev: str, key: str) -> int:
    """One counter of one device of a lord, 0 where the device was never seen."""
    return lord.stats().get(dev, {}).get(key, 0)


@pytest.fixture
def fake_torch_hooks(lord, fake_torch_cuda):
    """The conftest lord's torch hooks over the fake driver and torch.cuda stand-ins."""
    h = lord.hook_into_torch()
    yield h
    h.disable()
