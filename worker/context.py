"""Everything a worker process holds: built once from settings in ``build_context`` (never at
import time), shared by the chunk tasks running in the threads pool."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from ocrq import keys
from ocrq.broker import redis_conn
from ocrq.capabilities import capabilities
from ocrq.engine_registry import ENGINES, engine_kind
from ocrq.engine_settings import EngineSettings, VllmSettings
from ocrq.jobs.index import JobIndex
from ocrq.results import OcrOutput
from ocrq.settings import BatchSettings, Settings
from ocrq.store.storage import ResultStore, make_s3_client, make_store
from worker.cache import ResultCache
from worker.decoding.decode import Decoder, make_decoder
from worker.engines.base import Capacity, Engine, KvCapacity, KvGated, OcrRequest, Profiled, StartsInPhases
from worker.memory.costs import ModelProfile
from worker.metrics import WorkerMetrics
from worker.progress import ProgressCounter
from worker.startup import StartupClock

if TYPE_CHECKING:
    from worker.export_sweep import ExportSweeper
    from worker.feeder import Feeder
    from worker.governor.governor import Governor
    from worker.memory.nvml import MemoryProbe

log = logging.getLogger("ocrq.worker")


@dataclass
class WorkerContext:
    settings: Settings
    redis: Any
    s3_client: Any
    store: ResultStore
    cache: ResultCache
    index: JobIndex
    engine: Engine
    loop: Any  # worker.loop.engine_loop.EngineLoop
    fetch_pool: ThreadPoolExecutor
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    #: decodes fetched bytes into pages (worker.decoding.decode; None: in the calling thread)
    decoder: Decoder | None = None
    #: Redis key of this worker's governor snapshot (None: fixed batches, nothing to learn)
    governor_key: str | None = None
    #: feeds the queue from submission shards (worker.feeder; set once the Celery app exists)
    feeder: Feeder | None = None
    #: asks again for the export of finished jobs that lack it (worker.export_sweep)
    sweeper: ExportSweeper | None = None
    #: where the worker's start went, phase by phase (worker.startup)
    startup: StartupClock = field(default_factory=StartupClock)
    #: "gpu" when the engine runs on the GPU this process was given, else "cpu"
    device: str = "cpu"
    #: per-job progress between chunk records (worker.progress; None: not published)
    progress: ProgressCounter | None = None
    #: this worker's Celery node name (``worker@host``), as its records name it
    hostname: str | None = None
    _inflight: dict[str, Future[OcrOutput]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit_once(self, key: str, request: OcrRequest) -> tuple[Future[OcrOutput], bool]:
        """Send a page to the engine loop unless the same content is already in flight here
        (two refs with the same bytes in flight at once run the engine once). Returns the
        future and whether it was shared (the engine did not run for this request)."""
        return self.submit_once_many([(key, request)])[0]

    def submit_once_many(self, pages: list[tuple[str, OcrRequest]]) -> list[tuple[Future[OcrOutput], bool]]:
        """``submit_once`` for a chunk's pages at once: one hand-off to the engine loop (one
        wake-up of its thread) instead of one per page. A key twice in ``pages`` runs once."""
        new_keys: list[str] = []
        new_requests: list[OcrRequest] = []
        slots: list[tuple[Future[OcrOutput] | None, int, bool]] = []  # (in-flight future | new index, shared)
        with self._lock:
            first: dict[str, int] = {}
            for key, request in pages:
                fut = self._inflight.get(key)
                if fut is not None:
                    slots.append((fut, -1, True))
                elif key in first:
                    slots.append((None, first[key], True))
                else:
                    first[key] = len(new_requests)
                    new_keys.append(key)
                    new_requests.append(request)
                    slots.append((None, first[key], False))
            futures = self.loop.submit_many(new_requests) if new_requests else []
            self._inflight.update(zip(new_keys, futures, strict=True))
        for key, fut in zip(new_keys, futures, strict=True):
            fut.add_done_callback(lambda _f, k=key: self._forget(k))
        return [(fut if fut is not None else futures[j], shared) for fut, j, shared in slots]

    def _forget(self, key: str) -> None:
        with self._lock:
            self._inflight.pop(key, None)

    def capabilities(self) -> dict[str, Any]:
        """What this worker's engine honours (ocrq.capabilities), as its state publishes it."""
        return capabilities(self.settings.engine.kind, self.device)

    def close(self) -> None:
        if self.feeder is not None:
            self.feeder.stop()
        if self.progress is not None:
            self.progress.stop()
        if self.sweeper is not None:
            self.sweeper.stop()
        self.metrics.close()
        self.loop.stop(timeout=30)
        self.engine.close()
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)
        if self.decoder is not None:
            self.decoder.close()


