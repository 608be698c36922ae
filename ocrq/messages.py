"""The broker message schema (JSON): one message carries a chunk of image references.

Bulk jobs put up to ``queue.chunk_size`` refs in one message (one broker round trip instead of
64); everything after delivery — state, retries, failures, results — is per image. A retry
re-publishes only the items that need it, with their attempt counters.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from ocrq.errors import TooLarge
from ocrq.redact import redact_url

#: Celery task name of the chunk task (the producer sends by name; it never imports the worker)
OCR_CHUNK_TASK = "ocrq.ocr_chunk"
#: Celery task name of the job export (results JSONL/Parquet + _SUCCESS), args: [job]
FINISH_JOB_TASK = "ocrq.finish_job"


class Item(BaseModel):
    #: image id (ocrq.keys.image_id(job, ref))
    id: str
    ref: str
    #: 1 on first delivery; incremented for each retry of this image
    attempt: int = 1
    #: a manifest row's other columns (``id``, ``metadata``, ...), carried into the result as is
    row: dict[str, Any] | None = None
    #: this image's own task and params (an OpenAI Batch line's: ``ocrq.openai_requests``), over
    #: the chunk's; left out of the message when None
    task: str | None = None
    params: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        """The item as its message carries it (no ``task``/``params`` keys unless set)."""
        out = self.model_dump(mode="json")
        for name in ("task", "params"):
            if out[name] is None:
                del out[name]
        return out


#: the OCR tasks (HunyuanOCR's prompts, worker.engines.hunyuan); producers refuse any other
TASKS = ("text", "parse", "spotting", "extract", "translate")


def check_task(task: str) -> None:
    """``ValueError`` for a task no engine knows (what producers refuse before publishing)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")


class Chunk(BaseModel):
    job: str
    #: one of ``TASKS`` (a str, not a Literal: a worker must record a bad one per image, typed)
    task: str = "text"
    params: dict[str, Any] = Field(default_factory=dict)
    items: list[Item]
    #: the job's broker priority (0 = most urgent, as Celery on Redis orders it): the engine loop
    #: also runs a more urgent image first, so a small urgent job does not wait behind the images
    #: a worker already holds for a bulk one
    priority: int = 0
    #: when this chunk first failed as a whole on a retryable error (epoch s; ocrq's store or
    #: Redis away), kept across its hand-backs: the outage, not the images, spends that time
    outage_since: float | None = None

    def to_message(self) -> dict[str, Any]:
        message = self.model_dump(mode="json", exclude={"items"})
        message["items"] = [it.wire() for it in self.items]
        return message

    def spec(self, item: Item) -> tuple[str, dict[str, Any]]:
        """The task and params ``item`` runs with: its own, else the chunk's."""
        return item.task or self.task, self.params if item.params is None else item.params


def chunk_argsrepr(message: dict[str, Any]) -> str:
    """What Flower, task events and ``celery inspect`` show as a chunk task's arguments (Celery's
    ``argsrepr``): the message with every ref redacted (ocrq.redact)."""
    items = [{**it, "ref": redact_url(str(it.get("ref", "")))} for it in message.get("items", [])]
    return repr([{**message, "items": items}])


def message_bytes(message: dict[str, Any]) -> int:
    return len(json.dumps(message, separators=(",", ":")).encode())


def checked_message(chunk: Chunk, cap: int) -> dict[str, Any]:
    """The chunk's message, or ``TooLarge`` when it exceeds ``queue.max_message_bytes``."""
    message = chunk.to_message()
    size = message_bytes(message)
    if size > cap:
        raise TooLarge(f"a chunk message of {size} bytes exceeds queue.max_message_bytes ({cap}):"
                       " shorten the task params or lower queue.chunk_size")
    return message


def item_bytes(item: Item) -> int:
    """An item's share of a chunk message (its JSON and a separator)."""
    return len(json.dumps(item.wire(), separators=(",", ":")).encode()) + 1


def chunk_groups(items: list[Item], size: int, cap: int, overhead: int = 1024) -> list[list[Item]]:
    """``items`` in chunks of at most ``size`` whose messages stay under ``cap`` bytes (an item
    alone over it makes a chunk of its own, which ``checked_message`` refuses)."""
    groups: list[list[Item]] = []
    part: list[Item] = []
    used = overhead
    for item in items:
        n = item_bytes(item)
        if part and (len(part) == size or used + n > cap):
            groups.append(part)
            part, used = [], overhead
        part.append(item)
        used += n
    if part:
        groups.append(part)
    return groups
