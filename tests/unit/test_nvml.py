"""worker.memory.nvml: device selection from CUDA_VISIBLE_DEVICES, and never raising without a GPU."""

from __future__ import annotations

import sys

import pytest

from tests.fakes.fake_nvml import FakePynvmlModule
from worker.memory.nvml import DeviceMemory, NullProbe, NvmlProbe, pin_pci_order, visible_device

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


# --- two identical GPUs on one host: each worker reads its own (ocrq up --gpus) ---------------

TWO_H200 = [
    ("GPU-5f3b2c1a-0000-4e7a-9d1e-aaaaaaaaaaaa", 141 * GiB, 10 * GiB),
    ("GPU-5f3b2c1a-1111-4e7a-9d1e-bbbbbbbbbbbb", 141 * GiB, 40 * GiB),
]
MIG_1G = ("MIG-9a1c7e2f-2222-5b3c-8f00-cccccccccccc", 18 * GiB, 3 * GiB)


@pytest.mark.parametrize(
    ("visible", "used_gib"),
    [
        ("0", 10),
        ("1", 40),
        ("1,0", 40),  # CUDA device 0 of this process is the first listed
        ("GPU-5f3b2c1a-0000-4e7a-9d1e-aaaaaaaaaaaa", 10),
        ("GPU-5f3b2c1a-1111-4e7a-9d1e-bbbbbbbbbbbb", 40),
        ("GPU-5f3b2c1a-1111", 40),  # a unique prefix, as CUDA accepts
        ("MIG-9a1c7e2f-2222-5b3c-8f00-cccccccccccc", 3),  # a MIG instance of GPU 1
        ("MIG-9a1c7e2f", 3),
    ],
)
def test_each_worker_reads_its_own_gpu_of_two(monkeypatch: pytest.MonkeyPatch, visible: str, used_gib: int) -> None:
    # Given a fake pynvml (FakePynvmlModule) with two identical H200s, GPU 1 holding a MIG instance
    fake = FakePynvmlModule(list(TWO_H200), mig={1: [MIG_1G]})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    # When a worker builds its probe as build_context does, under its CUDA_VISIBLE_DEVICES
    probe = NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    # Then it reads that GPU (same total: only the used bytes tell the two apart)
    assert isinstance(probe, NvmlProbe)
    memory = probe.read()
    assert memory is not None and memory.used == used_gib * GiB
    probe.close()


def test_two_workers_read_two_gpus_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakePynvmlModule(list(TWO_H200))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpu0 = NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": TWO_H200[0][0]})
    gpu1 = NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": TWO_H200[1][0]})
    fake.devices[1] = (TWO_H200[1][0], 141 * GiB, 90 * GiB)  # worker 1's batch grows
    m0, m1 = gpu0.read(), gpu1.read()
    assert m0 is not None and m1 is not None
    assert (m0.used, m1.used) == (10 * GiB, 90 * GiB)


def test_an_unknown_uuid_is_a_null_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvmlModule(list(TWO_H200)))
    assert isinstance(NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": "GPU-ffff"}), NullProbe)
    assert isinstance(NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": "2"}), NullProbe)


def test_an_index_under_another_device_order_is_warned(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvmlModule(list(TWO_H200)))
    NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    assert any("FASTEST_FIRST" in r.message for r in caplog.records)
    caplog.clear()
    NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": TWO_H200[1][0], "CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    NvmlProbe.for_current_device({"CUDA_VISIBLE_DEVICES": "1"})
    assert not any("CUDA_DEVICE_ORDER" in r.message for r in caplog.records)


def test_the_worker_pins_pci_order_unless_chosen() -> None:
    env: dict[str, str] = {}
    pin_pci_order(env)
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    chosen = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    pin_pci_order(chosen)
    assert chosen == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
