"""The shipped configuration files stay in step with the settings model and each other: every
YAML profile loads; docker-compose.yml is valid against the compose-spec schema and every OCRQ_*
variable, build file and mounted path it names exists; ops/ (Prometheus, Grafana, KEDA) agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ocrq.settings import Settings
from ocrq.settings_check import model_fields

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("profile", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_profiles_load(profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCRQ_CONFIG", str(profile))
    settings = Settings()
    raw = yaml.safe_load(profile.read_text())
    # every section and key in the file is a field the model knows (extra keys would be ignored)
    for section, values in raw.items():
        model = getattr(settings, section)
        if isinstance(values, dict):
            assert isinstance(model, BaseModel), section
            unknown = set(values) - set(type(model).model_fields)
            assert not unknown, f"{profile.name}: unknown {section} keys {unknown}"


def _field_exists(path: list[str]) -> bool:
    model: type[BaseModel] = Settings
    for i, part in enumerate(path):
        field = model_fields(model).get(part)
        if field is None:
            return False
        ann = field.annotation
        if i < len(path) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                return False
            model = ann
    return True


def test_compose_environment_names_real_settings() -> None:
    compose = _compose()
    names: set[str] = set()
    for block in [compose.get("x-ocrq-env", {})] + [svc.get("environment", {}) for svc in compose["services"].values()]:
        names |= {k for k in block if k.startswith("OCRQ_") and k != "OCRQ_CONFIG"}
    assert names, "compose sets no OCRQ_ variables?"
    bad = [n for n in names if not _field_exists(n[len("OCRQ_"):].lower().split("__"))]
    assert not bad, bad
    for svc in compose["services"].values():
        config = (svc.get("environment") or {}).get("OCRQ_CONFIG")
        if config:
            assert (ROOT / config.removeprefix("/app/")).exists(), config


# --- docker-compose.yml, validated for real (no Docker engine here) ---------------------------

_VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
#: the secrets compose must be given (each `${VAR:?message}`: no default)
SECRETS = {"REDIS_PASSWORD": "r-pw", "MINIO_ROOT_PASSWORD": "m-pw-0123", "FLOWER_BASIC_AUTH": "ops:f-pw",
           "GRAFANA_PASSWORD": "g-pw"}


class MissingVariable(ValueError):
    pass


def _interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution (what `docker compose config` does before validating):
    ${X:-default} → X or the default, ${X} → X or "", ${X:?message} → X, or an error naming it
    when it is unset or empty (compose refuses to start), $$ → $. ``env``: the variables set
    (the secrets, by default)."""
    values = SECRETS if env is None else env

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        value = values.get(name, "")
        if op.endswith("?"):
            if not value:
                raise MissingVariable(f"required variable {name} is missing a value: {arg}")
            return value
        return value or arg

    previous = None
    while previous != text:  # nested defaults: ${A:-x${B:?y}z}
        previous, text = text, _VAR.sub(one, text)
    return text.replace("$$", "$")


def _compose() -> dict:
    return yaml.safe_load(_interpolate((ROOT / "docker-compose.yml").read_text()))