def build_context(settings: Settings, queues: list[str] | None = None,
                  startup: StartupClock | None = None, hostname: str | None = None) -> WorkerContext:
    """The engine starts on a thread of its own, and what does not depend on it is made while it
    builds: the clients (Redis, store, S3, the decoder's processes, metrics), on this thread, or for
    vLLM in the warm-up's thread once vLLM's engine core is building (this process then only waits
    for it; a client made on another thread meanwhile would slow vLLM's import, both holding the
    GIL), with the worker's first garbage collection. The governor and the engine loop follow the
    engine, whose capacity they plan with."""
    from worker.engine_kinds import build_engine

    engine = build_engine(engine_settings_of(settings))
    log.info("engine %s starting", settings.engine.kind)
    startup = startup or StartupClock()
    made: list[tuple[_Clients, float]] = []

    def make_clients() -> None:
        t0 = time.perf_counter()
        made.append((_Clients.make(settings, queues), time.perf_counter() - t0))

    overlaps = isinstance(engine, StartsInPhases)
    if isinstance(engine, StartsInPhases):
        # vLLM: while its core builds and this process waits for it (the GIL free), after the
        # renderer's warm-up: the first full collection and the clients
        from worker import gcwatch

        engine.while_building.extend([gcwatch.freeze, make_clients])
        during = "engine.llm"
    started = _StartEngine(engine)
    if not overlaps:  # any other engine: the clients on this thread meanwhile
        during = "engine"
        try:
            make_clients()
        except BaseException:
            with contextlib.suppress(BaseException):
                started.join()  # never leave a half-built engine running behind a failed start
            engine.close()
            raise
    try:
        started.join()
    except BaseException:
        for clients, _ in made:
            clients.close()
        raise
    engine_s = startup.mark("engine")
    phases = dict(engine.start_phases) if isinstance(engine, StartsInPhases) else {}
    beside = dict(engine.start_beside) if isinstance(engine, StartsInPhases) else {}
    startup.add_detail("engine", phases, path=[p for p in ("import", "llm", "after_llm") if p in phases])
    for name, seconds in beside.items():
        startup.add_beside(f"engine.{name}", seconds, during="engine.llm")
    log.info("engine %s ready in %.1fs: revision %s", engine.name, engine_s, engine.revision)
    if made:
        startup.add_beside("clients", made[0][1], during=during)
    else:  # the core was ready before the warm-up got to them
        make_clients()
        startup.mark("clients")
    return made[0][0].context(settings, engine, queues, startup, hostname)


def engine_settings_of(settings: Settings) -> EngineSettings:
    """The engine's settings as the worker runs it: one memory cap for engine and governor (vLLM
    then claims no more than the governor plans with), vLLM's compile cache under the var dir."""
    engine_settings = settings.engine
    if not isinstance(engine_settings, VllmSettings):
        return engine_settings
    if engine_settings.memory_cap_bytes is None and settings.batch.memory_cap_bytes:
        engine_settings = engine_settings.model_copy(update={"memory_cap_bytes": settings.batch.memory_cap_bytes})
    if engine_settings.kind == "vllm" and engine_settings.compile_cache_dir is None:
        engine_settings = engine_settings.model_copy(
            update={"compile_cache_dir": settings.var_dir / "vllm-cache"})
    return engine_settings


class _StartEngine:
    """``engine.start()`` on a thread; ``join`` re-raises what it raised."""

    def __init__(self, engine: Engine) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine,), name="ocrq-engine-start", daemon=True)
        self._thread.start()

    def _run(self, engine: Engine) -> None:
        try:
            engine.start()
        except BaseException as exc:  # handed to the thread that waits for the engine
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


