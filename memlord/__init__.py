"""memlord: an exact, cheap per-device ledger of PyTorch memory.

Usage::

    from memlord import MemLord
    lord = MemLord(auto_gc_bytes="auto")
    lord.allocate(model)
    lord.free(model)
    print(lord.allocated("cuda:0"))
"""

from __future__ import annotations

import os as _os

import numpy as _numpy  # noqa: F401  (the C core uses the NumPy C API)
import torch as _torch

from ._nocore import old_torch_error as _old_torch_error

if (_old_torch := _old_torch_error(_torch)) is not None:
    raise _old_torch  # say which torch was found, and what to install

try:
    from . import _core
except ImportError:
    from ._nocore import missing_core_error

    _missing = missing_core_error()  # None: a _core is there but failed to load
    if _missing is None:
        raise
    raise _missing from None  # no built extension here: say exactly what to run
from . import _backend, _log, _sites
from ._core import CATEGORIES, Hooks, PythonHooks, TorchHooks, format_bytes
from ._events import EVENT_DTYPE, EVENT_KINDS, EVENT_SOURCES
from ._lifetimes import LifetimeAnalyzer, ReusePlan
from ._memapi import MemoryProfile
from ._oom import OOMWatch, oom_retry, retry_on_oom
from ._publish import Publisher
from ._regions import ModuleTracker, Region
from ._sizing import MemoryFit, find_batch_size, fit_memory
from ._snapshot import LeakCheck
from ._types import (
    AutoGCBand,
    AutoGCMetric,
    AutoGCStrategy,
    AutoGCThreshold,
    CapacitySource,
    DeviceStats,
)
from .lord import MemLord

__all__ = [
    "AutoGCBand",
    "AutoGCMetric",
    "AutoGCStrategy",
    "AutoGCThreshold",
    "CATEGORIES",
    "CapacitySource",
    "DeviceStats",
    "EVENT_DTYPE",
    "EVENT_KINDS",
    "EVENT_SOURCES",
    "Hooks",
    "LeakCheck",
    "LifetimeAnalyzer",
    "MemLord",
    "MemoryFit",
    "MemoryProfile",
    "ModuleTracker",
    "OOMWatch",
    "PythonHooks",
    "Publisher",
    "Region",
    "ReusePlan",
    "TorchHooks",
    "find_batch_size",
    "fit_memory",
    "format_bytes",
    "oom_retry",
    "retry_on_oom",
    "__version__",
]
__version__ = "0.1.0"

if _core.Lord()._events_info()[3] != EVENT_DTYPE.itemsize:  # pragma: no cover
    raise ImportError("memlord: the C event record does not match EVENT_DTYPE; rebuild memlord")

#: the wiring of the C core to Python (tests reconfigure it and put this back)
_CONFIGURE = dict(
    release_cache=_backend.release_cache,
    torch_prefix=_os.path.dirname(_os.path.abspath(_torch.__file__)) + _os.sep,
    memlord_prefix=_os.path.dirname(_os.path.abspath(__file__)) + _os.sep,
    logger=_log.logger,
    debug_env=_log._debug_env_changed,
    log_event=_log._event,
    log_gc=_log._auto_gc,
    module_grads=_backend.module_grads,
)
_core._configure(**_CONFIGURE)
_core._set_library_paths(*_sites.library_paths())
