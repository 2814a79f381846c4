"""``python -m memlord top``: every publishing process of this user on the host, live.

One table per refresh: a row per publisher (pid, name, rank, and per device its live,
peak and reserved bytes and its innermost region), sorted by live bytes; then per device
what the system says (the driver's used and total for CUDA, through NVML, which needs no
CUDA context; ``MemTotal`` and ``MemAvailable`` for cpu) and the bytes no publisher
accounts for (other processes, CUDA contexts, memory outside torch).
"""

from __future__ import annotations

import ctypes
import json
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from . import _publish
from ._bytes import human_bytes


def _meminfo() -> tuple[int, int] | None:
    """(total, used) of the host's memory from /proc/meminfo, or None."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return None
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return values["MemTotal"], values["MemTotal"] - values["MemAvailable"]


class _NVML:
    """The driver's view of each GPU through NVML (libnvidia-ml), loaded on first use;
    unlike the CUDA driver API it makes no context in the reading process."""

    class _Memory(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]
        if TYPE_CHECKING:  # what ctypes makes of _fields_
            total: int
            free: int
            used: int

    def __init__(self) -> None:
        self.lib: Any = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() == 0:
                self.lib = lib
        except (OSError, AttributeError):
            self.lib = None

    def memory(self, index: int) -> tuple[int, int] | None:
        """(total, used) of GPU index, or None."""
        if self.lib is None:
            return None
        handle = ctypes.c_void_p()
        mem = self._Memory()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        if self.lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.total), int(mem.used)


_nvml: _NVML | None = None


def _system(device: str) -> tuple[int, int] | None:
    global _nvml
    if device == "cpu":
        return _meminfo()
    if device.startswith("cuda"):
        if _nvml is None:
            _nvml = _NVML()
        index = int(device.split(":")[1]) if ":" in device else 0
        return _nvml.memory(index)
    return None


def collect(directory: Any = None) -> dict[str, Any]:
    """One reading: ``{"time", "host", "directory", "publishers": [...], "devices": {...}}``
    (the ``--json`` document)."""
    d = directory if directory is not None else _publish.runtime_dir(create=False)
    recs = _publish.read_all(d)
    recs.sort(key=lambda r: -sum(x["live"] for x in r["devices"]))
    devices: dict[str, dict[str, Any]] = {}
    for r in recs:
        for x in r["devices"]:
            e = devices.setdefault(x["device"], {"live": 0, "reserved": 0, "publishers": 0})
            e["live"] += x["live"]
            e["reserved"] += x["reserved"] if x["reserved"] is not None else x["live"]
            e["publishers"] += 1
    if "cpu" not in devices:
        devices["cpu"] = {"live": 0, "reserved": 0, "publishers": 0}
    for name, e in devices.items():
        sysinfo = _system(name)
        e["total"], e["used"] = sysinfo if sysinfo else (None, None)
        e["unaccounted"] = None if e["used"] is None else max(0, e["used"] - e["reserved"])
    return {
        "schema": "memlord.top/1",
        "time": time.time(),
        "host": socket.gethostname(),
        "directory": str(d),
        "publishers": recs,
        "devices": devices,
    }


def render(doc: dict[str, Any]) -> str:
    """The table of one reading."""
    lines = [
        f"memlord top  {time.strftime('%H:%M:%S', time.localtime(doc['time']))}  "
        f"{doc['host']}  {len(doc['publishers'])} publishing"
    ]
    if not doc["publishers"]:
        lines.append(
            f"no process publishes (lord.publish(), MEMLORD_PUBLISH=1) in {doc['directory']}"
        )
    else:
        lines.append(
            f"{'PID':>8}  {'RANK':>4}  {'DEVICE':<8} {'LIVE':>10} {'PEAK':>10} "
            f"{'RESERVED':>10}  NAME [REGION]"
        )
        for r in doc["publishers"]:
            rank = "" if r["rank"] is None else str(r["rank"])
            devs = r["devices"] or [{"device": "-", "live": 0, "peak": 0, "reserved": None}]
            for i, x in enumerate(devs):
                res = "-" if x["reserved"] is None else human_bytes(x["reserved"])
                label = (
                    (r["region"] or "")
                    if i
                    else f"{r['name']}" + (f"  [{r['region']}]" if r["region"] else "")
                )
                lines.append(
                    f"{r['pid'] if i == 0 else '':>8}  {rank if i == 0 else '':>4}  "
                    f"{x['device']:<8} {human_bytes(x['live']):>10} {human_bytes(x['peak']):>10} "
                    f"{res:>10}  {label}"
                )
    lines.append("")
    lines.append(f"{'DEVICE':<8} {'USED':>10} {'TOTAL':>10} {'PUBLISHED':>10} {'UNACCOUNTED':>12}")
    for name, e in sorted(doc["devices"].items()):
        used = "?" if e["used"] is None else human_bytes(e["used"])
        total = "?" if e["total"] is None else human_bytes(e["total"])
        other = "?" if e["unaccounted"] is None else human_bytes(e["unaccounted"])
        lines.append(
            f"{name:<8} {used:>10} {total:>10} {human_bytes(e['reserved']):>10} {other:>12}"
        )
    return "\n".join(lines)


def main(interval: float = 1.0, once: bool = False, as_json: bool = False) -> int:
    """The command: one reading with ``once`` or ``as_json``, else one per ``interval``
    seconds until interrupted (the screen is cleared between readings on a terminal)."""
    tty = sys.stdout.isatty()
    try:
        while True:
            doc = collect()
            if as_json:
                sys.stdout.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
                return 0
            text = render(doc)
            if tty and not once:
                sys.stdout.write("\x1b[H\x1b[2J")
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            if once:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    except PermissionError as e:
        sys.stderr.write(f"memlord top: {e}\n")
        return 2
