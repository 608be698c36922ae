"""ocrq_cli.embedded.gpus and `ocrq up --gpus`: which GPUs, one worker per GPU with its own CUDA_VISIBLE_DEVICES,
node name and metrics port, checked without a GPU (a fake pynvml of two devices, named as such)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ocrq.settings import Settings
from ocrq_cli.embedded.gpus import (
    Gpu,
    embedded_worker,
    list_gpus,
    mps_running,
    plan_gpu_workers,
    select_gpus,
    sharing_note,
)
from ocrq_cli.main import app
from tests.fakes.fake_nvml import FakePynvmlModule

GiB = 2**30
UUID0 = "GPU-5f3b2c1a-0000-4e7a-9d1e-aaaaaaaaaaaa"
UUID1 = "GPU-5f3b2c1a-1111-4e7a-9d1e-bbbbbbbbbbbb"
TWO = [Gpu(0, UUID0, "NVIDIA H200", 141 * GiB), Gpu(1, UUID1, "NVIDIA H200", 141 * GiB)]


def _fake_two() -> FakePynvmlModule:
    return FakePynvmlModule([(UUID0, 141 * GiB, 1 * GiB), (UUID1, 141 * GiB, 2 * GiB)])


def test_list_gpus_reads_nvml_in_its_order() -> None:
    fake = _fake_two()
    assert list_gpus(fake) == TWO
    assert fake.calls == ["init", "shutdown"]


def test_list_gpus_without_driver_or_library_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list_gpus(FakePynvmlModule([], fail_init=True)) == []
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    assert list_gpus() == []


@pytest.mark.parametrize(
    ("spec", "indices"),
    [("all", [0, 1]), ("ALL", [0, 1]), ("0,1", [0, 1]), ("1", [1]), ("1, 0", [1, 0]),
     (UUID1, [1]), ("GPU-5f3b2c1a-0000", [0])],
)
def test_select_gpus(spec: str, indices: list[int]) -> None:
    assert [g.index for g in select_gpus(spec, TWO)] == indices


@pytest.mark.parametrize(
    ("spec", "gpus", "message"),
    [
        ("all", [], "no GPU found"),
        ("0,1", [], "no GPU found"),
        ("0,2", TWO, "2 is not a GPU of this host; this host has 0 (NVIDIA H200), 1 (NVIDIA H200)"),
        ("GPU-5f3b2c1a", TWO, "matches several GPUs"),
        ("GPU-ffff", TWO, "is not a GPU of this host"),
        ("0,0", TWO, "GPU 0 listed twice"),
        ("0,", TWO, "empty entry"),
    ],
)
def test_select_gpus_refuses_with_what_the_host_has(spec: str, gpus: list[Gpu], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        select_gpus(spec, gpus)


def test_plan_one_worker_per_gpu() -> None:
    settings = Settings(engine={"kind": "vllm"})
    plans = plan_gpu_workers(settings, TWO, "h1")
    assert [p.service for p in plans] == ["worker-gpu0", "worker-gpu1"]
    assert [p.node for p in plans] == ["gpu0@h1", "gpu1@h1"]
    assert [p.env for p in plans] == [
        {"CUDA_VISIBLE_DEVICES": UUID0, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "OCRQ_METRICS_PORT": "9809"},
        {"CUDA_VISIBLE_DEVICES": UUID1, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "OCRQ_METRICS_PORT": "9810"},
    ]
    # a GPU keeps its port when it runs alone; metrics off stays off for every worker
    assert plan_gpu_workers(settings, TWO[1:], "h1")[0].metrics_port == 9810
    off = plan_gpu_workers(Settings(engine={"kind": "vllm"}, metrics_port=0), TWO, "h1")
    assert [p.env["OCRQ_METRICS_PORT"] for p in off] == ["0", "0"]
    assert embedded_worker(settings, "h1").node == "embedded@h1"


def test_plan_two_engines_per_gpu_share_each_budget_and_start_one_after_another() -> None:
    settings = Settings(engine={"kind": "vllm", "engines_per_gpu": 2, "gpu_memory_utilization": 0.85},
                        batch={"memory_cap_bytes": 24 * GiB + 1})
    plans = plan_gpu_workers(settings, TWO, "h1")
    # every GPU's first engine first (they start at once), then the second ones
    assert [p.node for p in plans] == ["gpu0@h1", "gpu1@h1", "gpu0.1@h1", "gpu1.1@h1"]
    assert [p.service for p in plans] == ["worker-gpu0", "worker-gpu1", "worker-gpu0.1", "worker-gpu1.1"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == [UUID0, UUID1, UUID0, UUID1]
    # a second engine waits for its own GPU's first one (which sizes its KV cache from free memory)
    assert [p.after.node if p.after else None for p in plans] == [None, None, "gpu0@h1", "gpu1@h1"]
    # each gets half, never more: the halves add up to at most the whole
    for p in plans:
        assert p.env["OCRQ_ENGINE__GPU_MEMORY_UTILIZATION"] == "0.425"
        assert p.env["OCRQ_BATCH__MEMORY_CAP_BYTES"] == str(12 * GiB)
        assert "OCRQ_ENGINE__MEMORY_CAP_BYTES" not in p.env
    # ports stay distinct and stable per GPU: GPU 1's pair is the same alone
    assert [p.metrics_port for p in plans] == [9809, 9811, 9810, 9812]
    assert [p.metrics_port for p in plan_gpu_workers(settings, TWO[1:], "h1")] == [9811, 9812]
    three = Settings(engine={"kind": "vllm", "engines_per_gpu": 3, "gpu_memory_utilization": 0.9,
                             "memory_cap_bytes": 10})
    env = plan_gpu_workers(three, TWO[:1], "h1")[2].env
    assert env["OCRQ_ENGINE__GPU_MEMORY_UTILIZATION"] == "0.3" and env["OCRQ_ENGINE__MEMORY_CAP_BYTES"] == "3"


@pytest.mark.parametrize("kind", ["transformers", "simulated"])
def test_plan_shares_a_gpu_only_with_vllm(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    # engines_per_gpu is vLLM's setting: for another engine a deprecation note, and a GPU each
    with caplog.at_level(logging.WARNING, logger="ocrq.settings"):
        settings = Settings(engine={"kind": kind, "engines_per_gpu": 2})
    assert f"deprecated: engine.engines_per_gpu is not read by the {kind} engine" in caplog.text
    assert [p.node for p in plan_gpu_workers(settings, TWO, "h1")] == ["gpu0@h1", "gpu1@h1"]


@pytest.mark.parametrize("kind", ["rapidocr", "vllm-server"])
def test_plan_refuses_engines_without_a_local_gpu(kind: str) -> None:
    with pytest.raises(ValueError, match=f"engine.kind is {kind}"):
        plan_gpu_workers(Settings(engine={"kind": kind}), TWO, "h1")


# --- the command line -------------------------------------------------------------------------

@pytest.fixture()
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Settings that would start a stack under tmp_path on a port nothing listens on."""
    monkeypatch.delenv("OCRQ_CONFIG", raising=False)
    monkeypatch.setenv("OCRQ_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("OCRQ_REDIS__URL", "redis://127.0.0.1:9/0")
    return tmp_path / "var"


def test_up_gpus_all_without_a_gpu_exits_2_and_starts_nothing(cli_env: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakePynvmlModule([], fail_init=True))  # no driver
    result = CliRunner().invoke(app, ["up", "--gpus", "all"])
    assert result.exit_code == 2, result.output
    assert "no GPU found" in result.output
    assert not cli_env.exists()


def test_up_gpus_validates_against_nvml(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_two())
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "simulated")
    result = CliRunner().invoke(app, ["up", "--gpus", "0,2"])
    assert result.exit_code == 2, result.output
    assert "2 is not a GPU of this host" in " ".join(result.output.split())
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "rapidocr")
    result = CliRunner().invoke(app, ["up", "--gpus", "0,1"])
    assert result.exit_code == 2 and "does not run on a local GPU" in " ".join(result.output.split())
    assert not cli_env.exists()


