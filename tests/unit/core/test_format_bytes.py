"""memlord.format_bytes: binary units, at most two decimals, trailing zeros trimmed."""

import pytest

from memlord import format_bytes

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (KiB, "1 KiB"),
        (1025, "1 KiB"),  # 1.00098 -> two decimals -> "1.00" -> trimmed
        (1126, "1.1 KiB"),  # 1.0996 -> "1.10" -> "1.1"
        (1030, "1.01 KiB"),  # 1.00586
        (1536, "1.5 KiB"),
        (1535, "1.5 KiB"),  # 1.49902
        (KiB * 1000, "1000 KiB"),
        (1310720, "1.25 MiB"),
        (MiB - 1, "1 MiB"),  # 1023.999 KiB rounds to 1024 KiB, which is 1 MiB
        (MiB, "1 MiB"),
        (3 * MiB + MiB // 4, "3.25 MiB"),
        (GiB - 1, "1 GiB"),
        (GiB, "1 GiB"),
        (int(1.75 * GiB), "1.75 GiB"),
        (TiB - 1, "1 TiB"),
        (TiB, "1 TiB"),
        (1000 * TiB, "1000 TiB"),
    ],
)
def test_format_bytes_table(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "texts"),
    [(1024 * TiB, {"1024 TiB", "1 PiB"}), (2**63 - 1, {"8388608 TiB", "8 EiB"})],
)
def test_format_bytes_beyond_tib(n, texts):
    # The contract lists units up to TiB without saying whether larger ones exist.
    assert format_bytes(n) in texts


def test_format_bytes_matches_allocated_human_string(lord):
    import torch

    t = torch.empty(1310720, dtype=torch.uint8)
    lord.allocate(t)
    raw, human = lord.allocated()
    assert raw == 1310720
    assert human == "1.25 MiB" == format_bytes(raw)


@pytest.mark.parametrize("bad", [1.0, 1.5, "1", None, b"1", [1]])
def test_format_bytes_rejects_non_int(bad):
    with pytest.raises(TypeError):
        format_bytes(bad)


@pytest.mark.parametrize("bad", [-1, -(2**40)])
def test_format_bytes_rejects_negative(bad):
    with pytest.raises(ValueError):
        format_bytes(bad)
