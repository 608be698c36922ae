"""The vLLM server engine: a real vLLM server on loopback with the tiny random checkpoint (one
server for the module, two API processes in front of its engine core: the launcher's
``--api-server-count``; tests/integration/test_vllm_in_worker.py runs one), plus the client's
error mapping against a fake
transport (4xx, 5xx, dead endpoints, timeouts, re-probing) where a real server cannot be made
to misbehave on cue.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ocrq.errors import BadRequest, EngineTimeout, EngineUnavailable
from ocrq.results import OcrOutput
from tests.conftest import free_port
from tests.integration.vllm_support import (
    STEPS,
    TOL,
    K,
    assert_batch_invariant,
    compare,
    engine_settings,
    make_images,
    requests_for,
    require_vllm,
    running_server,
    tiny_checkpoint,
    transformers_reference,
    vllm_env,
)
from worker.engines.base import OcrRequest

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    require_vllm()
    return vllm_env(tmp_path_factory.mktemp("vllm-server-env"))


@pytest.fixture(scope="module")
def checkpoint(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(checkpoint: Path, env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return transformers_reference(checkpoint, 0, tmp_path_factory.getbasetemp() / "vllm-hf-ref.json", env)


@pytest.fixture(scope="module")
def server(
    checkpoint: Path, env: dict[str, str], reference: list[Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real server (after the transformers reference, which needs the CPU to itself)."""
    with running_server(checkpoint, env, tmp_path_factory.mktemp("vllm-server"), api_servers=2) as url:
        yield url


@pytest.fixture(scope="module")
def engine(server: str, checkpoint: Path) -> Iterator[Any]:
    from worker.engines.vllm.server import VllmServerEngine

    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    eng = VllmServerEngine(engine_settings(checkpoint, "vllm-server", endpoints=[dead, server]))
    eng.start()
    yield eng
    eng.close()


def test_infer_through_the_server_skips_the_dead_endpoint(engine: Any, server: str) -> None:
    batch = requests_for(make_images(0))
    outs = engine.infer(batch)
    assert len(outs) == len(batch)
    for req, out in zip(batch, outs, strict=True):
        assert isinstance(out, OcrOutput), out
        assert out.engine == "vllm-server" and out.model == engine.revision
        assert (out.width, out.height) == req.image.size
        assert out.meta["endpoint"] == server  # the dead one is marked down at start and skipped
        assert out.meta["stop_reason"] == "repetition" and out.meta["generated_tokens"] < 64


def test_server_batch_invariance_and_agreement_with_transformers(engine: Any, reference: list[Any]) -> None:
    assert_batch_invariant(engine, reference)


def test_both_image_transports_give_the_same_answer(engine: Any, server: str, checkpoint: Path) -> None:
    """PPM (the default: raw pixels) and PNG are both lossless: the server sees the same pixels,
    so each page's top-k logprobs agree as closely as two runs of one request do (fp32 on the
    CPU: ~1e-6; a pixel off would show in the top-k ranks or well beyond TOL)."""
    from worker.engines.vllm.server import VllmServerEngine

    png = VllmServerEngine(engine_settings(checkpoint, "vllm-server", endpoints=[server], image_transport="png"))
    png.start()
    try:
        reqs = requests_for(make_images(1)[:3])
        assert engine._body(reqs[0])["messages"][1]["content"][0]["image_url"]["url"].startswith(
            "data:image/x-portable-pixmap;base64,")
        assert png._body(reqs[0])["messages"][1]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
        for a, b in zip(engine.topk_logprobs(reqs, K, STEPS), png.topk_logprobs(reqs, K, STEPS), strict=True):
            d, missing = compare(a, b)
            print(f"ppm vs png: {d:.2e} ({missing} missing)")
            assert missing == 0 and d <= TOL, (d, missing)
    finally:
        png.close()


