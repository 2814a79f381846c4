"""reset() forgets the tracked storages before its event's sinks run.

A storage counted by Python that the reset's notify phase runs (a log handler of the
``[reset]`` record) is counted after the reset; its death must be credited, so the
ledger goes back to what torch holds (nothing) (repro r27)."""

from __future__ import annotations

import gc
import logging

import torch

from memlord import MemLord


class _MakeOnReset(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "[reset]" in record.getMessage():
            self.made.append(torch.ones(250))  # 1000 bytes, counted after the reset


def test_storage_counted_while_reset_logs_is_credited_when_it_dies(monkeypatch) -> None:
    # DEBUG=1 as well as the level: memlord reconciles the logger with the variable
    monkeypatch.setenv("DEBUG", "1")
    lord = MemLord()
    logger = logging.getLogger("memlord")
    handler = _MakeOnReset()
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        with lord.hook_into_python() as h:
            lord.reset()
            logger.removeHandler(handler)
            assert len(handler.made) == 1
            t = handler.made[0]
            # the outside reference: torch's own size of the storage the handler made
            assert lord.allocated()[0] == t.untyped_storage().nbytes() == 1000
            assert h.tracked == 1
            del t
            handler.made.clear()
            gc.collect()
            assert lord.allocated()[0] == 0
            assert h.tracked == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_storages_tracked_before_reset_are_forgotten() -> None:
    lord = MemLord()
    with lord.hook_into_python() as h:
        before = torch.ones(100)
        assert h.tracked == 1
        lord.reset()
        assert h.tracked == 0
        del before
        gc.collect()
        assert lord.allocated()[0] == 0
        assert lord.stats() == {}
