"""Failure records tell the truth: an image out of attempts fails permanently with
RetriesExhausted naming the last cause; a dead vLLM server is EngineUnavailable, not a storage
problem. (The vLLM server here is an httpx MockTransport: a fake, named so.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from PIL import Image

from ocrq.engine_settings import VllmServerSettings
from ocrq.errors import EngineOOM, EngineUnavailable, MissingObject, RetriesExhausted, error_from_dict
from worker.chunk.retry import final_error
from worker.engines.base import OcrRequest


def test_a_retryable_error_with_budget_left_is_retried() -> None:
    assert final_error(EngineOOM("CUDA out of memory"), attempt=2, max_attempts=3) is None


def test_the_last_attempt_fails_permanently_naming_the_cause() -> None:
    err = final_error(EngineOOM("CUDA out of memory. Tried to allocate 20 MiB"), attempt=3, max_attempts=3)
    assert isinstance(err, RetriesExhausted)
    record = err.to_dict()
    assert record == {"type": "RetriesExhausted", "retryable": False,
                      "message": "after 3 attempts: EngineOOM: CUDA out of memory. Tried to allocate 20 MiB"}
    assert isinstance(error_from_dict(record), RetriesExhausted)


def test_a_permanent_error_is_recorded_as_itself() -> None:
    err = MissingObject("no such file")
    assert final_error(err, attempt=1, max_attempts=3) is err


def _refusing(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def test_no_live_vllm_server_at_start_is_engine_unavailable() -> None:
    from worker.engines.vllm.server import VllmServerEngine

    settings = VllmServerSettings(kind="vllm-server", model_dir=Path("/nonexistent"), endpoints=["http://a/v1"],
                              served_model="m")
    eng = VllmServerEngine(settings, transport=httpx.MockTransport(_refusing))
    with pytest.raises(EngineUnavailable):
        eng.start()
    eng.close()


def test_a_vllm_server_that_dies_is_engine_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engines.vllm import server

    alive = {"up": True}

    def handler(request: httpx.Request) -> httpx.Response:
        if alive["up"] and request.url.path in ("/health", "/v1/models"):
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return _refusing(request)

    monkeypatch.setattr(server, "BACKOFF_S", 0.01)
    monkeypatch.setattr(server, "PROBE_EVERY_S", 0.0)
    settings = VllmServerSettings(kind="vllm-server", model_dir=Path("/nonexistent"), endpoints=["http://a/v1"],
                              served_model="m", request_timeout=2.0, extra={"retries": 2})
    eng = server.VllmServerEngine(settings, transport=httpx.MockTransport(handler))
    eng.start()
    alive["up"] = False
    (out,) = eng.infer([OcrRequest(key="p#0", image=Image.new("RGB", (64, 32), "white"))])
    eng.close()
    assert isinstance(out, EngineUnavailable) and out.retryable, out
