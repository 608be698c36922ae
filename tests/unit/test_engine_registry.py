"""Adding an engine is one module and one registry row: a toy engine (tests/fixtures/toy_engine.py,
its settings class and the ``Engine`` members alone) is accepted by the settings with its own
setting, built by the worker, published with its tasks, refused by ``ocrq up --gpus`` (it computes
on the CPU), and runs images through the engine loop, each image's result its own whatever its
batch."""

from __future__ import annotations

import logging

import pytest
from PIL import Image

from ocrq.capabilities import capabilities, unsupported
from ocrq.engine_registry import ENGINES, EngineKind
from ocrq.settings import Settings
from ocrq.settings_check import env_name, unknown_variables
from ocrq_cli.embedded.gpus import Gpu, plan_gpu_workers
from tests.fixtures.toy_engine import ToySettings
from worker.context import engine_settings_of, governor_for
from worker.engine_kinds import build_engine, factory_of
from worker.engines.base import Capacity, KvCapacity, KvGated, OcrRequest, Profiled, RendersAhead, StartsInPhases
from worker.engines.simulated import SimulatedEngine
from worker.loop.engine_loop import EngineLoop

TOY = EngineKind("toy", "tests.fixtures.toy_engine:ToyEngine", ToySettings, ("text",), False, "cpu")


@pytest.fixture()
def toy_row(monkeypatch: pytest.MonkeyPatch) -> EngineKind:
    monkeypatch.setitem(ENGINES, "toy", TOY)
    return TOY


def _image(i: int) -> Image.Image:
    return Image.new("RGB", (40 + i, 30), (10 * i, 20, 30))


def test_an_unknown_kind_is_refused_naming_the_known_ones():
    with pytest.raises(Exception, match="Input should be .rapidocr., .transformers."):
        Settings(engine={"kind": "toy"})


def test_a_toy_engine_is_one_module_and_one_row(toy_row, caplog):
    # Given the row, settings naming the kind
    settings = Settings(engine={"kind": "toy", "prefix": "hello"}, batch={"mode": "fixed", "size": 3})
    assert type(settings.engine) is ToySettings
    assert not unknown_variables({env_name(("engine", "prefix")): "x"}, Settings)  # its own setting
    # When the worker builds it and plans for it
    engine = build_engine(engine_settings_of(settings))
    with caplog.at_level(logging.WARNING):
        governor = governor_for(settings.batch, engine, None)
    # Then it is the toy, with no capability of its own, planned with CPU costs and no warning
    assert type(engine).__name__ == "ToyEngine" and engine.revision == "toy-1-hello"
    assert not any(isinstance(engine, p) for p in (Profiled, Capacity, KvCapacity, KvGated, RendersAhead,
                                                    StartsInPhases))
    assert not [r for r in caplog.records if "memory_profile" in r.getMessage()]
    # and its worker publishes what it runs: text, not parse, no custom prompt
    caps = capabilities("toy", "cpu")
    assert caps["tasks"] == ["text"] and unsupported(caps, "text", {}) is None
    assert unsupported(caps, "parse", {}) == "the toy engine does not run task 'parse'"
    assert unsupported(caps, "text", {"prompt": "x"}) == "the toy engine does not follow a custom prompt"

    # When images run through the engine loop, together and one alone
    loop = EngineLoop(engine, governor, None, linger_s=0.01, oom_backoff_s=0)
    loop.start()
    try:
        together = [f.result(10) for f in loop.submit_many(OcrRequest(key=f"k{i}", image=_image(i)) for i in range(7))]
        alone = loop.submit(OcrRequest(key="k5-alone", image=_image(5))).result(10)
    finally:
        loop.stop(timeout=5)
    # Then each result is its image's, whatever its batch
    assert [o.text for o in together] == [f"hello ({40 + i}, 30) [{10 * i}, 20, 30]" for i in range(7)]
    assert alone.text == together[5].text and alone.model == "toy-1-hello"


def test_gpus_refuses_an_engine_that_computes_on_the_cpu(toy_row):
    settings = Settings(engine={"kind": "toy"}, metrics_port=0)
    with pytest.raises(ValueError, match="engine.kind is toy, which does not run on a local GPU"):
        plan_gpu_workers(settings, [Gpu(index=0, uuid="GPU-0", name="x", total_bytes=1)], "host")


def test_the_simulated_engine_shows_the_capabilities_it_has():
    engine = SimulatedEngine(capacity_bytes=10**9)
    assert isinstance(engine, Profiled) and isinstance(engine, Capacity)
    assert not isinstance(engine, KvCapacity) and not isinstance(engine, RendersAhead)


def test_every_row_names_a_class_that_exists():
    import importlib.util

    for row in ENGINES.values():
        if row.device == "cpu":  # built here: the factory the worker calls
            assert callable(factory_of(row.kind)), row.kind
            continue
        # a GPU engine's module imports torch/vLLM: its file is read instead
        module, _, attribute = row.factory.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, row.kind
        assert f"class {attribute.split('.')[0]}" in open(spec.origin, encoding="utf-8").read()


def test_an_engine_setting_from_the_environment_is_read_as_its_class_types_it(monkeypatch):
    # a list of the vllm-server engine's class, set as JSON, as a deployment sets it
    monkeypatch.setenv("OCRQ_ENGINE__KIND", "vllm-server")
    monkeypatch.setenv("OCRQ_ENGINE__ENDPOINTS", '["http://a:8000/v1", "http://b:8000/v1"]')
    monkeypatch.setenv("OCRQ_ENGINE__MAX_NUM_SEQS", "16")
    engine = Settings().engine
    assert type(engine).__name__ == "VllmServerSettings"
    assert engine.endpoints == ["http://a:8000/v1", "http://b:8000/v1"] and engine.max_num_seqs == 16  # type: ignore[attr-defined]


def test_a_key_of_another_engine_is_dropped_with_a_deprecation_note(caplog):
    with caplog.at_level(logging.WARNING, logger="ocrq.settings"):
        settings = Settings(engine={"kind": "rapidocr", "max_num_seqs": 8, "endpoints": ["x"]})
    assert "deprecated: engine.endpoints, engine.max_num_seqs are not read by the rapidocr engine" in caplog.text
    assert "max_num_seqs" not in settings.model_dump()["engine"]
    with pytest.raises(Exception, match="max_num_seq"):  # a key no engine has: an unknown setting
        Settings(engine={"kind": "rapidocr", "max_num_seq": 8})
