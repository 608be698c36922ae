"""OpenAI Batch output: a job's results as the output and error files of OpenAI's Batch API
(what ``vllm run-batch`` writes), one line per ``custom_id``.

    output.jsonl  {"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
                   <chat.completion>}, "error": null}                   one line per image done
    errors.jsonl  {"id", "custom_id", "response": {"status_code": 400|500, "request_id",
                   "body": null}, "error": {"code", "message"[, "line"]}}
                  one line per image failed (code: its error type) and per input line that could
                  not run (``producer.openai_requests``; ``line``: its 1-based line number)

As OpenAI's files do, every ``custom_id`` is in exactly one of the two. The body is a chat
completion whose message content is the OCR text (pages joined by ``\\n\\f\\n``), its ``model`` the
model that ran, ``usage`` the engine's token counts where it reports them (generated tokens; the
image's tokens as the prompt), else 0; the ``ocrq`` field carries the image id, ref, pages, lines
and boxes. Ids are derived from the image id, so a file written again is the same file.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from ocrq import keys
from ocrq.errors import OcrqError
from ocrq.jobs.index import JobIndex, finished
from ocrq.output.parts import results as job_results
from ocrq.redact import redact_text
from ocrq.results import ImageResult, ImageStatus, json_line
from ocrq.store.storage import ResultStore

#: errors that are not the request's fault (the answer is a 5xx): the rest are 400
_SERVER_SIDE = frozenset({"RetriesExhausted"})


def custom_id(result: ImageResult) -> str | None:
    """The ``custom_id`` an image was submitted with (None: not from an OpenAI Batch line)."""
    row = result.record.row
    value = row.get("custom_id") if isinstance(row, dict) else None
    return value if isinstance(value, str) else None


def chat_completion(result: ImageResult) -> dict[str, Any]:
    """An image done, as an ``openai.types.chat.ChatCompletion`` body."""
    rec = result.record
    metas = [o.meta for o in result.outputs]
    generated = [m["generated_tokens"] for m in metas if isinstance(m.get("generated_tokens"), int)]
    prompt = [m.get("prompt_tokens", m.get("vision_tokens")) for m in metas]
    prompt_tokens = sum(p for p in prompt if isinstance(p, int)) if generated else 0
    completion_tokens = sum(generated)
    stopped = {m.get("stop_reason") for m in metas}
    line = result.to_line()
    return {
        "id": f"chatcmpl-{rec.id}",
        "object": "chat.completion",
        "created": int(rec.updated),
        "model": line["model"] or "",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "finish_reason": "length" if "length" in stopped else "stop", "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "ocrq": {"image_id": rec.id, "ref": rec.ref, "cached": rec.cached, "pages": rec.pages,
                 "page_texts": line["page_texts"], "lines": line["lines"], "engine": line["engine"]},
    }


def result_line(result: ImageResult) -> tuple[bool, dict[str, Any]]:
    """(is an error, the envelope) of a final image submitted from an OpenAI Batch line."""
    rec = result.record
    cid = custom_id(result) or ""
    if rec.status is ImageStatus.done:
        return False, {"id": f"batch_req_{rec.id}", "custom_id": cid,
                       "response": {"status_code": 200, "request_id": f"req_{rec.id}",
                                    "body": chat_completion(result)},
                       "error": None}
    err = rec.error
    if rec.status is ImageStatus.cancelled:
        return True, {"id": f"batch_req_{rec.id}", "custom_id": cid,
                      "response": {"status_code": 499, "request_id": f"req_{rec.id}", "body": None},
                      "error": {"code": "batch_cancelled",
                                "message": "the batch was cancelled before this request ran"}}
    code, message = (err.type, err.message) if err else ("Unknown", "failed without a recorded error")
    status = 500 if code in _SERVER_SIDE or (err is not None and err.retryable) else 400
    return True, {"id": f"batch_req_{rec.id}", "custom_id": cid,
                  "response": {"status_code": status, "request_id": f"req_{rec.id}", "body": None},
                  "error": {"code": code, "message": message}}


def rejected_line(custom_id: str, line: int, file_digest: str, error: OcrqError) -> dict[str, Any]:
    """The error line of an input line that could not run (bad request, refused image, a repeat)."""
    rid = f"{file_digest}-{line}"
    return {"id": f"batch_req_{rid}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": f"req_{rid}", "body": None},
            "error": {"code": type(error).__name__, "message": redact_text(str(error)), "line": line}}


def rejected(store: ResultStore, job: str, ran: set[str]) -> Iterator[dict[str, Any]]:
    """The error lines of the OpenAI Batch files' lines that could not run, but those whose
    ``custom_id`` ran since (``ran``: a file submitted again with the line fixed) and repeats of
    one ``custom_id`` (the same bad line in two versions of a file). A ``DuplicateCustomId`` line
    stays: its ``custom_id`` ran from the line it repeats."""
    written: set[tuple[str, str]] = set()
    for path in store.list(keys.openai_rejected_prefix(job)):
        data = store.get_many([path], raw=True).get(path) or b""
        for raw in data.splitlines():
            if not raw.strip():
                continue
            line = json.loads(raw)
            cid, code = line.get("custom_id") or "", line["error"]["code"]
            if cid and ((cid, code) in written or (code != "DuplicateCustomId" and cid in ran)):
                continue
            written.add((cid, code))
            yield line


def custom_ids(results: Iterable[ImageResult]) -> set[str]:
    """The ``custom_id`` of every image of a job that came from an OpenAI Batch line."""
    return {cid for r in results if (cid := custom_id(r)) is not None}


def final_lines(results: Iterable[ImageResult]) -> Iterator[tuple[str, bool, dict[str, Any]]]:
    """(image id, is an error, envelope) of each final image that came from an OpenAI Batch line."""
    for result in results:
        if result.record.status.final and custom_id(result) is not None:
            yield (result.record.id, *result_line(result))


class BatchFiles:
    """An output and an error file being written (``add``: one envelope)."""

    def __init__(self, output: IO[bytes], errors: IO[bytes]) -> None:
        self.output = output
        self.errors = errors
        self.lines = self.error_lines = 0

    def add(self, is_error: bool, envelope: dict[str, Any]) -> None:
        (self.errors if is_error else self.output).write(json_line(envelope) + b"\n")
        if is_error:
            self.error_lines += 1
        else:
            self.lines += 1

    def flush(self) -> None:
        self.output.flush()
        self.errors.flush()


def export_to_store(index: JobIndex, store: ResultStore, job: str) -> dict[str, Any]:
    """Write the job's OpenAI Batch files to the store (``keys.openai_export_object``): what is
    final now; then, when every image is, the ``_SUCCESS`` marker (a stale one goes first)."""
    counts = index.counts(job)
    complete = finished(counts) and not index.redis.exists(
        keys.job_submitting(job))
    store.delete(keys.openai_export_object(job, keys.EXPORT_SUCCESS))
    with tempfile.TemporaryDirectory(prefix="ocrq-openai-") as tmp:
        out, err = Path(tmp) / keys.OPENAI_OUTPUT, Path(tmp) / keys.OPENAI_ERRORS
        with out.open("wb") as fo, err.open("wb") as fe:
            files = BatchFiles(fo, fe)
            ran: set[str] = set()
            for result in job_results(index, store, job):
                cid = custom_id(result)
                if cid is not None:
                    ran.add(cid)
                    if result.record.status.final:
                        files.add(*result_line(result))
            for envelope in rejected(store, job, ran):
                files.add(True, envelope)
        store.put_file(keys.openai_export_object(job, keys.OPENAI_OUTPUT), out, "application/x-ndjson")
        store.put_file(keys.openai_export_object(job, keys.OPENAI_ERRORS), err, "application/x-ndjson")
        sizes = {keys.OPENAI_OUTPUT: out.stat().st_size, keys.OPENAI_ERRORS: err.stat().st_size}
    marker = {"job": job, "complete": complete, "lines": files.lines, "error_lines": files.error_lines,
              "counts": counts, "files": [keys.OPENAI_OUTPUT, keys.OPENAI_ERRORS], "bytes": sizes}
    if complete:
        store.put_json(keys.openai_export_object(job, keys.EXPORT_SUCCESS), marker)
    return marker
