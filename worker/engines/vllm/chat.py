"""One chat completion on a vLLM OpenAI-compatible server, as the vllm-server engine speaks it:
the request body for one image (empty system message, user [image as a base64 data URL, prompt])
and its streamed answer.

Streaming lets the repetition rule stop a looping page early (``Answer.looping``); token ids
come back with the stream (``return_tokens_as_token_ids``) so the rule runs on tokens, as in the
in-process engines.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pybase64

from ocrq.engine_settings import VllmServerSettings
from ocrq.errors import BadRequest, EngineCrashed
from worker.engines import hunyuan
from worker.engines.base import OcrRequest
from worker.engines.vllm.answers import cut_repetition, image_messages

__all__ = ["REPETITION_CHECK_EVERY", "Answer", "encode_body", "request_body"]

#: new tokens between two checks of a stream's tail for a loop
REPETITION_CHECK_EVERY = 8
_TOKEN_ID = re.compile(r"token_id:(-?\d+)")


def request_body(request: OcrRequest, *, model: str | None, version: hunyuan.Version,
                 sampling: hunyuan.Sampling, settings: VllmServerSettings) -> dict[str, Any]:
    s = sampling
    image = request.image if request.image.mode == "RGB" else request.image.convert("RGB")
    buf = io.BytesIO()
    # lossless either way: the server sees the pixels the worker decoded. vLLM opens any format
    # PIL knows (the media type is not read); PPM is the raw pixels behind a short header
    if settings.image_transport == "ppm":
        image.save(buf, format="PPM")
        mime = "image/x-portable-pixmap"
    else:  # level 1 encodes several times faster than the default 6 for a few percent more bytes
        image.save(buf, format="PNG", compress_level=1)
        mime = "image/png"
    # pybase64 (SIMD): 1 ms for a 2048×1536 page's 9.4 MB, the standard library's 22 ms under the GIL
    url = f"data:{mime};base64," + pybase64.b64encode(buf.getbuffer()).decode("ascii")
    part = {"type": "image_url", "image_url": {"url": url}}
    return {
        "model": model,
        "messages": image_messages(request, version, part),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "repetition_penalty": float(request.params.get("repetition_penalty", s.repetition_penalty)),
        "max_tokens": max(1, int(request.params.get("max_new_tokens", settings.max_new_tokens))),
        "ignore_eos": bool(settings.extra.get("ignore_eos", False)),
        "skip_special_tokens": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
        # vLLM refuses a non-zero priority unless the server schedules by priority: the
        # launcher starts it so (server_argv); set engine.scheduling: fcfs for others
        **({"priority": request.priority} if settings.scheduling == "priority" and request.priority else {}),
    }


#: stands in for a data URL while the rest of a body is encoded (JSON-encodes as itself)
_URL_SLOT = "ocrq-image-url-slot"
_URL_SLOT_JSON = json.dumps(_URL_SLOT).encode()


def encode_body(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON bytes, its images' data URLs spliced in as they are. A data URL is
    megabytes of base64, which JSON needs no escapes for: ``json.dumps`` walking it held the
    worker's GIL ~77 ms for a 2048×1536 page (httpx's ``json=``), 70 % of the GIL with
    ``vllm-server`` on the H200 (docs/bench/gpu-vllm.md); the splice is a copy."""
    urls: list[str] = []
    text = json.dumps(_slotted(body, urls), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    pieces = text.encode().split(_URL_SLOT_JSON)
    if len(pieces) != len(urls) + 1:
        raise BadRequest("a request body's text holds the image slot marker")
    out = [pieces[0]]
    for url, piece in zip(urls, pieces[1:], strict=True):
        out += [b'"', url.encode("ascii"), b'"', piece]
    return b"".join(out)


def _slotted(obj: Any, urls: list[str]) -> Any:
    """``obj`` with each image part's URL replaced by the slot marker (collected in ``urls``)."""
    if isinstance(obj, Mapping):
        if obj.get("type") == "image_url":
            url = obj["image_url"]["url"]
            if not (url.isascii() and '"' not in url and "\\" not in url):
                raise BadRequest("an image URL that needs JSON escapes")
            urls.append(url)
            return {**obj, "image_url": {**obj["image_url"], "url": _URL_SLOT}}
        return {k: _slotted(v, urls) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_slotted(v, urls) for v in obj]
    return obj


@dataclass
class Answer:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    #: per token: length of ``text`` once its chunk was added (to cut text at a token)
    ends: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    repetition: hunyuan.Repetition | None = None
    generated: int = 0
    checked: int = 0
    endpoint: str = ""

    def cut(self, keep: int) -> None:
        """Keep the first ``keep`` tokens and the text streamed with them."""
        self.text = self.text[: self.ends[keep - 1]] if keep > 0 else ""
        del self.tokens[keep:], self.ends[keep:]

    def add_chunk(self, chunk: Mapping[str, Any]) -> None:
        """Fold one SSE chunk (text delta, token ids, logprobs, finish, usage) into the answer."""
        if "error" in chunk:
            raise EngineCrashed(f"vLLM error mid-stream: {str(chunk['error'])[:300]}")
        for choice in chunk.get("choices") or []:
            self.text += (choice.get("delta") or {}).get("content") or ""
            for item in (choice.get("logprobs") or {}).get("content") or []:
                self.tokens.append(_token_id(item.get("token", "")))
                self.ends.append(len(self.text))
                top = item.get("top_logprobs") or []
                if top:
                    self.logprobs.append([(_token_id(t["token"]), float(t["logprob"])) for t in top])
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        usage = chunk.get("usage") or {}
        self.generated = max(self.generated, len(self.tokens), int(usage.get("completion_tokens") or 0))

    def looping(self, repetition_stop: int, final: bool) -> bool:
        """Whether the tail loops (checked every ``REPETITION_CHECK_EVERY`` new tokens, and at the
        end); a loop is cut to one copy of its unit and recorded in ``repetition``."""
        if self.repetition is not None:
            return True
        if not final and len(self.tokens) - self.checked < REPETITION_CHECK_EVERY:
            return False
        self.checked = len(self.tokens)
        kept, rep = cut_repetition(self.tokens, repetition_stop)
        if rep is None:
            return False
        self.repetition = rep
        self.cut(len(kept))
        return True


def _token_id(token: str) -> int:
    match = _TOKEN_ID.search(token)
    return int(match.group(1)) if match else -1
