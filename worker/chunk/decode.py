"""Step 3: the plain images that missed the cache decoded, in the fetch pool and through the
isolated decoder (worker.decoding.decode: a few batches per chunk, one round trip to a child per
batch instead of one per image); a bad image fails here, typed. A hit is never decoded. Every
plain image's fetched bytes are let go here: the attempt after this step holds pages only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ocrq.errors import OcrqError, classify
from worker.chunk.attempt import Attempt, Fetched, Unit, frozen
from worker.chunk.fanout import fan_out
from worker.chunk.fetch import decode_bytes
from worker.chunk.needs import Worker
from worker.decoding.page import Page


def decode(ctx: Worker, attempt: Attempt) -> Attempt:
    """The attempt with its missed plain images decoded (their unit's ``pages``), or failed."""
    misses = [im for im in attempt.images.values() if not im.document and im.units[0].cache_key not in attempt.hits]
    outcomes = decode_many(ctx, [im.data for im in misses])
    pages = {im.item.id: got for im, got in zip(misses, outcomes, strict=True) if not isinstance(got, Exception)}
    errors: dict[str, OcrqError] = {im.item.id: classify(got) for im, got in zip(misses, outcomes, strict=True)
                                    if isinstance(got, Exception)}
    images = {image_id: _decoded(im, pages.get(image_id)) for image_id, im in attempt.images.items()}
    return replace(attempt, images=frozen(images), decoded=len(misses), errors=attempt.failed(errors))


def _decoded(image: Fetched, pages: list[Page] | None) -> Fetched:
    """``image`` without its bytes, with its pages when it was decoded (a PDF: as it was)."""
    if image.document:
        return image
    units = (Unit(image.units[0].cache_key, tuple(pages)),) if pages is not None else image.units
    return replace(image, units=units, data=b"")


def decode_many(ctx: Worker, datas: Sequence[bytes]) -> list[list[Page] | Exception]:
    """Each image's pages, or the error it failed with.

    The images go to the decoder in ``decoder.parallelism`` groups, each one ``decode_many``
    call in the fetch pool: with isolation, one round trip to a child per group instead of one
    per image."""
    decoder = ctx.decoder
    if decoder is None:
        return fan_out(ctx.fetch_pool, ctx.settings.limits.fetch_threads, lambda data: decode_bytes(ctx, data), datas)
    n = min(decoder.parallelism, len(datas))
    groups = [datas[g::n] for g in range(n)]
    outcomes = fan_out(ctx.fetch_pool, n, decoder.decode_many, groups)
    out: list[list[Page] | Exception] = [ValueError("not decoded")] * len(datas)
    for g, got in enumerate(outcomes):
        for k in range(len(groups[g])):
            out[g + k * n] = got if isinstance(got, Exception) else got[k]  # a whole group's failure: each image's
    return out
