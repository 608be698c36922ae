"""The broker message schema (JSON): one message carries a chunk of image references.

Bulk jobs put up to ``queue.chunk_size`` refs in one message (one broker round trip instead of
64); everything after delivery — state, retries, failures, results — is per image. A retry
re-publishes only the items that need it, with their attempt counters.

A worker reads a message as a stranger's (anyone who can reach Redis can publish one):
``read_chunk`` checks every field against the grammar the producer writes and returns a chunk
whose every field is within it, with the images it refuses (``BadMessage``, ``TooLarge``,
``RefusedRef``: recorded failed, never fetched) and the items it cannot record at all (an id that
is not one ocrq makes: dropped and counted). A message whose job name is not one
(``ocrq.names.qualified_ok``) cannot be recorded anywhere: ``UnreadableMessage``, the worker
logs it (cut, redacted), counts it and drops it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from ocrq import names
from ocrq.errors import BadMessage, OcrqError, RefusedRef, TooLarge
from ocrq.redact import redact_url, shown_ref
from ocrq.refs import MAX_REF_CHARS

#: a manifest row's extra columns (JSON) above this are refused: they travel in every message
MAX_ROW_BYTES = 16 * 1024

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
    #: this image's own task and params (an OpenAI Batch line's: ``producer.openai_requests``), over
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


# --- reading a message from the broker (the worker's side) ----------------------------------

#: an image id as ocrq makes it (``keys.image_id``): 32 lower-case hex digits
_ITEM_ID = re.compile(r"[0-9a-f]{32}")
#: the highest attempt number a message may carry (ocrq's own stop at ``queue.max_attempts``)
MAX_ATTEMPT = 1000
#: Celery's priority levels on Redis (0 = most urgent)
PRIORITIES = range(10)


class UnreadableMessage(ValueError):
    """A message with no job name ocrq writes, or no items list: nothing in it can be recorded.
    Its text is safe to log (cut and redacted)."""


@dataclass
class ReadChunk:
    """A chunk message as the worker may act on it."""

    #: every field within the grammar; a refused item carries a placeholder task/params/row
    chunk: Chunk
    #: image id → why it is refused (recorded failed, never fetched)
    refused: dict[str, OcrqError] = field(default_factory=dict)
    #: items left out: no id ocrq makes (nowhere to record them), or an id twice
    dropped: int = 0


def read_job_name(job: object) -> str:
    """A job name from a message, or ``UnreadableMessage``."""
    if not names.qualified_ok(job):
        raise UnreadableMessage(f"job name {names.shown(job)} is not one ocrq writes")
    assert isinstance(job, str)
    return job


def read_chunk(message: object, max_bytes: int) -> ReadChunk:
    """Read a chunk message from the broker (see the module docstring). ``max_bytes``:
    ``queue.max_message_bytes`` (params may hold a quarter of it)."""
    if not isinstance(message, dict):
        raise UnreadableMessage(f"a chunk message must be a JSON object, not {type(message).__name__}")
    job = read_job_name(message.get("job"))
    raw_items = message.get("items")
    if not isinstance(raw_items, list):
        raise UnreadableMessage(f"job={job}: a chunk message without an items list")
    try:
        size = message_bytes(message)
    except (TypeError, ValueError):  # (from JSON, so it serialises; a guard for other callers)
        size = max_bytes + 1
    whole: OcrqError | None = None
    if size > max_bytes:
        whole = TooLarge(f"chunk message of {size} bytes exceeds queue.max_message_bytes ({max_bytes})")
    task, params, problem = _spec(message.get("task", "text"), message.get("params", {}), max_bytes)
    whole = whole or problem
    priority = message.get("priority", 0)
    if type(priority) is not int or priority not in PRIORITIES:
        whole = whole or BadMessage(f"priority {names.shown(priority)}: an integer 0 to 9")
        priority = 0
    since = message.get("outage_since")
    if since is not None and (type(since) not in (int, float) or not math.isfinite(since) or since < 0):
        since = None  # (only paces retries through an outage: dropped, not refused)
    read = ReadChunk(Chunk(job=job, task=task, params={} if whole else params, items=[],
                           priority=priority, outage_since=since))
    seen: set[str] = set()
    for raw in raw_items:
        item_id = raw.get("id") if isinstance(raw, dict) else None
        if not isinstance(item_id, str) or not _ITEM_ID.fullmatch(item_id) or item_id in seen:
            read.dropped += 1
            continue
        seen.add(item_id)
        item, why = _item(item_id, raw, max_bytes)
        if whole is not None or why is not None:
            read.refused[item_id] = whole or why  # type: ignore[assignment]
            item = item.model_copy(update={"task": None, "params": None, "row": None})
        read.chunk.items.append(item)
    return read


def _spec(task: object, params: object, max_bytes: int) -> tuple[str, dict[str, Any], OcrqError | None]:
    """(task, params) as read, placeholders when refused, and why."""
    if not isinstance(task, str) or task not in TASKS:
        return "text", {}, BadMessage(f"unknown task {names.shown(task)}: one of {', '.join(TASKS)}")
    if not isinstance(params, dict):
        return task, {}, BadMessage(f"task params must be a JSON object, not {type(params).__name__}")
    size = message_bytes(params)
    if size > max_bytes // 4:
        return task, {}, TooLarge(f"task params of {size} bytes exceed a quarter of queue.max_message_bytes"
                                  f" ({max_bytes})")
    return task, params, None


def _item(item_id: str, raw: dict[str, Any], max_bytes: int) -> tuple[Item, OcrqError | None]:
    """One item as read (with a shown ref and placeholders when refused), and why it is refused."""
    ref = raw.get("ref")
    if not isinstance(ref, str):
        return Item(id=item_id, ref=""), BadMessage(f"ref must be text, not {type(ref).__name__}")
    if len(ref) > MAX_REF_CHARS:
        return Item(id=item_id, ref=shown_ref(ref)), RefusedRef(
            f"reference of {len(ref)} characters (more than {MAX_REF_CHARS})")
    item = Item(id=item_id, ref=ref)
    attempt = raw.get("attempt", 1)
    if type(attempt) is not int or not 1 <= attempt <= MAX_ATTEMPT:
        return item, BadMessage(f"attempt {names.shown(attempt)}: a count from 1 to {MAX_ATTEMPT}")
    item.attempt = attempt
    row = raw.get("row")
    if row is not None:
        if not isinstance(row, dict):
            return item, BadMessage(f"row must be a JSON object, not {type(row).__name__}")
        if message_bytes(row) > MAX_ROW_BYTES:
            return item, BadMessage(f"row of more than {MAX_ROW_BYTES} bytes")
        item.row = row
    task, params = raw.get("task"), raw.get("params")
    if task is not None or params is not None:  # its own, over the chunk's (None: the chunk's)
        own_task, own_params, why = _spec("text" if task is None else task, {} if params is None else params,
                                          max_bytes)
        if why is not None:
            return item, why
        item.task = None if task is None else own_task
        item.params = None if params is None else own_params
    return item, None
