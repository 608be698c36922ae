"""Step 4: every page that missed the cache goes to the engine loop in one hand-off for the chunk
(its governor forms the micro-batches), then one wait for all of them, bounded by the chunk's
deadline: the threads pool has no Celery time limits, so an image still in the engine then is
retried, and its retry joins the same in-flight future. The same content already in flight (in
this chunk or another) runs the engine once (``WorkerContext.submit_once_many``): the others
share its outputs."""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

from ocrq.errors import EngineTimeout, OcrqError, classify
from ocrq.results import OcrOutput
from worker.chunk.attempt import Attempt, UnitId, frozen
from worker.chunk.needs import Worker
from worker.engines.base import OcrRequest
from worker.loop.intake import Intake


def infer(ctx: Worker, attempt: Attempt, intake: Intake) -> Attempt:
    """The attempt with the engine's outputs of its units that missed (``computed``), those
    another request ran (``shared``), or the images that failed there."""
    chunk = attempt.chunk
    deadline = attempt.started + ctx.settings.queue.time_limit
    todo = [(i, n, unit) for i, n, unit in attempt.units() if unit.cache_key not in attempt.hits
            and i not in attempt.errors]
    to_run = [(i, n, unit.cache_key, k, pg) for i, n, unit in todo for k, pg in enumerate(unit.pages)]
    submitted = ctx.submit_once_many([
        (f"{key}#{k}", OcrRequest(f"{i}#{pg.index}", pg.image, *chunk.spec(attempt.images[i].item),
                                   priority=chunk.priority))
        for i, _, key, k, pg in to_run])
    intake.close()
    pending: dict[UnitId, list[Future[OcrOutput]]] = {(i, n): [] for i, n, _ in todo}
    # same content already in flight (here or in another chunk): the engine runs once, the rest are hits
    all_shared = dict.fromkeys(pending, True)
    for (i, n, _, _, _), (fut, was_shared) in zip(to_run, submitted, strict=True):
        pending[(i, n)].append(fut)
        all_shared[(i, n)] = all_shared[(i, n)] and was_shared
    if ctx.progress is not None:  # each image as the engine finishes it, for those following the job
        by_image: dict[str, list[Future[OcrOutput]]] = {}
        for unit_id, futures in pending.items():
            if not all_shared[unit_id]:
                by_image.setdefault(unit_id[0], []).extend(futures)
        ctx.progress.watch(chunk.job, by_image.values())
    # one wake-up when the chunk's last page is done (not one per engine batch: with batches of 4,
    # the thread slept and woke for every 4 images)
    wait([f for futures in pending.values() for f in futures], timeout=max(0.0, deadline - time.monotonic()))
    computed, errors = _outputs(ctx, attempt, pending, deadline)
    return replace(attempt, computed=frozen(computed), shared=frozenset(u for u, was in all_shared.items() if was),
                   engine_units=len(pending), errors=attempt.failed(errors))


def _outputs(ctx: Worker, attempt: Attempt, pending: dict[UnitId, list[Future[OcrOutput]]],
             deadline: float) -> tuple[dict[UnitId, list[OcrOutput]], dict[str, OcrqError]]:
    """Each unit's outputs as its image's pages, or the image's error (one page failing fails
    the document)."""
    computed: dict[UnitId, list[OcrOutput]] = {}
    errors: dict[str, OcrqError] = {}
    for (item_id, n), page_futures in pending.items():
        if item_id in errors:  # another page of this document already failed
            continue
        try:
            computed[(item_id, n)] = [
                on_page(f.result(timeout=max(0.0, deadline - time.monotonic())), pg.index)
                for f, pg in zip(page_futures, attempt.images[item_id].units[n].pages, strict=True)
            ]
        except FutureTimeout:
            errors[item_id] = EngineTimeout(f"no engine result within {ctx.settings.queue.time_limit}s")
        except Exception as exc:
            errors[item_id] = classify(exc)
    return computed, errors


def on_page(output: OcrOutput, page: int) -> OcrOutput:
    """The engine's output as page ``page`` of its image (copied only when the index differs:
    a shared in-flight future's output is never mutated)."""
    return output if output.page == page else output.model_copy(update={"page": page})
