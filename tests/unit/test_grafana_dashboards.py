"""Every Grafana dashboard under ops/grafana/dashboards is one Grafana can load (its JSON
structure, panels that do not overlap, the provisioned data source), and every series its
PromQL names is one ocrq serves: the names and label values are read from the real collectors
(worker/metrics.py, ocrq/metrics/redis_series.py, run against a fake Redis named so) and the recording rules
of ops/alerts.yml, so renaming a metric without its panel fails here. (Grafana itself is not
installed here; tests/integration/test_prometheus.py runs the fleet dashboard's queries against
a real Prometheus.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from ocrq import keys
from ocrq.metrics.redis_series import _WORKER_GAUGES, RedisCollector
from worker.memory.nvml import NullProbe
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "ops" / "grafana" / "dashboards").glob("*.json"))
PANEL_TYPES = {"timeseries", "stat", "bargauge", "gauge", "table", "text", "piechart", "heatmap"}
#: series a query names: ocrq's own, recording rules (ocrq:...), Prometheus' `up`
SERIES = re.compile(r"(?<![A-Za-z0-9_:])(ocrq[_:][A-Za-z0-9_:]*|up)(?![A-Za-z0-9_:(])(\{[^}]*\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
#: labels Prometheus adds to every scraped series
TARGET_LABELS = {"instance", "job", "pool"}


class FakeRedisForMetricNames:
    """Answers what the collectors ask Redis, with one of everything (a job, a worker, queues)."""

    connection_pool = None

    def pipeline(self, transaction: bool = True) -> Any:
        class Pipe:
            n = 0

            def llen(self, name: str) -> None:
                self.n += 1

            def execute(self) -> list[int]:
                return [1] * self.n

        return Pipe()

    def hlen(self, name: str) -> int:
        return 2

    def zrevrange(self, name: str, start: int, end: int) -> list[bytes]:
        return [b"invoices"]

    def hgetall(self, name: str) -> dict[bytes, bytes]:
        fields = ("total", "done", "cached", "failed", "cancelled", "queued", "running", "retrying", "engine_s")
        return {f.encode(): b"1" for f in fields}

    def info(self, section: str) -> dict[str, Any]:
        if section == "memory":
            return {"used_memory": 10, "maxmemory": 100}
        return {"master_replid": "abc", "connected_slaves": 1, "master_repl_offset": 5,
                "slave0": {"ip": "10.0.0.2", "port": 6379, "offset": 4, "lag": 0}}

    def scan_iter(self, pattern: str, count: int = 0) -> list[bytes]:
        return [keys.worker_state("gpu0@h").encode()]

    def get(self, key: bytes) -> bytes:
        return json.dumps({name: 1 for name in _WORKER_GAUGES}).encode()


def served() -> dict[str, dict[str, set[str]]]:
    """Every series name ocrq serves → its labels → the values seen (empty set: any value)."""
    worker = WorkerMetrics()
    worker.watch(lambda: {}, NullProbe(), "none", FakeRedisForMetricNames(), ["ocrq"])
    fleet = CollectorRegistry(auto_describe=False)
    fleet.register(RedisCollector(FakeRedisForMetricNames(), ["ocrq"]))
    found: dict[str, dict[str, set[str]]] = {}
    for registry in (worker.registry, fleet):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            for name in [family.name + s for s in suffixes] + [s.name for s in family.samples]:
                found.setdefault(name, {})
            for sample in family.samples:
                for label, value in sample.labels.items():
                    found[sample.name].setdefault(label, set()).add(value)
    rules = yaml.safe_load((ROOT / "ops" / "alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                found.setdefault(rule["record"], {})
    found["up"] = {}
    return found


def test_the_name_reader_sees_the_real_series() -> None:
    names = served()
    assert {"ocrq_images_total", "ocrq_batch_size_bucket", "ocrq_job_images", "ocrq_worker", "ocrq_queue_depth",
            "ocrq_redis_memory_max_bytes", "ocrq:cache_hit_ratio:rate30m", "ocrq_oom_total"} <= set(names)
    assert names["ocrq_job_images"]["status"] >= {"total", "done", "failed", "cancelled"}
    assert names["ocrq_worker"]["field"] == set(_WORKER_GAUGES)
    # and the query reader finds a name, its matchers and its grouping labels
    (m,) = SERIES.finditer('sum by (job) (rate(ocrq_images_total{outcome="done"}[5m]))')
    assert m.group(1) == "ocrq_images_total" and MATCHER.findall(m.group(2)) == [("outcome", "=", "done")]


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_is_one_grafana_loads(path: Path) -> None:
    dash = json.loads(path.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    datasources = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: dict[tuple[int, int], str] = {}
    for panel in dash["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert panel["datasource"]["uid"] in uids, panel["title"]
        g = panel["gridPos"]
        assert all(isinstance(g[k], int) and g[k] >= 0 for k in "hwxy") and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):  # no two panels on one cell of the grid
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells.get((x, y))}"
                cells[(x, y)] = panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() and t["datasource"]["uid"] in uids for t in panel["targets"]), panel["title"]
    # the provisioning loads every file of this folder (docker-compose.yml mounts it)
    provider = yaml.safe_load((ROOT / "ops/grafana/provisioning/dashboards/ocrq.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "./ops/grafana/dashboards:/var/lib/grafana/dashboards:ro" in compose


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_series_ocrq_serves(path: Path) -> None:
    names = served()
    for title, expr in _queries(json.loads(path.read_text())):
        found = list(SERIES.finditer(expr))
        assert found, f"{title}: no ocrq series in {expr}"
        labels: set[str] = set(TARGET_LABELS)
        for m in found:
            name = m.group(1)
            assert name in names, (f"{title}: {name} is not served (worker/metrics.py, "
                                   "ocrq/metrics/redis_series.py, alerts.yml)")
            labels |= set(names[name])
            for label, op, value in MATCHER.findall(m.group(2) or ""):
                if label in TARGET_LABELS:
                    continue
                assert label in names[name], f"{title}: {name} has no label {label}"
                seen = names[name][label]
                wanted = value.split("|") if op == "=~" else [value]
                if seen and all(re.fullmatch(r"[A-Za-z0-9_]+", w) for w in wanted):
                    assert set(wanted) <= seen, f"{title}: {name}{{{label}}} is never {set(wanted) - seen}"
        for group in BY.findall(expr):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                assert label in labels, f"{title}: no series of {expr} has the label {label}"
