"""The shipped ops/prometheus.yml + ops/alerts.yml run in a real Prometheus (Debian's `prometheus`)
that scrapes a real worker through a job with a broken image; then every Grafana panel query and
every alert expression is evaluated over Prometheus' HTTP API and must return data."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from producer.client import Client
from tests.conftest import _need, _redis_binary, free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
#: Grafana's built-in variables, as Grafana would expand them for a short range
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}
#: series an alert reads: worker metrics, recording rules, and `up`
SERIES = re.compile(r"\b(ocrq[_:][A-Za-z0-9_:]*|up)(\{[^}]*\})?")

WORKER_SERIES = [
    "ocrq_images_total", "ocrq_batch_size_bucket", "ocrq_batch_seconds_bucket", "ocrq_image_seconds_bucket",
    "ocrq_oom_total", "ocrq_retries_total", "ocrq_cache_hits_total", "ocrq_cache_misses_total",
    "ocrq_gpu_memory_used_bytes", "ocrq_gpu_memory_total_bytes", "ocrq_governor_budget_bytes",
    "ocrq_governor_predicted_peak_bytes", "ocrq_governor_measured_peak_bytes", "ocrq_queue_depth",
]


def _prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if not found:
        _need("prometheus (apt-get install prometheus; `make test` installs it)")
    return str(found)


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def _config(tmp: Path, target: str) -> Path:
    """ops/prometheus.yml with the worker target swapped for the test worker and 1 s intervals."""
    cfg = yaml.safe_load((OPS / "prometheus.yml").read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    cfg["rule_files"] = [str(OPS / f) for f in cfg["rule_files"]]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "ocrq-worker"]
    job["static_configs"] = [{"targets": [target], "labels": {"pool": "cpu"}}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_for(port: int, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.time() + timeout
    while True:
        try:
            found = _query(port, expr)
            if found:
                return found
        except OSError:
            pass
        if time.time() > deadline:
            raise AssertionError(f"no data for {expr} after {timeout:.0f}s")
        time.sleep(0.5)


def test_dashboard_and_alerts_have_data(redis_url, start_worker, tmp_path):
    binary = _prometheus_binary()
    metrics_port, prom_port = free_port(), free_port()
    src = tmp_path / "in"
    word_images(src, 4)
    (src / "broken.png").write_bytes(b"this is not a png")
    start_worker(worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_METRICS_PORT=str(metrics_port),
                            OCRQ_METRICS_ADDR="127.0.0.1"), name="prom")
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [binary, f"--config.file={_config(tmp_path, f'127.0.0.1:{metrics_port}')}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    # a replica of the test's Redis, so the replication series the HA alerts read have data
    replica = subprocess.Popen([_redis_binary() or "redis-server", "--port", str(free_port()), "--bind", "127.0.0.1",
                                "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                                "--replicaof", "127.0.0.1", str(urllib.parse.urlparse(redis_url).port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Given a scraped worker that ran a job twice (the second run is all cache hits)
        client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
        _wait_for(prom_port, 'up{job="ocrq-worker"} == 1')
        for job in ("prom-a", "prom-b"):
            counts = client.submit([str(src)], job=job).wait(timeout=120)
            assert counts["failed"] == 1 and counts["done"] == 4, counts
        # When Prometheus has scraped it a few times since and evaluated the rules
        _wait_for(prom_port, 'ocrq_images_total{outcome="cached"} >= 4')
        _wait_for(prom_port, 'ocrq_image_failures_total{reason="BadImage"} >= 2')
        time.sleep(3)
        _wait_for(prom_port, "ocrq:cache_hit_ratio:rate30m")
        # Then every worker series is there, with the GPU ones at device="none" on this host
        for name in WORKER_SERIES:
            assert _query(prom_port, name), name
        assert _query(prom_port, 'ocrq_gpu_memory_total_bytes{device="none"} == 0')
        # every panel query of the dashboard returns data
        dash = json.loads((OPS / "grafana" / "dashboards" / "ocrq.json").read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
        assert len(exprs) >= 10
        for expr in exprs:
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert _query(prom_port, expr), f"panel query returned nothing: {expr}"
        # every alert expression evaluates, and every series it reads has data
        rules = yaml.safe_load((OPS / "alerts.yml").read_text())
        alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
        assert {a["alert"] for a in alerts} >= {"OcrqBacklogStalled", "OcrqOOMRate", "OcrqFailureRatio",
                                                  "OcrqWorkerDown", "OcrqCacheHitRatioCollapse", "OcrqRedisFailover",
                                                  "OcrqRedisReplicationLag", "OcrqRedisNoReplica"}
        for alert in alerts:
            _query(prom_port, alert["expr"])  # evaluates (firing or not)
            read = {m.group(0) for m in SERIES.finditer(alert["expr"])}
            assert read, alert["alert"]
            for selector in read:
                assert _query(prom_port, selector), f"{alert['alert']}: no data for {selector}"
        # the failure ratio alert's signal sees the broken image: 2 of 10 images failed
        (ratio,) = _query(prom_port, "ocrq:failure_ratio:rate15m")
        assert float(ratio["value"][1]) > 0.05
        # and `ocrq status` prices the engine time the worker measured, named by what measured
        # it (a CPU engine here: CPU-seconds at the CPU price): prom-a ran the engine, prom-b
        # was all cache hits
        env = {**os.environ, "OCRQ_REDIS__URL": redis_url, "OCRQ_CPU_HOUR_USD": "3.6"}
        costs = {}
        for job in ("prom-a", "prom-b"):
            out = subprocess.run([sys.executable, "-m", "ocrq_cli", "status", job], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            costs[job] = json.loads(out.stdout)["cost"]  # stdout is a pipe: JSON only
        (engine_s,) = _query(prom_port, "sum(ocrq_batch_seconds_sum)")
        assert costs["prom-a"]["engine_images"] == 4 and costs["prom-a"]["batches"] >= 1
        assert costs["prom-a"]["unit"] == "CPU-s" and costs["prom-a"]["hour_usd"] == 3.6
        assert costs["prom-a"]["engine_seconds"] == pytest.approx(float(engine_s["value"][1]), rel=1e-3)
        assert costs["prom-a"]["usd_per_1000_images"] == pytest.approx(
            costs["prom-a"]["engine_seconds"] / 3600 * 3.6 / 4 * 1000, rel=1e-3)
        assert costs["prom-b"]["engine_seconds"] == 0 and costs["prom-b"]["done"] == 4
    finally:
        replica.terminate()
        replica.wait(15)
        prom.terminate()
        prom.wait(15)
        print("--- prometheus.log (tail) ---\n" + (tmp_path / "prometheus.log").read_text()[-2000:])
