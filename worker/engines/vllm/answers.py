"""HunyuanOCR answers as both vLLM engines (in-process and server) shape them: the chat messages
of a request with a concrete image part, the loop cut, the meta keys of an answer, and what vLLM's
refusal of one request means for its image.

The transformers engine shapes its answers the same way (its ``_output`` and ``_settle``), so the
names and rules here are its own."""

from __future__ import annotations

from typing import Any

from ocrq.errors import BadRequest, OcrqError, TooLargeForDevice
from worker.engines import hunyuan
from worker.engines.base import OcrRequest


def image_messages(request: OcrRequest, version: hunyuan.Version, image_part: dict[str, Any]) -> list[Any]:
    """``hunyuan.build_messages`` with its image placeholder replaced by a concrete image part."""
    messages = hunyuan.build_messages(request.task, request.params, version)
    for message in messages:
        if isinstance(message["content"], list):
            message["content"] = [image_part if part.get("type") == "image" else part
                                  for part in message["content"]]
    return messages


def cut_repetition(tokens: list[int], min_repeats: int) -> tuple[list[int], hunyuan.Repetition | None]:
    """Tokens to keep when the tail loops: everything before the loop plus one copy of the unit
    (the rule and the cut are the transformers engine's, so both engines agree)."""
    rep = hunyuan.detect_repetition(tokens, min_repeats)
    if rep is None:
        return tokens, None
    return tokens[: len(tokens) - rep.span + rep.unit], rep


def answer_meta(
    generated: int, finish: str | None, repetition: hunyuan.Repetition | None, batch_size: int, seconds: float
) -> dict[str, Any]:
    """The meta keys both vLLM engines add to an answer (the transformers engine's names)."""
    return {
        "generated_tokens": generated,
        "stop_reason": "repetition" if repetition else finish,
        "repetition": {"unit": repetition.unit, "repeats": repetition.repeats} if repetition else None,
        "batch_size": batch_size,
        "batch_s": round(seconds, 4),
    }


def admission_error(request: OcrRequest, exc: BaseException, max_model_len: int) -> OcrqError:
    """What vLLM's refusal of one request means for that image: too long for the context
    (permanent, ``TooLargeForDevice``), or any other validation error (``BadRequest``)."""
    text = str(exc)
    if "maximum context length" in text or "max_model_len" in text or "maximum model length" in text:
        return TooLargeForDevice(f"{request.key}: prompt exceeds max_model_len {max_model_len}: {text[:200]}")
    return BadRequest(f"{request.key}: vLLM rejected the request: {type(exc).__name__}: {text[:300]}")
