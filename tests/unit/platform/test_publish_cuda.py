"""Publishing on a real GPU (issue 31): the record shows the CUDA device's live bytes (the
ledger's) and reserved bytes (torch's ``memory_reserved``), and ``memlord top`` reads the
device's used and total through NVML, checked against ``torch.cuda.mem_get_info``.

Marked ``cuda``; skips itself without a GPU (tools/gpu_check.sh runs it alone too).
"""

from __future__ import annotations

import pytest
import torch

from memlord import MemLord, _publish, _top

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_record_and_top_on_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMLORD_RUNTIME_DIR", str(tmp_path / "rt"))
    lord = MemLord(auto_gc_bytes=None)
    with lord.hook_into_python(), lord.publish("gpu") as pub:
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        pub._heartbeat()
        (rec,) = _publish.read_all()
        (dev,) = [d for d in rec["devices"] if d["device"].startswith("cuda")]
        assert dev["live"] == lord.stats()[dev["device"]]["allocated"] >= x.nbytes
        assert dev["reserved"] == torch.cuda.memory_reserved(x.device)
        doc = _top.collect()
        gpu = doc["devices"][dev["device"]]
        free, total = torch.cuda.mem_get_info(x.device)
        # NVML's total is the card's; CUDA's leaves out what the driver keeps for itself
        # (480 MiB of an H100's 80 GiB)
        assert total <= gpu["total"] <= total * 1.02, (gpu["total"], total)
        # NVML's used against torch's own NVML reading (other processes move)
        assert abs(gpu["used"] - torch.cuda.device_memory_used(x.device)) <= 64 << 20
        assert gpu["used"] >= total - free - (64 << 20)
        assert gpu["unaccounted"] is not None
        del x
