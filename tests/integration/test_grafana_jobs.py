"""The jobs dashboard (ops/grafana/dashboards/ocrq-jobs.json) against a real Prometheus (Debian's
`prometheus`) running the shipped ops/prometheus.yml, scraping a real worker and a real `ocrq
metrics` exporter through a job with a broken image: every panel query parses and returns data."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from producer.client import Client
from tests.conftest import free_port
from tests.fixtures.images import word_images
from tests.integration.conftest import settings_for, worker_env
from tests.integration.test_prometheus import GRAFANA_VARS, OPS, _config, _prometheus_binary, _query, _wait_for

pytestmark = pytest.mark.integration


def test_every_jobs_dashboard_panel_has_data(redis_url, start_worker, tmp_path):
    binary = _prometheus_binary()
    metrics_port, exporter_port, prom_port = free_port(), free_port(), free_port()
    src = tmp_path / "in"
    word_images(src, 4)
    (src / "broken.png").write_bytes(b"this is not a png")
    # the simulated engine: a device budget for the governor panels (RapidOCR on a CPU has none)
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_METRICS_PORT=str(metrics_port),
                     OCRQ_METRICS_ADDR="127.0.0.1", OCRQ_ENGINE__KIND="simulated")
    start_worker(env, name="dash")
    exporter = subprocess.Popen([sys.executable, "-m", "ocrq_cli", "metrics", "--port", str(exporter_port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    # the shipped config, its targets swapped for this test's worker and exporter
    path = _config(tmp_path, f"127.0.0.1:{metrics_port}")
    cfg = yaml.safe_load(path.read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "ocrq-exporter"]
    assert job["honor_labels"] is True  # (the exporter's `job` label is the ocrq job's name)
    job["static_configs"] = [{"targets": [f"127.0.0.1:{exporter_port}"]}]
    path.write_text(yaml.safe_dump(cfg))
    prom = subprocess.Popen([binary, f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        # Given a job with a broken image, finished, scraped a few times since
        client = Client(settings_for(redis_url, tmp_path / "store", limits={"allowed_roots": [tmp_path]}))
        _wait_for(prom_port, 'up{job="ocrq-worker"} == 1')
        _wait_for(prom_port, 'up{job="ocrq-exporter"} == 1')
        counts = client.submit([str(src)], job="dash-job").wait(timeout=120)
        assert counts["failed"] == 1 and counts["done"] == 4, counts
        _wait_for(prom_port, 'ocrq_job_images{job="dash-job", status="done"} == 4')
        _wait_for(prom_port, 'ocrq_images_total{outcome="failed"} >= 1')
        time.sleep(3)
        # Then every panel query of the jobs dashboard returns data
        dash = json.loads((OPS / "grafana" / "dashboards" / "ocrq-jobs.json").read_text())
        exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
        assert len(exprs) >= 12
        for title, expr in exprs:
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert _query(prom_port, expr), f"{title}: no data for {expr}"
        # and the progress panel reads the finished job as whole
        (progress,) = _query(prom_port, dash["panels"][0]["targets"][0]["expr"])
        assert progress["metric"] == {"job": "dash-job"} and float(progress["value"][1]) == 1.0
    finally:
        prom.terminate()
        exporter.terminate()
        prom.wait(10)
        exporter.wait(10)
