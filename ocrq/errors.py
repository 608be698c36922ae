"""One small error tree.

    OcrqError
    ├── Retryable          the same image may succeed later: retried with backoff
    │   ├── EngineOOM          device memory ran out (the engine loop bisects before raising it)
    │   ├── EngineTimeout      the engine did not answer in time
    │   ├── EngineCrashed      the engine died; it is rebuilt, the image retried
    │   ├── EngineUnavailable  no engine server answers (every vLLM endpoint down or refusing)
    │   ├── DecoderCrashed     the image decoder's process died or hung on this image (worker.decoding.decode)
    │   └── StorageUnavailable Redis/S3/HTTP source unreachable or 5xx
    └── Permanent          retrying cannot help: failed on the first attempt
        ├── RefusedRef         reference outside the allowed roots/schemes, or malformed
        ├── RefusedKey         a store path that would leave the store's root (``..``, absolute, ...)
        ├── BadMessage         a broker message field outside the grammar ocrq writes (a message
        │                      not from ocrq's producer: worker.tasks reads every one, ocrq.messages)
        ├── MissingObject      file/object/URL does not exist (404)
        │   └── HostNotFound       the URL's host name does not resolve (NXDOMAIN)
        ├── TooLarge           bytes or pixels above the configured caps
        ├── BadImage           bytes are not a decodable image
        ├── UnsupportedFormat  decodable container but a format we do not accept
        ├── BadDocument        a PDF that cannot be opened or rendered (broken, truncated)
        │   └── EncryptedDocument  a PDF that needs a password to open
        ├── TooLargeForDevice  one image alone does not fit the device even at a lower pixel cap
        ├── BadRequest         the engine/server rejected the request itself (HTTP 4xx, bad params)
        │   └── UnsupportedTask    a task or prompt this engine cannot honour (ocrq.capabilities)
        └── RetriesExhausted   a retryable error kept happening until ``queue.max_attempts`` ran
                               out; its message names the last real cause
                               ("after 4 attempts: EngineOOM: ...")

Every error serialises to ``{"type": ClassName, "message": str, "retryable": bool}`` which is
what a failed image records on its task. Every message is redacted when the error is made
(``ocrq.redact.redact_message``: URLs, passwords, cut to 2,000 characters), so a log line, a
record and an API answer show the same text.
``classify`` maps any exception into the tree; ``is_oom`` recognises a device out-of-memory (ours
or torch's) without importing torch.
"""

from __future__ import annotations

from typing import Any

from ocrq.redact import redact_message


class OcrqError(Exception):
    """Base of every error ocrq records on an image."""

    retryable: bool = False

    def __init__(self, *args: object) -> None:
        # redacted once, here: str(), logs, records and answers all see the same text
        if args and isinstance(args[0], str):
            args = (redact_message(args[0]), *args[1:])
        super().__init__(*args)

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "message": str(self), "retryable": self.retryable}


class Retryable(OcrqError):
    retryable = True


class Permanent(OcrqError):
    retryable = False


class EngineOOM(Retryable):
    pass


class EngineTimeout(Retryable):
    pass


class EngineCrashed(Retryable):
    pass


class EngineUnavailable(Retryable):
    pass


class DecoderCrashed(Retryable):
    """The isolated decoder process died (segfault, abort, OOM kill) or hung on this image."""


class StorageUnavailable(Retryable):
    pass


class NameTaken(StorageUnavailable):
    """A document written as new (``ResultStore.put_many``'s ``new``) found its path taken: a
    result part whose number Redis handed out twice, having lost its counter to a failover or a
    crash. The writer takes the next number; escaping that, the chunk is retried."""


class RefusedRef(Permanent):
    pass


class RefusedKey(Permanent):
    """A store path outside the grammar of ``ocrq.keys`` (``..``, an absolute path, a control
    character): refused by every store, whoever asks, before any I/O."""


class BadMessage(Permanent):
    """A broker message field ocrq's producer would never write (an unknown task, params over
    their share of a message, an attempt that is no count ...): the image is failed, never run."""


class MissingObject(Permanent):
    pass


class HostNotFound(MissingObject):
    """NXDOMAIN: retrying a name that does not exist does not make it exist."""


class TooLarge(Permanent):
    pass


class BadImage(Permanent):
    pass


class UnsupportedFormat(Permanent):
    pass


class BadDocument(Permanent):
    pass


class EncryptedDocument(BadDocument):
    pass


class TooLargeForDevice(Permanent):
    pass


class BadRequest(Permanent):
    pass


class UnsupportedTask(BadRequest):
    """The engine cannot honour the image's task or prompt (RapidOCR asked to translate): the
    image fails, typed, rather than come back ``done`` with an answer to another question."""


class RetriesExhausted(Permanent):
    """A retryable error that kept happening until the attempt budget ran out."""

    @classmethod
    def after(cls, attempts: int, last: OcrqError) -> RetriesExhausted:
        return cls(f"after {attempts} attempts: {type(last).__name__}: {last}")


_BY_NAME: dict[str, type[OcrqError]] = {
    cls.__name__: cls
    for cls in (
        OcrqError, Retryable, Permanent, EngineOOM, EngineTimeout, EngineCrashed,
        EngineUnavailable, DecoderCrashed, StorageUnavailable, RefusedRef, MissingObject, TooLarge, BadImage,
        UnsupportedFormat, TooLargeForDevice, BadRequest, RetriesExhausted, HostNotFound, BadDocument,
        EncryptedDocument, UnsupportedTask, RefusedKey, BadMessage,
    )
}


def error_from_dict(data: dict[str, Any]) -> OcrqError:
    """Rebuild an error recorded by ``OcrqError.to_dict`` (unknown types become ``OcrqError``)."""
    cls = _BY_NAME.get(str(data.get("type")), OcrqError)
    return cls(str(data.get("message", "")))


def classify(exc: BaseException) -> OcrqError:
    """Map any exception to the tree; unknown exceptions are treated as retryable engine crashes
    so a bug never silently drops an image (the attempt budget still bounds the retries)."""
    if isinstance(exc, OcrqError):
        return exc
    return EngineCrashed(f"{type(exc).__name__}: {exc}")


_OOM_MESSAGES = ("cuda out of memory", "cuda error: out of memory", "cublas_status_alloc_failed",
                 "hip out of memory")


def is_oom(exc: BaseException) -> bool:
    """Device out-of-memory, from ocrq's type or torch's (by class name and message, so torch
    need not be imported), also when wrapped with ``raise … from oom``."""
    current: BaseException | None = exc
    for _ in range(8):  # bounded: a cause chain can be cyclic
        if current is None:
            return False
        if isinstance(current, EngineOOM) or type(current).__name__ == "OutOfMemoryError":
            return True
        message = str(current).lower()
        if any(marker in message for marker in _OOM_MESSAGES):
            return True
        current = current.__cause__
    return False