def test_a_request_the_server_rejects_is_a_bad_request(engine: Any) -> None:
    images = make_images(0)[:2]
    outs = engine.infer([OcrRequest(key="long", image=images[0], params={"prompt": "x" * 3000}),
                         OcrRequest(key="ok", image=images[1])])
    assert isinstance(outs[0], BadRequest) and "400" in str(outs[0]) and not outs[0].retryable
    assert isinstance(outs[1], OcrOutput)


def test_a_jobs_priority_reaches_the_server(engine: Any) -> None:
    """The launcher starts the server with ``--scheduling-policy priority`` and the engine sends
    each request's priority: vLLM accepts a non-zero priority only then (with ``fcfs`` the server
    answers 400, which the engine would record as a BadRequest)."""
    image = make_images(0)[0]
    assert engine._body(OcrRequest(key="p", image=image, priority=5))["priority"] == 5
    outs = engine.infer([OcrRequest(key="bulk", image=image, priority=5),
                         OcrRequest(key="urgent", image=image, priority=0)])
    assert all(isinstance(o, OcrOutput) for o in outs), outs


def test_memory_reads_the_server_metrics(engine: Any) -> None:
    sample = engine.memory()
    assert sample.kv_usage is not None and 0.0 <= sample.kv_usage <= 1.0
    assert sample.waiting == 0 and sample.preemptions == 0


def test_only_dead_endpoints_fail_at_start(checkpoint: Path) -> None:
    from worker.engines.vllm.server import VllmServerEngine

    eng = VllmServerEngine(engine_settings(checkpoint, "vllm-server",
                                           endpoints=[f"http://127.0.0.1:{free_port()}/v1"]))
    with pytest.raises(EngineUnavailable):
        eng.start()
    eng.close()


# --- client error mapping against a fake server ---------------------------------------------------


def _sse(tokens: list[int], text: str = "ok") -> bytes:
    chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"content": text if i == 0 else ""}, "finish_reason": None,
                            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.1,
                                                      "top_logprobs": []}]}}]}
              for i, t in enumerate(tokens)]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"completion_tokens": len(tokens)}})
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


Handler = Callable[[httpx.Request], httpx.Response]


def _fake_engine(
    handler: Handler, endpoints: list[str], monkeypatch: pytest.MonkeyPatch, **extra: Any
) -> Any:
    from worker.engines.vllm import server

    monkeypatch.setattr(server, "BACKOFF_S", 0.01)
    settings = engine_settings(Path("/nonexistent"), "vllm-server", endpoints=endpoints, served_model="m",
                               request_timeout=2.0, extra={"retries": 3, **extra})
    eng = server.VllmServerEngine(settings, transport=httpx.MockTransport(handler))
    eng.start()
    return eng


def _health_ok(request: httpx.Request) -> httpx.Response | None:
    if request.url.path in ("/health", "/v1/models"):
        return httpx.Response(200, json={"data": [{"id": "m"}]})
    if request.url.path == "/metrics":
        return httpx.Response(200, text="vllm:num_requests_waiting{engine=\"0\"} 3.0\n")
    return None


def test_5xx_is_retried_then_succeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if (health := _health_ok(request)) is not None:
            return health
        calls.append(request.url.host)
        if len(calls) < 3:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, content=_sse([5, 6, 7]), headers={"content-type": "text/event-stream"})

    monkeypatch.setattr("worker.engines.vllm.server.PROBE_EVERY_S", 0.0)
    eng = _fake_engine(handler, ["http://a/v1"], monkeypatch)
    (out,) = eng.infer(requests_for(make_images(0)[:1]))
    assert isinstance(out, OcrOutput) and out.text == "ok" and out.meta["generated_tokens"] == 3
    assert len(calls) == 3
    assert eng.memory().waiting == 3
    eng.close()


