"""One typed settings object per process: defaults < YAML profile < OCRQ_* env vars < arguments.

The YAML profile is chosen with ``OCRQ_CONFIG=configs/gpu-vllm.yaml`` (or ``--config``); nested
fields are set from the environment with a double underscore, e.g. ``OCRQ_ENGINE__KIND=vllm``,
``OCRQ_STORE__BUCKET=ocr``. Built once in ``main`` and passed down; nothing reads it globally.

Unknown names are errors: an ``OCRQ_*`` variable or YAML key that names no setting, or a profile
that does not exist, raises ``SettingsError`` naming the nearest valid name; ``load_settings``
turns a bad value into one line naming the setting, its value, its source and its choices
(ocrq.settings_check, which also lists the ``OCRQ_*`` variables that are not settings).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)
from pydantic_settings import SettingsError as SourceError

from ocrq.engine_registry import engine_settings
from ocrq.engine_settings import (  # noqa: F401  (ocrq.settings names every settings class)
    EngineSettings,
    HunyuanSettings,
    RapidOcrSettings,
    SimulatedSettings,
    TransformersSettings,
    VllmServerSettings,
    VllmSettings,
)
from ocrq.settings_check import SettingsError, check_environment, check_profile, explain

__all__ = ["Settings", "SettingsError", "load_settings"]


class _Section(BaseModel):
    # a key no setting has is an error naming the nearest one (ocrq.settings_check), not ignored
    model_config = ConfigDict(extra="forbid")


class RedisSettings(_Section):
    #: broker, result backend and ocrq's own keys; redis://:password@host:6379/0 or rediss:// for TLS.
    #: Sentinel, in Celery's format: sentinel://:password@h1:26379/0;sentinel://h2:26379/0 (the
    #: password is the Redis servers', ``sentinel_password`` the Sentinels'); every client ocrq
    #: opens then follows the master Sentinel names (ocrq.broker.redis_conn)
    url: str = "redis://127.0.0.1:6379/0"
    #: Sentinel: the name of the monitored master (``sentinel monitor NAME ...``)
    master_name: str = "ocrq"
    #: Sentinel: the Sentinels' own password (``requirepass`` in sentinel.conf), if any
    sentinel_password: SecretStr | None = None
    #: Sentinel: TLS to the Sentinels and to the Redis servers they name
    sentinel_tls: bool = False
    #: Sentinel with TLS: the CA file that signed their certificates (None: the system's)
    sentinel_tls_ca: Path | None = None
    #: Sentinel: the master name of the hot cache's Redis when ``cache_url`` is a Sentinel URL
    #: (None: ``master_name``)
    cache_master_name: str | None = None
    #: replicas that must hold a submission before ``submit`` returns (Redis ``WAIT``; Sentinel
    #: URLs only, 0: none). Replication is asynchronous: a submission acknowledged by the master
    #: alone is lost if the master dies before it replicated (docs/reliability.md, "Failover")
    ack_replicas: int = Field(default=1, ge=0)
    #: milliseconds ``WAIT`` gives the replicas before the submission is written again
    ack_timeout_ms: int = Field(default=5000, ge=1)
    #: seconds a delivered-but-unacked message stays invisible before Redis hands it to another
    #: worker. Must exceed the longest chunk (64 refs on a slow engine) plus retry countdowns.
    visibility_timeout: int = 3600
    #: seconds between sweeps that hand expired unacked messages (a dead worker's) back to the
    #: queue; redelivery after a crash takes visibility_timeout + up to this
    unacked_restore_s: int = 60
    #: a worker that has not refreshed its claim on the messages it holds for this long is dead:
    #: its unacked messages go back to the queue within this + 2 × reaper_interval_s (worker.reaper)
    dead_worker_s: int = 60
    #: seconds between a worker's sweeps for dead workers' messages (an orphan is restored on
    #: the second sweep that finds it unclaimed)
    reaper_interval_s: int = 20
    #: seconds between sweeps for finished jobs without their export (worker.export_sweep; one
    #: worker of the fleet sweeps each time): a job whose last image ended while Redis refused
    #: writes or was away gets its export asked for again
    export_sweep_s: float = Field(default=30.0, gt=0)
    #: a job's export asked for this long ago and still not written (a finish message lost with a
    #: worker, or given up) is asked for again by the sweep (a duplicate export is harmless)
    export_stale_s: float = Field(default=900.0, gt=0)
    #: TTL of hot cache entries in Redis (the durable copy lives in the store)
    cache_ttl: int = 7 * 24 * 3600
    #: where the hot cache lives (None: on ``url``, beside the broker). A Redis of its own for
    #: it runs with ``maxmemory-policy allkeys-lru`` (``ocrq up`` and docker-compose.yml do so)
    cache_url: str | None = None
    #: bytes the hot cache may hold, wherever it lives (worker.cache enforces it: two generations
    #: of at most half each); 0 turns it off (every cache lookup reads the store)
    cache_max_bytes: int = Field(default=64 * 1024 * 1024, ge=0)
    #: TTL of job indexes and image summaries
    job_ttl: int = 30 * 24 * 3600
    #: ``maxmemory`` of the broker Redis ``ocrq up`` starts (policy noeviction: at its limit Redis
    #: refuses writes rather than drop a message); alert at 80 % (ops/alerts.yml)
    max_memory: int = Field(default=1024 * 1024 * 1024, ge=0)
    #: a submission is refused (``ocrq submit`` exits 2) while the broker Redis holds this share
    #: of its ``maxmemory`` or more, so running jobs keep room to finish
    refuse_submit_at: float = Field(default=0.9, gt=0, le=1)


class StoreSettings(_Section):
    kind: Literal["local", "s3"] = "local"
    #: local store root (embedded default); unset: ``{var_dir}/store``
    path: Path = Path("var/store")
    bucket: str = "ocrq"
    #: every object ocrq writes lives under this prefix (see ocrq.keys)
    prefix: str = "ocrq/"
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    #: dollars per 1,000 PUT (and LIST) and per 1,000 GET requests: `ocrq status JOB` turns the
    #: job's store requests into cost (S3 Standard list prices)
    put_usd_per_1000: float = 0.005
    get_usd_per_1000: float = 0.0004


class LimitSettings(_Section):
    #: bytes fetched per reference before it is refused as TooLarge
    max_bytes: int = 50 * 1024 * 1024
    #: decoded pixels above this are downscaled (keeping aspect) before OCR
    max_pixels: int = 2048 * 2048
    #: decoded pixels above this are refused outright (decompression-bomb guard)
    bomb_pixels: int = 180_000_000
    #: multi-frame images: frames beyond this are ignored (recorded in meta); a PDF with more
    #: pages than this fails with TooLarge (split it, or raise the cap)
    max_pages: int = 64
    #: a PDF's pages are rendered at this resolution (each page then kept within max_pixels)
    pdf_dpi: int = 200
    #: pixels of all pages of one document together: a PDF's rendered pages (host memory: 3
    #: bytes each), a multi-frame image's frames as stored (what decoding them costs); over it
    #: the document fails TooLarge
    max_document_pixels: int = 256_000_000
    #: local references must resolve inside one of these roots (empty: the current directory of
    #: a worker; a producer with none checks against the roots its live workers report)
    allowed_roots: list[Path] = Field(default_factory=list)
    #: buckets s3:// references may read (empty: any bucket the credentials can read)
    s3_buckets: list[str] = Field(default_factory=list)
    #: schemes a reference may use (``store``: inline images ocrq wrote to its own store,
    #: ``store:inputs/{job}/{sha256}``, from the ``data:`` URIs of OpenAI Batch lines)
    allowed_schemes: list[str] = Field(default_factory=lambda: ["file", "s3", "http", "https", "store"])
    http_timeout: float = 20.0
    #: http(s) refs may point at loopback/private/link-local addresses (cloud metadata, internal
    #: services): off by default, so submitting a URL cannot make workers probe the network
    http_allow_private: bool = False
    http_max_redirects: int = 3
    #: threads that fetch + decode + hash ahead of the engine
    fetch_threads: int = 8
    #: decode each image in a supervised child process (worker.decoding.decode): a decoder that crashes
    #: or hangs fails that image with DecoderCrashed instead of killing the worker
    decode_isolation: bool = True
    #: decoding children per worker (0: min(fetch_threads, CPU count))
    decode_processes: int = 0
    #: seconds one image may decode before its child is killed (DecoderCrashed)
    decode_timeout_s: float = 60.0
    #: bytes of address space each decoding child may map (RLIMIT_AS, worker.decoding.decode): an
    #: image whose decoding needs more fails TooLarge and its child is replaced. Fits what the
    #: other caps admit (a bomb_pixels RGB image, a PDF's pages up to max_document_pixels); the
    #: host's worst case is decode_processes times this. 0: no limit (decode_isolation only)
    decode_memory_bytes: int = Field(default=1536 * 1024 * 1024, ge=0)
    #: CPU seconds one image may take in its decoding child (RLIMIT_CPU, reset per image): past
    #: it the child is killed, replaced, and the image fails TooLarge (permanent: the same bytes
    #: take the same CPU again). 0: no limit (decode_isolation only)
    decode_cpu_s: float = Field(default=30.0, ge=0)
    #: TESTS ONLY: bytes containing worker.decoding.decode.FAULT_ABORT / FAULT_HANG / FAULT_SLOW /
    #: FAULT_SPIN abort / hang / slow down / burn CPU in the decoder (the chaos suite's crashing
    #: files); never enable in production
    decode_fault_markers: bool = False


class BatchSettings(_Section):
    #: "fixed": batches of ``size``; "auto": the VRAM governor sizes them by cost
    mode: Literal["fixed", "auto"] = "fixed"
    size: int = 4
    #: hard cap on images per batch in auto mode
    max_size: int = 128
    #: fraction of device memory kept free in auto mode
    headroom: float = 0.10
    #: wait this long for more images before running a partial batch
    linger_ms: int = 20
    #: an idle engine waits up to this long for images the worker already holds but is still
    #: fetching and decoding, while the next batch has room for them (one big batch, not a
    #: small one now and the rest a batch later)
    intake_wait_ms: int = 500
    #: in-process retries of a batch after OOM (bisecting) before the image is handed to Celery
    oom_retries: int = 3
    #: cap the governor may impose (bytes); None: whole device
    memory_cap_bytes: int | None = None


class QueueSettings(_Section):
    #: default queue; route GPU classes with --queues on the worker
    name: str = "ocrq"
    #: references per broker message for bulk submissions
    chunk_size: int = 64
    #: a chunk message larger than this (JSON bytes) is refused: by the producer with TooLarge
    #: before anything is recorded, by the worker (a message from elsewhere) by failing its
    #: images with TooLarge. Refs are capped at ocrq.refs.MAX_REF_CHARS and params at a quarter
    #: of this, so a default chunk always fits
    max_message_bytes: int = 1024 * 1024
    #: images of one job in flight at most (in messages, or a worker on them): a submission's
    #: refs wait in the store and the workers feed them in shards of 4,096 as the queue drains
    #: (ocrq.jobs.feed), so Redis holds this many refs per job, whatever the submission's size. Keep
    #: it above what the fleet's workers reserve (prefetch × chunk_size each)
    window: int = Field(default=65_536, ge=8192)
    #: chunk tasks a worker runs at once (threads pool); they share one engine loop
    concurrency: int = 4
    #: attempts per image (first + retries) before it fails with RetriesExhausted
    max_attempts: int = 4
    backoff_base: float = 2.0
    backoff_max: float = 300.0
    #: a chunk that fails as a whole on a retryable error (ocrq's own store or Redis away, not the
    #: image) goes back without spending its images' attempts, for up to this long, waiting about
    #: as long as the outage has lasted (≥ backoff_base, ≤ backoff_max) between tries; past it,
    #: attempts count again and the images end as RetriesExhausted naming the outage
    outage_retry_s: float = 3600.0
    #: seconds a chunk attempt waits for engine results; images still unfinished then are
    #: retried as EngineTimeout (Celery's own time limits do not apply to the threads pool)
    time_limit: int = 1800


class TenantSettings(_Section):
    """One tenant of the HTTP API (``ocrq serve``): its tokens, limits and webhooks."""

    #: sha256 (hex) of each of the tenant's bearer tokens (``ocrq token create`` makes one and
    #: writes its digest to ``api.tenants_file``; a token itself is never stored)
    tokens: list[str] = Field(default_factory=list)
    #: signs the tenant's webhooks (Standard Webhooks, ``whsec_…``; ``ocrq token create`` makes one)
    webhook_secret: SecretStr | None = None
    #: where the tenant's job and batch events go when a job names no ``webhook_url``
    webhook_url: str | None = None
    #: images of the tenant's jobs not yet final, at most: a submission past it is refused (429)
    max_in_flight: int = Field(default=1_000_000, ge=1)
    #: API requests a second, across every ``ocrq serve`` replica (429 with Retry-After past it)
    requests_per_s: float = Field(default=50.0, gt=0)
    #: what refs the tenant's jobs may name. None: for the default tenant, what ``limits`` allows
    #: (the CLI's rules); for any other, http(s) URLs only (no local files, no S3 read with the
    #: fleet's credentials), unless set here
    allowed_schemes: list[str] | None = None
    #: buckets the tenant's ``s3://`` refs may read (None: the fleet's ``limits.s3_buckets``)
    s3_buckets: list[str] | None = None
    #: local roots the tenant's paths must lie in (None: the fleet's ``limits.allowed_roots``)
    allowed_roots: list[Path] | None = None


class ApiSettings(_Section):
    """``ocrq serve``: the HTTP API (jobs, OpenAI Files and Batches, webhooks) and the jobs page."""

    #: address and port it listens on (``ocrq up`` starts one on these)
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: tenants by name (``ocrq.names``), merged with those of ``tenants_file``
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    #: what ``ocrq token create`` writes (JSON, mode 0600) and every replica reads again when it
    #: changes; None: ``{var_dir}/api-tenants.json``
    tenants_file: Path | None = None
    #: seconds between a webhook's attempts after the first (Standard Webhooks' schedule, ~27 h
    #: in all); past the last it is given up, each attempt listed in the job's deliveries
    webhook_retry_s: list[float] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0])
    #: seconds a webhook receiver has to answer one attempt
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    #: webhook hosts let through although they resolve to private addresses (an internal receiver)
    webhook_allow_hosts: list[str] = Field(default_factory=list)
    #: this replica delivers webhooks (any number may: each event is claimed by one at a time)
    deliver_webhooks: bool = True
    #: how long an Idempotency-Key is remembered
    idempotency_ttl_s: int = Field(default=86_400, ge=60)
    #: the largest upload (a manifest, an OpenAI Batch file) accepted, in bytes (413 past it)
    max_upload_bytes: int = Field(default=2 * 1024**3, ge=1)
    #: one log line per request (uvicorn's access log; off: a busy poller's lines cost CPU)
    access_log: bool = False
    #: the jobs page's login cookie is sent over HTTPS only (None: when the request came over
    #: HTTPS, or through a proxy that says so)
    cookie_secure: bool | None = None
    #: where the jobs page's fleet view links to Flower (the Celery tasks) and Prometheus; None:
    #: no link (credentials in a URL are never shown)
    flower_url: str | None = None
    prometheus_url: str | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="OCRQ_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    #: the class of ``engine.kind`` (``ocrq.engine_settings``): each engine's own settings
    engine: SerializeAsAny[EngineSettings] = Field(default_factory=RapidOcrSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    #: where `ocrq up` keeps pids, logs, the embedded Redis data and the local store
    var_dir: Path = Path("var")
    log_level: str = "INFO"
    #: Flower port for `ocrq up`
    flower_port: int = 5555
    #: Flower basic auth "user:pass" (comma-separate several). Unset: `ocrq up` generates a
    #: password into {var_dir}/flower-auth (mode 0600); Flower never runs unauthenticated
    flower_basic_auth: SecretStr | None = None
    #: tasks Flower keeps in memory (oldest dropped first): bounds its RSS on a busy fleet
    flower_max_tasks: int = 10_000
    #: each worker serves its Prometheus /metrics here (0: off); one port per worker process
    metrics_port: int = 9809
    #: address the worker's metrics server binds: loopback unless set (a deployment scraped from
    #: elsewhere sets it: docker-compose.yml sets 0.0.0.0 inside its network)
    metrics_addr: str = "127.0.0.1"
    #: HTTP basic auth "user:pass" (comma-separate several) for every /metrics ocrq serves (each
    #: worker's, `ocrq metrics`); unset: open to whoever reaches metrics_addr
    metrics_basic_auth: SecretStr | None = None
    #: price of one GPU-hour in dollars: `ocrq status JOB` turns a GPU engine's seconds into cost
    gpu_hour_usd: float = Field(default=2.50, ge=0)
    #: price of one hour of a CPU worker's host in dollars (RapidOCR, or an engine on a CPU):
    #: `ocrq status JOB` turns a CPU engine's seconds into cost
    cpu_hour_usd: float = Field(default=0.10, ge=0)
    #: the HTTP API, ``ocrq serve``
    api: ApiSettings = Field(default_factory=ApiSettings)

    @field_validator("engine", mode="wrap")
    @classmethod
    def _engine_of_its_kind(cls, value: Any, handler: Any) -> Any:
        # a mapping (YAML, OCRQ_ENGINE__*, keywords) becomes the class its kind names
        if isinstance(value, Mapping):
            return engine_settings(value)
        return handler(value)

    @model_validator(mode="after")
    def _store_under_var_dir(self) -> Settings:
        # the local store lives with the rest of the stack's files unless a path was given; still
        # "not given" afterwards, so a producer can take the live workers' path instead
        if "path" not in self.store.model_fields_set:
            self.store.path = self.var_dir / "store"
            self.store.model_fields_set.discard("path")
        return self

    @model_validator(mode="after")
    def _embedded_redis_password(self) -> Settings:
        # a Redis `ocrq up` started has the password it generated (ocrq_cli.embedded.stack): a URL naming that
        # server without one takes it from {var_dir}/redis-auth (mode 0600), so every command run
        # beside the stack (or with OCRQ_VAR_DIR) reaches it, and none prints it
        for field in ("url", "cache_url"):
            url = getattr(self.redis, field)
            if url and "@" not in url.partition("?")[0] and (found := embedded_url(self.var_dir, url)):
                setattr(self.redis, field, found)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        check_environment(os.environ, settings_cls)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        profile = _profile()
        if profile:
            check_profile(profile, "OCRQ_CONFIG or --config")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=profile))
        return tuple(sources)


#: where ``ocrq up`` keeps the URLs (with their generated passwords) of the Redis servers it
#: started, one a line, mode 0600 (ocrq_cli.embedded.stack)
REDIS_AUTH_FILE = "redis-auth"


def embedded_url(var_dir: Path, url: str) -> str | None:
    """The URL with its password that ``ocrq up`` recorded under ``var_dir`` for the server
    ``url`` names (same scheme, host, port and database), or None."""
    path = var_dir / REDIS_AUTH_FILE
    try:
        lines = path.read_text().split()
    except OSError:  # none, or not ours to read
        return None
    want = _without_userinfo(url)
    return next((line for line in lines if _without_userinfo(line) == want), None)


def _without_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    head, slash, tail = rest.partition("/")
    return scheme + sep + head.rpartition("@")[2] + slash + tail


#: the profile ``load_settings`` was given, for the settings source above: passed this way, not
#: through ``os.environ``, so building settings never changes the process's environment
_PROFILE: ContextVar[str | None] = ContextVar("ocrq_profile", default=None)


def _profile() -> str | None:
    return _PROFILE.get() or os.environ.get("OCRQ_CONFIG") or None


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the process's settings; ``config`` names a YAML profile (else ``$OCRQ_CONFIG``).
    The environment is left as it is. ``SettingsError`` (one line per problem) for an unknown
    name, a missing profile or a bad value."""
    import yaml

    token = _PROFILE.set(str(config) if config is not None else None)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        profile = _profile()
        data = None
        if profile:
            try:
                data = yaml.safe_load(Path(profile).read_text())
            except (OSError, yaml.YAMLError):
                data = None
        raise explain(exc, Settings, os.environ, profile, data if isinstance(data, dict) else None) from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"settings profile {_profile()} is not valid YAML: {' '.join(str(exc).split())}") from None
    except SourceError as exc:  # a section or list from the environment that is not JSON
        raise SettingsError(f"{exc}: a list or section set from the environment takes JSON, e.g. "
                            """OCRQ_LIMITS__ALLOWED_ROOTS='["/data"]'""") from None
    finally:
        _PROFILE.reset(token)