def _up_gpus_all(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    """`ocrq up --gpus all` against a fake stack that starts no processes; what it was handed."""
    seen: list[Any] = []

    def fake_up(self: Any, wait: float = 0, workers: Any = None, ha: bool = False) -> dict[str, str]:
        seen.extend(workers or [])
        return {}

    monkeypatch.setattr("ocrq_cli.embedded.stack.Stack.up", fake_up)
    return CliRunner().invoke(app, ["up", "--gpus", "all"]), seen


def test_up_gpus_hands_the_stack_one_worker_per_gpu(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_two())
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "simulated")
    result, workers = _up_gpus_all(monkeypatch)
    assert result.exit_code == 0, result.output
    assert [(w.node.split("@")[0], w.env["CUDA_VISIBLE_DEVICES"], w.metrics_port) for w in workers] == [
        ("gpu0", UUID0, 9809), ("gpu1", UUID1, 9810)]


def test_sharing_a_gpu_without_mps_is_warned_and_with_it_not(tmp_path: Path) -> None:
    two = Settings(engine={"kind": "vllm", "engines_per_gpu": 2})
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_running(env)
    note = sharing_note(two, env)
    assert note is not None and "take turns" in note and str(tmp_path / "control") in note
    (tmp_path / "control").touch()  # the daemon's control pipe (a FIFO there; its presence is the test)
    assert mps_running(env) and sharing_note(two, env) is None
    assert sharing_note(Settings(engine={"kind": "vllm"}), {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "x")}) is None


def test_up_gpus_warns_when_engines_share_a_gpu_without_mps(cli_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_two())
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "vllm")
    monkeypatch.setenv("OCRQ_ENGINE__ENGINES_PER_GPU", "2")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps"))
    result, workers = _up_gpus_all(monkeypatch)
    assert result.exit_code == 0, result.output
    assert "no MPS daemon answers" in " ".join(result.output.split())
    assert [w.node.split("@")[0] for w in workers] == ["gpu0", "gpu1", "gpu0.1", "gpu1.1"]