@pytest.mark.parametrize(
    ("failure", "expected"),
    [("refused", EngineUnavailable), ("503", EngineUnavailable), ("timeout", EngineTimeout),
     ("422", BadRequest)],
)
def test_failures_map_onto_the_error_tree(
    failure: str, expected: type[Exception], monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if (health := _health_ok(request)) is not None:
            return health
        attempts.append(1)
        if failure == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if failure == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        return httpx.Response(int(failure), json={"error": {"message": "rejected"}})

    monkeypatch.setattr("worker.engines.vllm.server.PROBE_EVERY_S", 0.0)
    eng = _fake_engine(handler, ["http://a/v1"], monkeypatch)
    (out,) = eng.infer(requests_for(make_images(0)[:1]))
    assert isinstance(out, expected), out
    assert len(attempts) == {"refused": 3, "503": 3, "timeout": 1, "422": 1}[failure]
    eng.close()


def test_a_down_endpoint_is_skipped_then_reprobed(monkeypatch: pytest.MonkeyPatch) -> None:
    down = {"a"}
    served: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectError("refused", request=request)
        if (health := _health_ok(request)) is not None:
            return health
        served.append(request.url.host)
        return httpx.Response(200, content=_sse([1]), headers={"content-type": "text/event-stream"})

    from worker.engines.vllm import server

    monkeypatch.setattr(server, "PROBE_EVERY_S", 3600.0)
    eng = _fake_engine(handler, ["http://a/v1", "http://b/v1"], monkeypatch)
    eng.infer(requests_for(make_images(0)[:4]))
    assert set(served) == {"b"}
    down.clear()  # a comes back; once its probe time has come it takes work again
    for ep in eng._endpoints:
        ep.probe_at = 0.0
    served.clear()
    eng.infer(requests_for(make_images(0)[:4]))
    assert set(served) == {"a", "b"}
    eng.close()


def test_metrics_parsing_sums_labels() -> None:
    from worker.engines.vllm.server import parse_metrics

    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:num_preemptions_total{engine="0"} 7.0\n'
        "process_cpu_seconds_total 12.0\n"
    )
    assert parse_metrics(text) == {"vllm:num_requests_waiting": 5.0, "vllm:kv_cache_usage_perc": 0.25,
                                   "vllm:num_preemptions_total": 7.0}


def test_server_command_line_follows_the_settings(tmp_path: Path) -> None:
    from worker.engines.vllm.launcher import server_argv

    argv = server_argv(tmp_path, 8000, engine_settings(tmp_path, "vllm-server"))
    assert argv[1:3] == ["-m", "worker.engines.vllm.serve"]
    joined = " ".join(argv)
    assert 1 <= int(argv[argv.index("--api-server-count") + 1]) <= 4  # unset: from the host's cores
    assert "--api-server-count 3" in " ".join(
        server_argv(tmp_path, 8000, engine_settings(tmp_path, "vllm-server", api_servers=3)))
    for flag in ("--no-enable-prefix-caching", "--mm-processor-cache-gb 0", "--max-model-len 2048",
                 "--max-num-seqs 8", "--enforce-eager", "--dtype float32", '--limit-mm-per-prompt {"image": 1}',
                 "--scheduling-policy priority", "--renderer-num-workers "):
        assert flag in joined
    assert json.loads(argv[argv.index("--mm-processor-kwargs") + 1]) == {
        "size": {"shortest_edge": 256 * 256, "longest_edge": 1024 * 1024}}


def test_vllms_own_command_line_takes_the_encoder_graphs_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine.vision_cuda_graphs`` reaches a launched server as ``--compilation-config`` JSON:
    vLLM's own argument parser turns it into the compilation config the engine core reads."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from worker.engines.vllm import launcher

    monkeypatch.setattr(launcher, "_has_cuda", lambda: True)
    argv = launcher.server_argv(tmp_path, 8000, engine_settings(tmp_path, "vllm-server", vision_cuda_graphs=True,
                                                                     enforce_eager=False))
    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    given = argv[argv.index("--compilation-config") + 1]
    args = parser.parse_args(["--model", str(tmp_path), "--compilation-config", given])
    cc = AsyncEngineArgs.from_cli_args(args).compilation_config
    assert cc.cudagraph_mm_encoder is True
    assert cc.encoder_cudagraph_max_vision_items_per_batch == 1 and len(cc.encoder_cudagraph_token_budgets) > 10
