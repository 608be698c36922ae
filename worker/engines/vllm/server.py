"""HunyuanOCR through one or more vLLM OpenAI-compatible servers (``launcher`` starts them).

Each image is one streamed chat completion (``chat``: request body, answer). Streaming lets
the repetition rule stop a looping page early: closing the stream makes vLLM abort the request.

Endpoints are used least-loaded first (in flight + the server's ``vllm:num_requests_waiting``),
round-robin on ties; each has its own bound on requests in flight (``max_num_seqs``). An endpoint
that refuses connections or answers 502/503/504 is marked down, skipped, and re-probed
(``/health``) after ``PROBE_EVERY_S`` (at once when no endpoint is left). Errors, per image:

- connection error / 5xx / 429: retried on another endpoint with exponential backoff; after
  ``retries`` attempts → ``EngineUnavailable`` (retryable by Celery);
- no answer within ``request_timeout`` → ``EngineTimeout`` (retryable);
- 4xx → ``BadRequest`` (permanent: e.g. an image the server's processor rejects).

Only httpx is needed here; vLLM is needed only on the host that runs ``launch_server``.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ocrq.engine_settings import VllmServerSettings
from ocrq.errors import BadRequest, EngineCrashed, EngineTimeout, EngineUnavailable, OcrqError
from ocrq.results import OcrOutput
from worker.engines import hunyuan
from worker.engines.base import ImageCost, MemorySample, OcrRequest
from worker.engines.hunyuan import build_output
from worker.engines.vllm.answers import answer_meta
from worker.engines.vllm.chat import Answer, encode_body, request_body

log = logging.getLogger(__name__)

#: seconds an endpoint marked down is skipped before it is probed again
PROBE_EVERY_S = 5.0
#: seconds between two scrapes of an endpoint's /metrics
METRICS_EVERY_S = 1.0
#: first retry delay; doubles per attempt
BACKOFF_S = 0.25
_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")
#: the KV cache size a server reports in its cache_config_info labels
_KV_TOKENS = re.compile(r'^vllm:cache_config_info\{[^}]*kv_cache_size_tokens="(\d+)"', re.M)


class _Retry(Exception):
    """An attempt failed in a way another attempt (maybe elsewhere) may fix."""


@dataclass
class _Endpoint:
    url: str  # .../v1
    slots: threading.BoundedSemaphore
    healthy: bool = True
    probe_at: float = 0.0
    inflight: int = 0
    waiting: int = 0
    kv_usage: float | None = None
    preemptions: int | None = None
    scraped_at: float = 0.0

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")] if self.url.endswith("/v1") else self.url


class VllmServerEngine:
    """``Engine`` backed by OpenAI-compatible vLLM servers (``settings.endpoints``).

    ``settings.extra``: ``hunyuan_version``, ``retries`` (attempts per image, default 3),
    ``ignore_eos`` (tests).
    """

    name = "vllm-server"

    def __init__(self, settings: VllmServerSettings, transport: httpx.BaseTransport | None = None) -> None:
        if not settings.endpoints:
            raise ValueError("the vllm-server engine needs at least one endpoint")
        self.settings = settings
        self.version = hunyuan.version_of(settings)
        self.sampling = hunyuan.SAMPLING[self.version]
        self.retries = max(1, int(settings.extra.get("retries", 3)))
        self.model = settings.served_model
        self._transport = transport
        self._endpoints = [
            _Endpoint(url.rstrip("/"), threading.BoundedSemaphore(settings.max_num_seqs))
            for url in settings.endpoints
        ]
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._revision: str | None = None
        #: micro-batches the engine loop may have in flight at once (requests are independent)
        self.concurrent_batches = max(1, settings.concurrent_batches)
        #: KV tokens of the servers together (from their cache_config_info), for admission control
        self.kv_capacity_tokens: int | None = None

    # --- Engine protocol ---------------------------------------------------------------------

    @property
    def revision(self) -> str:
        """The checkpoint's revision when its files are here, else the served model's name."""
        if self._revision is None:
            model_dir = self.settings.model_dir
            if model_dir is not None and (Path(model_dir) / "config.json").exists():
                from worker.engines.weights import weights_revision

                self._revision = weights_revision(Path(model_dir), self.version)
            else:
                self._revision = f"hunyuanocr-{self.version}-served-{self.model or 'unknown'}"
        return self._revision

    def start(self) -> None:
        """Open the client and find at least one live endpoint (and the served model name)."""
        timeout = httpx.Timeout(self.settings.request_timeout, connect=5.0)
        self._client = httpx.Client(timeout=timeout, transport=self._transport)
        workers = min(256, self.settings.max_num_seqs * len(self._endpoints))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm-server")
        live = [ep for ep in self._endpoints if self._probe(ep)]
        if not live:
            raise EngineUnavailable(f"no vLLM endpoint answers: {', '.join(e.url for e in self._endpoints)}")
        if self.model is None:
            self.model = self._served_model(live[0])
        sizes = [self._kv_tokens(ep) for ep in live]
        self.kv_capacity_tokens = sum(n for n in sizes if n) or None
        _ = self.revision

    def cost(self, request: OcrRequest) -> ImageCost:
        return hunyuan.cost(request, self.settings)

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        t0 = time.perf_counter()
        answers = self._send(batch, self._bodies(batch))
        seconds = time.perf_counter() - t0
        outcomes: list[OcrOutput | OcrqError] = []
        for request, answer in zip(batch, answers, strict=True):
            if isinstance(answer, OcrqError):
                outcomes.append(answer)
                continue
            meta = answer_meta(answer.generated, answer.finish, answer.repetition, len(batch), seconds)
            meta["endpoint"] = answer.endpoint
            outcomes.append(build_output(request, answer.text, engine=self.name, revision=self.revision,
                                         settings=self.settings, meta=meta))
        return outcomes

    def memory(self) -> MemorySample:
        """The servers' own gauges: max KV usage, total waiting, total preemptions (live ones)."""
        for ep in self._endpoints:
            if ep.healthy:
                self._scrape(ep)
        live = [ep for ep in self._endpoints if ep.healthy and ep.scraped_at]
        if not live:
            return MemorySample()
        usages = [ep.kv_usage for ep in live if ep.kv_usage is not None]
        preempted = [ep.preemptions for ep in live if ep.preemptions is not None]
        return MemorySample(kv_usage=max(usages) if usages else None, waiting=sum(ep.waiting for ep in live),
                            preemptions=sum(preempted) if preempted else None)

    def reset_peak(self) -> None:
        pass

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- tests and benchmarks ----------------------------------------------------------------

    def topk_logprobs(
        self, requests: Sequence[OcrRequest], k: int, steps: int
    ) -> list[list[list[tuple[int, float]]]]:
        """Per image, per step: top-``k`` (token id, logprob) along the greedy path, ``steps``
        tokens exactly (no stop rules), all requests in flight together."""
        bodies = self._bodies(requests)
        for body in bodies:
            body.update(max_tokens=steps, min_tokens=steps, ignore_eos=True, logprobs=True, top_logprobs=k)
        answers = self._send(requests, bodies, watch=False)
        for answer in answers:
            if isinstance(answer, OcrqError):
                raise answer
        return [a.logprobs for a in answers if isinstance(a, Answer)]

    # --- requests ----------------------------------------------------------------------------

    def _send(
        self, batch: Sequence[OcrRequest], bodies: list[dict[str, Any]], watch: bool = True
    ) -> list[Answer | OcrqError]:
        """All requests in flight together. Bodies are encoded first, so the requests reach the
        server close together and it can run their vision encoder as one batch."""
        if self._pool is None or self._client is None:
            raise EngineCrashed("vllm-server engine not started")
        pairs = zip(batch, bodies, strict=True)
        return list(self._pool.map(lambda pair: self._attempts(pair[0], pair[1], watch), pairs))

    def _bodies(self, batch: Sequence[OcrRequest]) -> list[dict[str, Any]]:
        """Every request's body, built on the pool (PPM: ~10 ms for a 2048×1536 page; PNG releases
        the GIL but takes ~0.5 s for a noisy one, so a batch's pages one after the other would
        hold its requests back)."""
        if self._pool is None:
            raise EngineCrashed("vllm-server engine not started")
        return list(self._pool.map(self._body, batch))

    def _body(self, request: OcrRequest) -> dict[str, Any]:
        return request_body(request, model=self.model, version=self.version, sampling=self.sampling,
                            settings=self.settings)

    def _attempts(self, request: OcrRequest, body: dict[str, Any], watch: bool = True) -> Answer | OcrqError:
        """Up to ``retries`` attempts, each on the least-loaded live endpoint (the body is encoded
        once, before the first)."""
        try:
            payload = encode_body(body)
        except OcrqError as exc:
            return exc
        last = "no live endpoint"
        for attempt in range(self.retries):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            ep = self._acquire()
            if ep is None:
                continue
            try:
                return self._stream(ep, payload, watch)
            except _Retry as exc:
                last = f"{ep.url}: {exc}"
                log.warning("vLLM request %s failed (attempt %d/%d): %s", request.key, attempt + 1,
                            self.retries, last)
            except httpx.TimeoutException as exc:
                return EngineTimeout(f"{request.key}: {ep.url} gave no answer within "
                                     f"{self.settings.request_timeout}s ({type(exc).__name__})")
            except OcrqError as exc:
                return exc
            finally:
                self._release(ep)
        return EngineUnavailable(f"{request.key}: no vLLM answer in {self.retries} attempts: {last}")

    def _stream(self, ep: _Endpoint, payload: bytes, watch: bool) -> Answer:
        assert self._client is not None
        answer = Answer(endpoint=ep.url)
        deadline = time.monotonic() + self.settings.request_timeout
        try:
            with self._client.stream("POST", f"{ep.url}/chat/completions", content=payload,
                                     headers={"content-type": "application/json"}) as response:
                self._check_status(ep, response)
                for line in response.iter_lines():
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("request_timeout exceeded while streaming")
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    answer.add_chunk(json.loads(line[5:]))
                    if watch and answer.looping(self.settings.repetition_stop, final=False):
                        break  # leaving the stream closes it: vLLM aborts the request
        except httpx.TimeoutException as exc:
            if isinstance(exc, httpx.ConnectTimeout):
                self._mark_down(ep)
                raise _Retry(f"connect timeout: {exc}") from exc
            raise
        except httpx.TransportError as exc:
            self._mark_down(ep)
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        if watch:
            answer.looping(self.settings.repetition_stop, final=True)
        return answer

    def _check_status(self, ep: _Endpoint, response: httpx.Response) -> None:
        if response.status_code < 400:
            return
        detail = response.read().decode("utf-8", "replace")[:400]
        if response.status_code == 429 or response.status_code >= 500:
            if response.status_code in (502, 503, 504):  # the server (or its proxy) is unavailable
                self._mark_down(ep)
            raise _Retry(f"HTTP {response.status_code}: {detail}")
        raise BadRequest(f"HTTP {response.status_code} from {ep.url}: {detail}")

    # --- endpoints ---------------------------------------------------------------------------

    def _acquire(self) -> _Endpoint | None:
        """A slot on the least-loaded live endpoint (waits for one when all are busy); endpoints
        whose probe time has come are probed first. None when every endpoint is down."""
        deadline = time.monotonic() + self.settings.request_timeout
        while time.monotonic() < deadline:
            now = time.monotonic()
            for ep in self._endpoints:
                if not ep.healthy and now >= ep.probe_at:
                    self._probe(ep)
            if not any(ep.healthy for ep in self._endpoints):
                for ep in self._endpoints:  # nothing left to skip to: look again now
                    self._probe(ep)
            with self._lock:
                live = [ep for ep in self._endpoints if ep.healthy]
                if not live:
                    return None
                turn = next(self._rr)
                order = sorted(range(len(live)), key=lambda i: (live[i].inflight + live[i].waiting,
                                                                (i - turn) % len(live)))
                for i in order:
                    if live[i].slots.acquire(blocking=False):
                        live[i].inflight += 1
                        return live[i]
            time.sleep(0.01)
        return None

    def _release(self, ep: _Endpoint) -> None:
        with self._lock:
            ep.inflight -= 1
        ep.slots.release()

    def _mark_down(self, ep: _Endpoint) -> None:
        with self._lock:
            if ep.healthy:
                log.warning("vLLM endpoint %s is down; re-probing every %.0fs", ep.url, PROBE_EVERY_S)
            ep.healthy = False
            ep.probe_at = time.monotonic() + PROBE_EVERY_S

    def _probe(self, ep: _Endpoint) -> bool:
        """``/health`` (vLLM), else ``/v1/models`` (other OpenAI-compatible servers)."""
        assert self._client is not None
        ok = False
        for url in (f"{ep.root}/health", f"{ep.url}/models"):
            try:
                if self._client.get(url, timeout=2.0).status_code == 200:
                    ok = True
                    break
            except httpx.HTTPError:
                continue
        with self._lock:
            if ok and not ep.healthy:
                log.info("vLLM endpoint %s is back", ep.url)
            ep.healthy = ok
            ep.probe_at = time.monotonic() + PROBE_EVERY_S
        return ok

    def _served_model(self, ep: _Endpoint) -> str:
        assert self._client is not None
        try:
            data = self._client.get(f"{ep.url}/models", timeout=5.0).json()
            return str(data["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise EngineUnavailable(f"{ep.url}/models: cannot read the served model: {exc}") from exc

    def _kv_tokens(self, ep: _Endpoint) -> int | None:
        """The endpoint's KV-cache size in tokens (vLLM >= 0.26 reports it), or None."""
        try:
            assert self._client is not None
            match = _KV_TOKENS.search(self._client.get(f"{ep.root}/metrics", timeout=2.0).text)
        except httpx.HTTPError:
            return None
        return int(match.group(1)) if match else None

    def _scrape(self, ep: _Endpoint) -> None:
        """``vllm:`` gauges from the endpoint's /metrics, at most every ``METRICS_EVERY_S``."""
        now = time.monotonic()
        if self._client is None or now - ep.scraped_at < METRICS_EVERY_S:
            return
        try:
            text = self._client.get(f"{ep.root}/metrics", timeout=1.0).text
        except httpx.HTTPError:
            return
        values = parse_metrics(text)
        ep.scraped_at = now
        ep.waiting = int(values.get("vllm:num_requests_waiting", 0))
        ep.kv_usage = values.get("vllm:kv_cache_usage_perc")
        preempted = values.get("vllm:num_preemptions_total", values.get("vllm:num_preemptions"))
        ep.preemptions = None if preempted is None else int(preempted)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each ``vllm:`` sample over its labels, from Prometheus text format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values