@dataclass
class _Clients:
    """What a worker makes without its engine, while the engine starts."""

    redis: Any
    s3: Any
    store: ResultStore
    pool: ThreadPoolExecutor
    decoder: Decoder | None
    metrics: WorkerMetrics
    probe: Any

    @classmethod
    def make(cls, settings: Settings, queues: list[str] | None) -> _Clients:
        from worker.memory.nvml import NvmlProbe

        client = redis_conn.client(settings.redis, health_check_interval=30)
        metrics = WorkerMetrics()
        if settings.metrics_port:
            auth = settings.metrics_basic_auth
            metrics.serve(settings.metrics_addr, settings.metrics_port, auth.get_secret_value() if auth else None)
        # one client for s3:// refs and, when store.kind is s3, the result store (no I/O at creation)
        s3 = make_s3_client(settings.store)
        return cls(redis=client, s3=s3, store=make_store(settings.store, s3),
                   pool=ThreadPoolExecutor(settings.limits.fetch_threads, thread_name_prefix="ocrq-fetch"),
                   decoder=make_decoder(settings.limits), metrics=metrics, probe=NvmlProbe.for_current_device())

    def close(self) -> None:
        self.metrics.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.decoder is not None:
            self.decoder.close()

    def context(self, settings: Settings, engine: Engine, queues: list[str] | None,
                startup: StartupClock, hostname: str | None = None) -> WorkerContext:
        """The governor (from the engine's capacity and its saved snapshot) and the engine loop."""
        from worker.loop.engine_loop import EngineLoop
        from worker.memory.nvml import NullProbe

        governor = governor_for(settings.batch, engine, self.probe)
        governor_key = restore_governor(governor, self.redis, settings, engine.revision)
        startup.mark("governor")
        metrics = self.metrics
        loop = EngineLoop(
            engine, governor, self.probe,
            linger_s=settings.batch.linger_ms / 1000, intake_wait_s=settings.batch.intake_wait_ms / 1000,
            oom_retries=settings.batch.oom_retries,
            on_batch=metrics.observe_batch,
        )
        loop.start()
        metrics.watch(loop.state, self.probe, getattr(self.probe, "device", "none"), self.redis,
                      queues or [settings.queue.name], settings.redis)
        device = ("cpu" if engine_kind(settings.engine.kind).device == "cpu" or isinstance(self.probe, NullProbe)
                  else "gpu")
        progress = ProgressCounter(self.redis, settings.engine.kind, device)
        progress.start()
        return WorkerContext(
            settings=settings, redis=self.redis, s3_client=self.s3, store=self.store,
            cache=ResultCache(cache_client(settings, self.redis), self.store, settings.redis.cache_ttl,
                              settings.redis.cache_max_bytes),
            index=JobIndex(self.redis, settings.redis.job_ttl), engine=engine, loop=loop, fetch_pool=self.pool,
            governor_key=governor_key, metrics=metrics, decoder=self.decoder, startup=startup, device=device,
            progress=progress, hostname=hostname,
        )


def cache_client(settings: Settings, broker: Any) -> Any:
    """The client of the Redis that holds the hot cache: ``redis.cache_url``, else the broker's."""
    own = redis_conn.cache_client(settings.redis, health_check_interval=30, socket_timeout=5,
                                  socket_connect_timeout=5)
    return broker if own is None else own


def profile_of(engine: Engine) -> ModelProfile:
    """The engine's ``memory_profile``; engines without one (CPU) get the nominal CPU profile, which
    measured peaks then recalibrate if the engine reports any."""
    if isinstance(engine, Profiled):
        return engine.memory_profile
    row = ENGINES.get(engine.name)
    if row is None or row.device != "cpu":
        log.warning("engine %s has no memory_profile: the governor starts from CPU costs", engine.name)
    return ModelProfile.cpu_default()


def governor_for(batch: BatchSettings, engine: Engine, probe: MemoryProbe | None) -> Governor:
    """The governor for an engine. Reading the engine's profile and what it may use (vLLM: its
    gpu_memory_utilization share and the tokens its KV cache holds) is wiring, so the governor
    itself sees plain numbers and knows no engine."""
    from worker.governor.governor import Governor

    return Governor.from_settings(
        batch, profile_of(engine), probe,
        engine_capacity=engine.capacity_bytes if isinstance(engine, Capacity) else None,
        token_capacity=engine.kv_capacity_tokens if isinstance(engine, KvCapacity) else None,
        kv_gated=isinstance(engine, KvGated) and engine.kv_gated,
    )


def restore_governor(governor: Any, client: Any, settings: Settings, revision: str) -> str | None:
    """Load the snapshot earlier workers saved for this model, engine settings and device size;
    returns the key to save to (None in fixed mode). A missing, unreadable or malformed snapshot
    means a cold start, never a failed worker."""
    if governor.mode != "auto":
        return None
    engine = settings.engine.model_dump(mode="json", exclude={"endpoints", "request_timeout"})
    key = keys.governor_profile(keys.governor_fingerprint(revision, engine, governor.capacity))
    try:
        raw = client.get(key)
        if raw is not None and governor.restore(json.loads(raw)):
            log.info("governor restored from %s: %s batches, limit %s", key,
                     governor.calibrator.observations, governor.count_limit())
    except (redis.RedisError, ValueError) as exc:  # JSONDecodeError is a ValueError
        log.warning("governor snapshot %s ignored: %s", key, exc)
    return key

