"""One mapping from S3 (boto3/botocore) failures to the error tree, for every S3 caller: reading
references and manifests (producer.expand, ocrq.net.fetch) and the result store (ocrq.store.storage).

    transport error, no HTTP answer          StorageUnavailable (retryable)
    404 / NoSuchKey / NoSuchBucket           MissingObject      (permanent)
    5xx, 408, 429, throttling, expired token StorageUnavailable (retryable)
    any other 4xx (403 AccessDenied, ...)    RefusedRef         (permanent: the credentials or
                                             the bucket policy refuse it; retrying cannot help)

The message names the operation and the object, never credentials or a signed URL.
"""

from __future__ import annotations

from botocore.exceptions import ClientError

from ocrq.errors import MissingObject, OcrqError, RefusedRef, StorageUnavailable

RETRYABLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "ExpiredToken", "RequestLimitExceeded",
})
MISSING_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404"})


def s3_error(exc: Exception, what: str) -> OcrqError:
    """Map a boto3/botocore/transport exception about ``what`` (an s3:// name) to the tree."""
    response = exc.response if isinstance(exc, ClientError) else None
    if response is None:  # BotoCoreError, urllib3/socket errors: transport
        return StorageUnavailable(f"S3 unavailable for {what}: {type(exc).__name__}: {exc}")
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    if code in MISSING_CODES or status == 404:
        return MissingObject(f"no such S3 object: {what} ({code or status})")
    if code in RETRYABLE_CODES or status in (408, 429) or status >= 500:
        return StorageUnavailable(f"S3 error for {what}: {code or status}")
    return RefusedRef(f"S3 refused {what}: {code or status}")