def test_compose_refuses_to_start_without_its_secrets() -> None:
    """No password has a default: each secret is `${VAR:?message}`, so compose stops with the
    message when one is unset, and nothing falls back to `change-me`."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert "change-me" not in text
    for name in SECRETS:
        assert f"${{{name}:?" in text and f"${{{name}:-" not in text, name
        with pytest.raises(MissingVariable, match=name):
            _interpolate(text, {k: v for k, v in SECRETS.items() if k != name})
    # published ports are loopback unless PUBLISH_ADDR says otherwise
    for svc in _compose()["services"].values():
        assert all(str(port).startswith("127.0.0.1:") for port in svc.get("ports", [])), svc.get("ports")


def _environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        return dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_file_is_valid_compose_spec() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "tests" / "fixtures" / "compose" / "compose-spec.json").read_text())
    compose = _compose()
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose), key=str)
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    # the validator does reject a broken file (the check can fail)
    broken = {**compose, "services": {"x": {"image": 3, "ports": "5555"}}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(broken))


def test_compose_services_reference_real_files_settings_and_images() -> None:
    compose = _compose()
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "worker-cpu", "flower", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        build = svc.get("build")
        if build:
            context = ROOT / build.get("context", ".")
            assert context.is_dir(), name
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        else:
            image = svc["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin {image}"
        for volume in raw["services"][name].get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):  # not "${MODEL_DIR:-./models}": the operator's own data
                assert (ROOT / source).exists(), f"{name}: {source}"
        bad = [k for k in _environment(svc) if k.startswith("OCRQ_") and k != "OCRQ_CONFIG"
               and not _field_exists(k[len("OCRQ_"):].lower().split("__"))]
        assert not bad, f"{name}: {bad} are not settings"
    # Flower runs as `ocrq up` runs it: the ocrq app, behind basic auth
    flower = services["flower"]
    assert flower["command"] == ["ocrq", "flower"]
    assert _environment(flower)["OCRQ_FLOWER_BASIC_AUTH"].count(":") == 1


def test_ops_configs_agree_with_each_other() -> None:
    prom = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    for rule_file in prom["rule_files"]:
        assert (ROOT / "ops" / rule_file).is_file()
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    compose = _compose()
    for target in targets:
        host, port = target.split(":")
        assert host in compose["services"], target
        command = compose["services"][host].get("command") or []
        if command[:2] == ["ocrq", "metrics"]:  # the Redis-level exporter listens on its --port
            assert command[command.index("--port") + 1] == port, target
            continue
        assert _environment(compose["services"][host]).get("OCRQ_METRICS_PORT",
                                                            compose["x-ocrq-env"]["OCRQ_METRICS_PORT"]) == port
    assert Settings.model_fields["metrics_port"].default == 9809
    datasources = yaml.safe_load((ROOT / "ops/grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {d["uid"] for d in datasources["datasources"]}
    dash = json.loads((ROOT / "ops/grafana/dashboards/ocrq.json").read_text())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] in uids, panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    keda = list(yaml.safe_load_all((ROOT / "ops" / "keda-scaledobject.yaml").read_text()))
    scaled = next(d for d in keda if d["kind"] == "ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0
    assert {t["type"] for t in scaled["spec"]["triggers"]} == {"redis", "prometheus"}


def test_compose_runs_one_worker_per_gpu() -> None:
    # Given the GPU workers of docker-compose.yml (the `gpu` profile)
    compose = _compose()
    gpu = {name: svc for name, svc in compose["services"].items() if "gpu" in svc.get("profiles", [])}
    assert set(gpu) >= {"worker-gpu0", "worker-gpu1"}
    devices, nodes, ports = [], [], []
    for name, svc in sorted(gpu.items()):
        (reserved,) = svc["deploy"]["resources"]["reservations"]["devices"]
        (device,) = reserved["device_ids"]  # exactly one GPU each
        devices.append(device)
        env = _environment(svc)
        # the runtime shows a container its one GPU as device 0
        assert env["CUDA_VISIBLE_DEVICES"] == "0", name
        command = svc["command"]
        nodes.append(command[command.index("--name") + 1])
        ports.append(env.get("OCRQ_METRICS_PORT", compose["x-ocrq-env"]["OCRQ_METRICS_PORT"]))
        assert nodes[-1] == f"gpu{device}@%h" and ports[-1] == str(9809 + int(device)), name
    # Then no GPU, node name or metrics port is used twice, and Prometheus scrapes each one
    assert len(set(devices)) == len(devices) and len(set(nodes)) == len(nodes) and len(set(ports)) == len(ports)
    prom = yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {f"{name}:{port}" for name, port in zip(sorted(gpu), ports, strict=True)} <= targets
