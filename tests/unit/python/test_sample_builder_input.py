"""SampleBuilder.add() checks what it is given as the rest of the API does: a device that
torch cannot name (``torch.device`` is the reference) or a value of the wrong kind is a
ValueError/TypeError naming the argument, and the builder keeps the samples it had; what
it accepts builds, exports and loads back."""

from __future__ import annotations

import pytest
import torch

from memlord.report import Profile, SampleBuilder, export, load


def _torch_refuses(device):
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        return True
    return False


@pytest.mark.parametrize("device", ["nodev", "cuda:x", "CPU", "", "cpu:", "cuda:-1", "cuda:0:1"])
def test_a_device_torch_cannot_name_is_a_value_error_and_changes_nothing(device):
    assert _torch_refuses(device)
    b = SampleBuilder()
    b.add(1, "cpu", 10)
    with pytest.raises(ValueError, match=r"add\(\): argument 'device'"):
        b.add(2, device, 20)
    assert len(b) == 1
    assert b.build().devices == ["cpu"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"device": 0}, "device"),
        ({"device": None}, "device"),
        ({"t_ns": 1.5}, "t_ns"),
        ({"t_ns": True}, "t_ns"),
        ({"allocated": "10"}, "allocated"),
        ({"pending": None}, "pending"),
        ({"reserved": 2.0}, "reserved"),
    ],
)
def test_a_value_of_the_wrong_kind_is_a_type_error_naming_it(kwargs, name):
    b = SampleBuilder()
    args = {"t_ns": 1, "device": "cpu", "allocated": 10, **kwargs}
    with pytest.raises(TypeError, match=rf"add\(\): argument '{name}'"):
        b.add(**args)
    assert len(b) == 0


def test_an_integer_out_of_the_files_range_is_a_value_error():
    b = SampleBuilder()
    with pytest.raises(ValueError, match=r"argument 'allocated'"):
        b.add(1, "cpu", 2**63)
    assert len(b) == 0


def test_devices_torch_names_are_kept_and_load_back(tmp_path):
    b = SampleBuilder()
    b.add(1, "cpu", 10)
    b.add(2, torch.device("meta"), 20)
    b.add(3, "cuda:1", 30, pending=1, reserved=64)
    profile = Profile(samples=b.build())
    assert profile.samples.devices == ["cpu", "meta", "cuda:1"]
    export(profile, tmp_path / "p.json")
    back = load(tmp_path / "p.json")
    assert back.samples.devices == ["cpu", "meta", "cuda:1"]
    assert back.samples["allocated"].tolist() == [10, 20, 30]
