"""Imported at start-up by every Python process of a sanitized run (tools/asan_run.py
puts this directory on PYTHONPATH).

gcc's libubsan keeps its own copy of the sanitizer runtime's report settings and,
loaded beside libasan, never reads log_path from UBSAN_OPTIONS: its reports would
go to file descriptor 2, which pytest captures and loses when the process aborts.
Point its report path at the run's log directory through its own API.
"""

import os


def _send_ubsan_reports_to_log() -> None:
    prefix = os.environ.get("MEMLORD_UBSAN_LOG_PATH")
    libs = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "libubsan" in p]
    if not prefix or not libs:
        return
    import ctypes

    ctypes.CDLL(libs[0]).__sanitizer_set_report_path(prefix.encode())


_send_ubsan_reports_to_log()
