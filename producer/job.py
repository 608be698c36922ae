"""A handle on one job: its counts, its export marker, waiting for either, and its results.

    job = client.job("invoices-2026-11")     # or what ``Client.submit`` returned
    job.wait_export()
    for result in job.results(): ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ocrq import keys
from ocrq.jobs.index import JobIndex, finished
from ocrq.output.export import results as export_results
from ocrq.results import ImageRecord, ImageResult
from ocrq.store.storage import ResultStore
from producer.errors import UnknownJob
from producer.intake import IntakePlan

__all__ = ["Job", "JobSource", "UnknownJob"]


class JobSource(Protocol):
    """What a job handle reads through (``producer.client.Client``)."""

    redis: Any
    index: JobIndex

    @property
    def store(self) -> ResultStore: ...

    def cancel(self, job: str) -> dict[str, int]: ...


class Job:
    def __init__(self, client: JobSource, name: str, published: int = 0, plan: IntakePlan | None = None,
                 resumed: bool = False) -> None:
        self.client = client
        self.name = name
        #: images the submit that returned this handle added to the job (or, republishing, sent
        #: again); 0 for an existing job
        self.published = published
        #: the submit found this submission already there (resumed or repeated it)
        self.resumed = resumed
        #: what the submit accepted, skipped and refused (None for an existing job)
        self.plan = plan

    def export_marker(self) -> dict[str, Any] | None:
        """The job's ``_SUCCESS`` marker (files, lines, counts) once its export is written."""
        doc = self.client.store.get_json(keys.export_object(self.name, keys.EXPORT_SUCCESS))
        return doc if isinstance(doc, dict) else None

    def wait_export(self, timeout: float | None = None, poll: float = 0.5) -> dict[str, Any]:
        """Wait until every image is final and the export's ``_SUCCESS`` marker is written."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (marker := self.export_marker()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name}: no {keys.EXPORT_SUCCESS} yet")
            time.sleep(poll)
        return marker

    def status(self) -> dict[str, int]:
        """Counts per status plus ``total`` and ``cached`` (exact, from the job index)."""
        return self.client.index.counts(self.name)

    def cancel(self) -> dict[str, int]:
        """Cancel the job (``Client.cancel``): what has not started never runs; its counts."""
        return self.client.cancel(self.name)

    def cancelled(self) -> bool:
        return self.client.index.cancelled_at(self.name) is not None

    def submitting(self) -> bool:
        """Whether a producer is writing a submission of this job (it cannot finish meanwhile)."""
        return bool(self.client.redis.exists(keys.job_submitting(self.name)))

    def finished(self) -> bool:
        return finished(self.status())

    def wait(self, timeout: float | None = None, poll: float = 0.5,
             on_progress: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            counts = self.status()
            if on_progress:
                on_progress(counts)
            if finished(counts):
                return counts
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.name}: {counts}")
            time.sleep(poll)

    def records(self) -> Iterator[ImageRecord]:
        """Every image's record (``results()`` without the outputs)."""
        return (r.record for r in self.results())

    def results(self, batch: int = 512, skip: Callable[[str], bool] | None = None) -> Iterator[ImageResult]:
        """Every image of the job: finished ones with their stored document, others as records.
        Documents are read ``batch`` at a time (one store ``get_many``); ``skip(image id)``: images
        left out before their documents are read (a reader following the job)."""
        return export_results(self.client.index, self.client.store, self.name, batch, skip=skip)
