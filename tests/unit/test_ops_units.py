"""Unit tests (no services) for the ops surface: Flower's command line and generated password,
the chunk outcome Flower shows, `--since` parsing and the worker's metric names."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from ocrq.errors import BadImage, EngineOOM
from ocrq.jobs.failed import parse_since
from ocrq.messages import Item
from ocrq.results import ErrorInfo, ImageRecord, ImageStatus
from ocrq.settings import Settings
from ocrq_cli.embedded.stack import Stack, flower_argv
from worker.chunk.report import ChunkReport, failure
from worker.memory.nvml import NullProbe
from worker.metrics import WorkerMetrics


def test_flower_password_is_generated_once_private_and_reused(tmp_path: Path) -> None:
    stack = Stack(Settings(var_dir=tmp_path / "var"))
    auth, where = stack.flower_auth()
    user, _, password = auth.partition(":")
    assert user == "ops" and len(password) >= 20
    assert stat.S_IMODE(Path(where).stat().st_mode) == 0o600
    assert stack.flower_auth() == (auth, where)
    configured = Stack(Settings(var_dir=tmp_path / "var", flower_basic_auth="a:b")).flower_auth()
    assert configured == ("a:b", "OCRQ_FLOWER_BASIC_AUTH")


def test_flower_runs_the_ocrq_app_with_auth_and_bounded_memory() -> None:
    argv, env = flower_argv(Settings(flower_port=1234, flower_max_tasks=500), "ops:pw")
    assert argv[argv.index("-A") + 1] == "ocrq.broker.celery_app"
    assert {"--max_tasks=500", "--port=1234"} <= set(argv)
    # the password is not on the command line (`ps` shows it to every local user)
    assert env == {"FLOWER_BASIC_AUTH": "ops:pw"} and not any("ops:pw" in a for a in argv)
    with pytest.raises(ValueError):
        flower_argv(Settings(), "no-colon")


def test_chunk_outcome_names_failures() -> None:
    broken = failure(Item(id="a", ref="/x/broken.png"), BadImage("cannot decode"))
    report = ChunkReport(done=2, failed=1, failures=(broken,))
    summary = report.summary()
    assert summary["outcome"] == "FAILED 1/3: BadImage×1"
    assert summary["errors"] == [{"ref": "/x/broken.png", "type": "BadImage", "message": "cannot decode"}]
    assert ChunkReport(done=3).summary()["outcome"] == "ok 3/3"
    retry = ChunkReport(done=1, retry=(Item(id="b", ref="r"),)).summary()
    assert retry["outcome"] == "RETRY 1/2" and "errors" not in retry


def test_parse_since() -> None:
    assert parse_since("2h", now=10_000) == 10_000 - 7200
    assert parse_since("30m", now=10_000) == 10_000 - 1800
    assert parse_since("2026-01-01T00:00+00:00") == 1767225600
    with pytest.raises(ValueError):
        parse_since("soon")


def test_worker_metrics_names_and_labels() -> None:
    m = WorkerMetrics()
    m.watch(lambda: {"oom_events": 2, "budget_bytes": 100}, NullProbe(), "0", redis=None, queues=[])
    m.observe_batch(4, 0.5)
    m.observe_cache(1, 3)
    err = ErrorInfo(type="EngineOOM", message="", retryable=True)
    bad = ErrorInfo(type="BadImage", message="")
    m.observe_records("text", [
        ImageRecord(id="1", job="j", ref="r", status=ImageStatus.done),
        ImageRecord(id="2", job="j", ref="r", status=ImageStatus.done, cached=True),
        ImageRecord(id="3", job="j", ref="r", status=ImageStatus.failed, error=bad),
        ImageRecord(id="4", job="j", ref="r", status=ImageStatus.retrying, error=err),
    ], seconds=1.5)
    text = generate_latest(m.registry).decode()
    for line in ('ocrq_images_total{outcome="done",task="text"} 1.0',
                 'ocrq_images_total{outcome="cached",task="text"} 1.0',
                 'ocrq_images_total{outcome="failed",task="text"} 1.0',
                 f'ocrq_retries_total{{reason="{EngineOOM.__name__}"}} 1.0',
                 'ocrq_image_failures_total{reason="BadImage"} 1.0',
                 "ocrq_cache_hits_total 1.0", "ocrq_cache_misses_total 3.0", "ocrq_batch_size_sum 4.0",
                 "ocrq_batch_seconds_count 1.0", "ocrq_image_seconds_count 2.0", "ocrq_oom_total 2.0",
                 "ocrq_governor_budget_bytes 100.0", 'ocrq_gpu_memory_used_bytes{device="none"} 0.0',
                 'ocrq_gpu_memory_total_bytes{device="none"} 0.0'):
        assert line in text, line


def test_a_generated_redis_password_is_private_and_found_only_for_its_server(tmp_path: Path) -> None:
    from ocrq_cli.embedded.redis_servers import with_password, write_conf

    var = tmp_path / "var"
    url = with_password(var, "redis://127.0.0.1:6390/0")
    assert url.startswith("redis://:") and url.endswith("@127.0.0.1:6390/0")
    assert stat.S_IMODE((var / "redis-auth").stat().st_mode) == 0o600
    assert with_password(var, "redis://:given@127.0.0.1:6391/0") == "redis://:given@127.0.0.1:6391/0"
    # settings naming that server without a password take it; another server, or a URL with its
    # own password, is left alone
    assert Settings(var_dir=var, redis={"url": "redis://127.0.0.1:6390/0"}).redis.url == url
    assert Settings(var_dir=var, redis={"url": "redis://127.0.0.1:6390/1"}).redis.url == "redis://127.0.0.1:6390/1"
    assert Settings(var_dir=var, redis={"url": "redis://:x@127.0.0.1:6390/0"}).redis.url == "redis://:x@127.0.0.1:6390/0"
    assert Settings(var_dir=tmp_path / "elsewhere").redis.url == "redis://127.0.0.1:6379/0"
    conf = write_conf(tmp_path, url, Settings().redis, cache=False)
    text = conf.read_text()
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert "bind 127.0.0.1" in text and "rename-command CONFIG CONFIG-" in text
    assert "maxmemory-policy noeviction" in text
