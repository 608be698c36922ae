"""worker.nvml: device selection from CUDA_VISIBLE_DEVICES, and never raising without a GPU."""

from __future__ import annotations

import sys

import pytest

from tests.fakes.fake_nvml import FakePynvmlModule
from worker.nvml import DeviceMemory, NullProbe, NvmlProbe, visible_device

GiB = 2**30
DEVICES = [
    ("GPU-aaaa-1111", 80 * GiB, 10 * GiB),
    ("GPU-bbbb-2222", 141 * GiB, 40 * GiB),
]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "0"),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, "1"),
        ({"CUDA_VISIBLE_DEVICES": " 1 "}, "1"),
        ({"CUDA_VISIBLE_DEVICES": "GPU-bbbb,0"}, "GPU-bbbb"),
        ({"CUDA_VISIBLE_DEVICES": "MIG-5c1b-7a"}, "MIG-5c1b-7a"),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
    ],
)
def test_visible_device(env: dict[str, str], expected: str | None) -> None:
    assert visible_device(env) == expected


@pytest.mark.parametrize("device", ["1", "GPU-bbbb-2222", "GPU-bbbb"])
def test_reads_the_selected_device(device: str) -> None:
    probe = NvmlProbe(device, nvml=FakePynvmlModule(DEVICES))
    assert probe.read() == DeviceMemory(total=141 * GiB, free=101 * GiB, used=40 * GiB)


def test_a_failing_read_returns_none_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    probe = NvmlProbe("7", nvml=FakePynvmlModule(DEVICES))
    assert probe.read() is None and probe.read() is None
    assert sum("NVML read" in r.message for r in caplog.records) == 1


def test_for_current_device_without_gpus_is_a_null_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": ""}), NullProbe)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    probe = NvmlProbe.for_current_device({})
    assert isinstance(probe, NullProbe) and probe.read() is None


def test_for_current_device_without_a_driver_is_a_null_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePynvmlModule(DEVICES, fail_init=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert isinstance(NvmlProbe.for_current_device({}), NullProbe)


def test_for_current_device_reads_the_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePynvmlModule(DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    probe = NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": "GPU-aaaa-1111"})
    assert isinstance(probe, NvmlProbe)
    memory = probe.read()
    assert memory is not None and memory.total == 80 * GiB
    probe.close()
    assert fake.calls == ["init", "shutdown"]


def test_each_read_is_live_and_a_failed_read_recovers(caplog: pytest.LogCaptureFixture) -> None:
    # Given a probe on device 1 (opened once: the handle is kept, the memory is not cached)
    fake = FakePynvmlModule(list(DEVICES))
    probe = NvmlProbe("1", nvml=fake)
    assert probe.read() == DeviceMemory(total=141 * GiB, free=101 * GiB, used=40 * GiB)
    # When another process takes 60 GiB more, the next read sees it
    fake.devices[1] = ("GPU-bbbb-2222", 141 * GiB, 100 * GiB)
    assert probe.read() == DeviceMemory(total=141 * GiB, free=41 * GiB, used=100 * GiB)
    # When the driver fails two reads, those read as None (warned once), and the third works again
    fake.fail_reads = 2
    assert probe.read() is None and probe.read() is None
    assert probe.read() == DeviceMemory(total=141 * GiB, free=41 * GiB, used=100 * GiB)
    assert sum("NVML read" in r.message for r in caplog.records) == 1
    assert fake.calls == ["init"]  # initialised once, not per read
