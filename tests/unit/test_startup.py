"""A worker's start, phase by phase (worker.startup), and vLLM's build phases read from its log
lines (worker.engines.vllm.startup): pure, with a fake clock."""

from __future__ import annotations

import logging
import os
import time

import pytest

from worker.engines.vllm import startup
from worker.startup import StartupClock, process_started_at


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_phases_add_up_to_ready() -> None:
    clock = FakeClock(100.0)
    s = StartupClock(started_at=98.5, clock=clock)
    s.mark("interpreter")
    clock.now = 101.0
    s.mark("celery")
    clock.now = 131.0
    s.mark("engine")
    s.add_detail("engine", {"llm": 27.5, "compile": 9.25})
    clock.now = 131.5
    s.mark("governor")
    clock.now = 132.0
    assert s.ready() == 33.5
    assert s.phases == {"interpreter": 1.5, "celery": 1.0, "engine": 30.0, "governor": 0.5, "consumer": 0.5}
    assert sum(s.phases.values()) == s.ready_s
    assert s.state()["detail"] == {"engine.llm": 27.5, "engine.compile": 9.25}
    assert s.summary().startswith("ready in 33.5s: interpreter 1.5s, celery 1.0s, engine 30.0s")


def test_phases_beside_the_engine_leave_the_critical_path_adding_up_to_ready() -> None:
    clock = FakeClock(100.0)
    s = StartupClock(started_at=98.0, clock=clock)
    s.mark("interpreter")
    clock.now = 101.0
    s.mark("celery")
    clock.now = 171.0
    s.mark("engine")
    # vLLM: import, LLM(), the wait after it follow one another; the renderer's warm-up ran beside LLM()
    s.add_detail("engine", {"import": 9.0, "llm": 60.0, "compile": 20.0, "after_llm": 0.5, "renderer_warm": 14.5},
                 path=["import", "llm", "after_llm"])
    s.add_beside("clients", 0.6, during="engine")
    s.add_beside("engine.renderer_warm", 14.5, during="engine.llm")
    clock.now = 171.5
    s.mark("gc")
    assert s.ready() == 73.5
    path = s.critical_path()
    assert [name for name, _ in path] == ["interpreter", "celery", "engine.import", "engine.llm", "engine.after_llm",
                                          "engine.other", "gc", "consumer"]
    assert sum(seconds for _, seconds in path) == pytest.approx(s.ready_s)
    assert dict(path)["engine.other"] == 0.5
    state = s.state()
    assert state["beside"] == {"clients": {"s": 0.6, "during": "engine"},
                               "engine.renderer_warm": {"s": 14.5, "during": "engine.llm"}}
    assert "beside: clients 0.6s during engine" in s.summary()
    assert "critical path: interpreter 2.0s > celery 1.0s > engine.import 9.0s > engine.llm 60.0s" in s.summary()


def test_process_start_is_this_process() -> None:
    started = process_started_at()
    assert started <= time.time()
    # a test process has run for a while, never for days
    assert time.time() - started < 86400


LINES = {
    "Loading weights took 3.21 seconds": ("weights", 3.21),
    "Model loading took 2.1 GiB memory and 4.500000 seconds": ("model_load", 4.5),
    "Model loading took 2.1 GiB and 4.500000 seconds": ("model_load", 4.5),
    "torch.compile took 19.02 s in total": ("compile", 19.02),
    "Graph capturing finished in 12 secs, took 0.41 GiB": ("cuda_graphs", 12.0),
    "init engine (profile, create kv cache, warmup model) took 41.30 s": ("init_engine", 41.3),
    "Memory profiling takes 6.12 seconds. Total non-torch memory ...": ("profile", 6.12),
}


def test_vllm_lines_parse() -> None:
    for message, expected in LINES.items():
        assert startup.parse(message) == expected, message
    assert startup.parse("Automatically detected platform cuda.") is None


def test_handler_writes_what_the_engine_reads(tmp_path, monkeypatch) -> None:
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(startup.ENV, str(path))
    logger = logging.getLogger("vllm")
    before = list(logger.handlers)
    try:
        assert startup.install_from_env()
        assert startup.install_from_env()  # idempotent: one handler
        assert len(logger.handlers) == len(before) + 1
        old_level = logger.level
        logger.setLevel(logging.INFO)
        child = logging.getLogger("vllm.compilation.backends")
        child.info("Compiling a graph for compile range %s takes %.2f s", (1, 16384), 4.0)
        child.info("torch.compile took %.2f s in total", 7.5)
        child.info("torch.compile took %.2f s in total", 2.5)  # a second compile range: summed
        logging.getLogger("vllm.v1.engine.core").info(
            "init engine (profile, create kv cache, warmup model) took %.2f s", 20.0)
        logger.setLevel(old_level)
    finally:
        for h in list(logger.handlers):
            if h not in before:
                logger.removeHandler(h)
    assert startup.read(path) == {"compile": 10.0, "init_engine": 20.0}
    assert all(f'"pid": {os.getpid()}' in line for line in path.read_text().splitlines())


def test_no_env_no_handler(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(startup.ENV, raising=False)
    assert not startup.install_from_env()
    assert startup.read(tmp_path / "absent.jsonl") == {}
