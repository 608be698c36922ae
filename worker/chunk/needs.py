"""What a chunk's steps need of the worker process, as protocols: ``worker.context.WorkerContext``
is one. The steps see these members and nothing else of the worker (so worker/chunk/ imports
nothing of the folder above it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from ocrq.jobs.index import JobIndex
from ocrq.results import ImageRecord, OcrOutput
from ocrq.settings import Settings
from ocrq.store.storage import ResultStore
from worker.decoding.decode import Decoder
from worker.engines.base import Engine, OcrRequest


class Cache(Protocol):
    """The image-hash cache (worker.cache.ResultCache)."""

    def get_many(self, cache_keys: Sequence[str], reads: list[int] | None = None) -> dict[str, list[OcrOutput]]: ...

    def encode(self, entries: Mapping[str, list[OcrOutput]]) -> dict[str, bytes]: ...

    def durable_writes(self, encoded: Mapping[str, bytes]) -> list[tuple[str, Any]]: ...

    def warm(self, encoded: Mapping[str, bytes]) -> None: ...


class Metrics(Protocol):
    """What the steps count (worker.metrics.WorkerMetrics)."""

    def observe_cache(self, hits: int, misses: int) -> None: ...

    def observe_records(self, task: str, records: Iterable[ImageRecord], seconds: float | None = None) -> None: ...


class Progress(Protocol):
    """Per-job progress between records (worker.progress.ProgressCounter)."""

    def watch(self, job: str, images: Iterable[list[Future[Any]]]) -> None: ...

    def recorded(self, job: str, n: int) -> None: ...


class Worker(Protocol):
    """The worker process, as one attempt at a chunk uses it."""

    @property
    def settings(self) -> Settings: ...

    @property
    def hostname(self) -> str | None: ...

    @property
    def s3_client(self) -> Any: ...

    @property
    def store(self) -> ResultStore: ...

    @property
    def cache(self) -> Cache: ...

    @property
    def index(self) -> JobIndex: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def fetch_pool(self) -> Executor: ...

    @property
    def decoder(self) -> Decoder | None: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def progress(self) -> Progress | None: ...

    def capabilities(self) -> dict[str, Any]: ...

    def submit_once_many(self, pages: list[tuple[str, OcrRequest]]) -> list[tuple[Future[OcrOutput], bool]]: ...
