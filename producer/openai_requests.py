"""One line of an OpenAI Batch input file, read as an OCR request.

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "max_tokens": 4096,
              "messages": [{"role": "user", "content": [
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                  {"type": "text", "text": "提取图中的文字。"}]}]}}

``parse_line`` gives the line's ``custom_id``, its one image (the URL as written) and the task and
params it runs with, or raises a typed error (``InvalidLine``) that becomes the line's own error
line. The mapping (docs/etl.md):

* the user messages' text parts, joined, select the task: a HunyuanOCR prompt (``ocrq.prompts``,
  either version) maps to its task and params; any other text runs as a custom prompt
  (task ``text``, ``params["prompt"]``); no text: task ``text``;
* ``max_tokens`` / ``max_completion_tokens`` → ``params["max_new_tokens"]``;
* ignored: ``model`` (the result names the model that ran), ``temperature``, ``top_p`` and the
  other sampling fields (HunyuanOCR decodes greedily), system and assistant messages;
* refused: ``stream: true``, ``n`` > 1, a method other than POST, a URL other than
  ``/v1/chat/completions``, no image or more than one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ocrq.errors import BadRequest
from ocrq.prompts import task_of

#: the endpoint a line must name (vLLM's run-batch and OpenAI's Batch API spell it so)
CHAT_COMPLETIONS = "/v1/chat/completions"


class InvalidLine(BadRequest):
    """Not a request ocrq can run: bad JSON, a missing or wrong field, no image or more than one."""


class DuplicateCustomId(BadRequest):
    """The ``custom_id`` of an earlier line of the same file (the first one runs)."""


@dataclass(frozen=True)
class BatchRequest:
    """What one line asks for."""

    custom_id: str
    #: the image_url's url as written: http(s), data:, s3://, file:// or a path
    image: str
    task: str
    params: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        """The image's own task and params (``ocrq.messages.Item``)."""
        return {"task": self.task, "params": self.params}


def custom_id_of(raw: str | bytes) -> str:
    """The line's ``custom_id`` when one can be read, else "" (for its error line)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return ""
    value = doc.get("custom_id") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else ""


def parse_line(raw: str | bytes) -> BatchRequest:
    """The request on one input line, or ``InvalidLine`` saying why not."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise InvalidLine(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise InvalidLine("a line must be a JSON object")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidLine("custom_id must be a non-empty string")
    method = doc.get("method", "POST")
    if not isinstance(method, str) or method.upper() != "POST":
        raise InvalidLine(f"method must be POST, not {method!r}")
    url = doc.get("url")
    if url != CHAT_COMPLETIONS:
        raise InvalidLine(f"url must be {CHAT_COMPLETIONS}, not {url!r}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise InvalidLine("body must be an object")
    if body.get("stream"):
        raise InvalidLine("stream must be false: a batch answer is one document")
    n = body.get("n", 1)
    if n not in (1, None):
        raise InvalidLine(f"n must be 1, not {n!r}: one answer per image")
    image, text = _content(body.get("messages"))
    task, params = task_of(text) or (("text", {"prompt": text}) if text.strip() else ("text", {}))
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidLine(f"max_tokens must be a positive integer, not {max_tokens!r}")
        params = {**params, "max_new_tokens": max_tokens}
    return BatchRequest(custom_id, image, task, params)


def _content(messages: Any) -> tuple[str, str]:
    """The one image URL and the joined text of the user messages."""
    if not isinstance(messages, list) or not messages:
        raise InvalidLine("body.messages must be a non-empty list")
    images: list[str] = []
    texts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            raise InvalidLine("each message must be an object")
        if message.get("role") != "user":
            continue  # system / assistant turns: HunyuanOCR is prompted by the user turn alone
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        if not isinstance(content, list):
            raise InvalidLine("a user message's content must be a string or a list of parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                images.append(_image_url(part.get("image_url")))
            else:
                raise InvalidLine(f"unsupported content part {kind!r}: text and image_url only")
    if not images:
        raise InvalidLine("no image_url part in the user messages: one image per line")
    if len(images) > 1:
        raise InvalidLine(f"{len(images)} images in one line: one image per line")
    return images[0], "\n".join(t for t in texts if t.strip())


def _image_url(value: Any) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url.strip():
        raise InvalidLine("image_url.url must be a non-empty string")
    return url.strip()
