"""memlord's pytest plugin: the measuring half (imports torch and the C core).

pytest loads the light half, the top-level module ``pytest_memlord`` (the ``pytest11``
entry point ``memlord``): options, markers, sizes, reports.  Importing anything under
``memlord`` imports torch and the C core (``memlord/__init__.py`` does), so the light half
imports this module only when a test is measured: ``--memlord`` on, a memory marker on
the test, or the ``memlord`` fixture asked for.  Without them a pytest run with memlord
installed imports neither torch nor memlord.  See docs/pytest.md.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from . import MemLord, PythonHooks, TorchHooks

#: Events kept per measured test with a ``limit_memory`` marker, to find the sites alive at
#: the peak (64 bytes each).  A test with more events than this gets the sites that
#: allocated the most instead (``sites_at_peak`` says which).
EVENT_RING = 16384


def hook_python(lord: MemLord) -> PythonHooks:
    """Lifetime tracking for a test: factories, conversions, explicit allocate(), the
    category sources, and every operator's output (``ops=True``)."""
    return lord.hook_into_python(ops=True)


def fixture_lord() -> tuple[MemLord, list[Any]]:
    """The ``memlord`` fixture's lord, both hooks on; the handles to disable after."""
    lord = MemLord()
    handles: list[Any] = []
    try:
        handles.append(lord.hook_into_torch())
        handles.append(hook_python(lord))
    except BaseException:
        close_handles(handles)
        raise
    return lord, handles


def close_handles(handles: list[Any]) -> None:
    """Disables hooks, the last enabled first; every one even when one fails."""
    error: BaseException | None = None
    for h in reversed(handles):
        try:
            h.disable()
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the others)
            error = error or e
    handles.clear()
    if error is not None:
        raise error


def cuda_allocated() -> dict[str, int] | None:
    """``torch.cuda.memory_allocated`` per CUDA device, None without CUDA."""
    if not torch.cuda.is_available():
        return None
    out = {}
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)
        out[f"cuda:{i}"] = int(torch.cuda.memory_allocated(i))
    return out


def cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def collect() -> None:
    gc.collect()


class Measurement:
    """One test call measured: a lord with both hooks, a region around the call on the
    test's thread, and (when asked) a leak check and an event ring for the sites at the
    peak.  ``start()`` before the call, ``stop()`` after it, whatever happened."""

    def __init__(self, name: str, *, leaks: bool, sites_at_peak: bool) -> None:
        self.name = name
        self.want_leaks = leaks
        self.want_sites = sites_at_peak
        self.lord: MemLord | None = None
        self._handles: list[TorchHooks | PythonHooks] = []
        self._region: Any = None
        self._leak_check: Any = None
        self.peak: dict[str, int] = {}
        # per device: the categories of the test's peak (non-zero ones; they add up to it)
        self.categories: dict[str, dict[str, int]] = {}
        self.top_site: dict[str, str | None] = {}
        self.sites: dict[str, list[tuple[str | None, int]]] = {}
        self.sites_exact = False
        self.leaked: list[dict[str, Any]] | None = None

    def start(self) -> None:
        lord = self.lord = MemLord(auto_gc_bytes=None)
        try:
            self._handles.append(lord.hook_into_torch())
            self._handles.append(hook_python(lord))
            if self.want_sites:
                lord.record_events(EVENT_RING)
            if self.want_leaks:
                self._leak_check = lord.leak_check(collect=True)
                self._leak_check.__enter__()
            self._region = lord.region(self.name)
            self._region.__enter__()
        except BaseException:
            close_handles(self._handles)
            raise

    def stop(self) -> None:
        lord = self.lord
        assert lord is not None
        try:
            if self._region is not None:
                self._region.__exit__(None, None, None)
                for dev, st in self._region.stats.items():
                    if st["peak_delta"] > 0:
                        self.peak[dev] = int(st["peak_delta"])
                        # the region's own split of that peak: what the test made, never
                        # what it found alive (a fixture's model, counted from then on)
                        at_peak = {
                            k: int(v["at_peak"]) for k, v in st.get("categories", {}).items()
                        }
                        self.categories[dev] = {k: v for k, v in at_peak.items() if v}
            if self._leak_check is not None:
                self._leak_check.__exit__(None, None, None)
                self.leaked = list(self._leak_check.leaked)
            for dev in self.peak:
                top = lord.top_alloc_site(dev)
                self.top_site[dev] = top[1] if top else None
            if self.want_sites:
                self._sites_at_peak(lord)
        finally:
            try:
                close_handles(self._handles)
            finally:
                if self.want_sites:
                    lord.record_events(0)

    def _sites_at_peak(self, lord: MemLord) -> None:
        """The live tracked bytes per site at the moment of each device's peak, replayed
        from the event ring (the test's thread, this lord's events only)."""
        import threading

        if lord.events_dropped:
            self._sites_by_total(lord)
            return
        ev = lord.events()
        me = threading.get_ident()
        for dev in self.peak:
            live: dict[int, tuple[int, int]] = {}  # address -> (site code, bytes)
            by_site: dict[int, int] = {}
            total = best = 0
            best_sites: dict[int, int] = {}
            for rec in ev:
                if int(rec["thread"]) != me or lord.event_device(int(rec["device"])) != dev:
                    continue
                kind, nbytes, addr = int(rec["kind"]), int(rec["bytes"]), int(rec["address"])
                if kind == 0:
                    total += nbytes
                    site = int(rec["site"])
                    by_site[site] = by_site.get(site, 0) + nbytes
                    if addr:
                        live[addr] = (site, nbytes)
                elif kind == 1:
                    total -= nbytes
                    site, _ = live.pop(addr, (int(rec["site"]), nbytes))
                    by_site[site] = by_site.get(site, 0) - nbytes
                else:
                    continue
                if total > best:
                    best = total
                    best_sites = dict(by_site)
            ranked = sorted(((b, s) for s, b in best_sites.items() if b > 0), reverse=True)
            self.sites[dev] = [(lord.event_site(s) if s else None, b) for b, s in ranked[:5]]
        self.sites_exact = True

    def _sites_by_total(self, lord: MemLord) -> None:
        for dev in self.peak:
            top = lord.top_alloc_site(dev)
            self.sites[dev] = [(top[1], int(top[2]))] if top else []
        self.sites_exact = False
