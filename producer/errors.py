"""Every error a client of ocrq can get, in one tree. Each knows its HTTP status (what ``ocrq
serve`` answers) and its exit code (what the ``ocrq`` command exits with), here and nowhere else:

    ClientError                       HTTP  exit
    ├── Refused                        422    2   refused as asked: nothing was published
    │   ├── SubmissionRefused          422    2     some refs refused (``.plan`` lists each, with why)
    │   ├── InvalidName                422    2     a job or tenant name outside the grammar (ocrq.names)
    │   ├── UnsupportedTask            422    2     a task or prompt no engine of the fleet can honour
    │   ├── InputUnreadable            422    2     a manifest, folder or batch file that cannot be read
    │   └── ParamsTooLarge             422    2     task params over their share of a message
    ├── Unauthorized                   401    2   no token, or one ocrq does not know
    ├── UnknownJob                     404    1   no such job (for this tenant: another's is unknown too)
    ├── Conflict                       409    2   an Idempotency-Key reused with another request
    ├── RateLimited                    429    2   the tenant's request rate or images in flight (``retry_after``)
    ├── BrokerFull                     503    2   the broker's Redis is near its maxmemory
    ├── NotReplicated                  503    5   the submission could not be confirmed on the replicas
    ├── Unreachable                    503    2   Redis cannot be reached (within 3 s: ``Client.check_reachable``)
    ├── NotFinished                    409    2   the job is not finished (an export asked for without waiting)
    ├── ImagesFailed                   200    3   a wait ended: every image final, some failed
    └── WaitTimedOut                   202    4   a wait ran out of time: the job goes on

The last two are what a wait ended with, not a request's error: the API answers them as the
job's state (200 with its counts, 202 while it runs); the ``ocrq`` command exits with their code.

What a waiting command's exit code says (``ocrq --help``, README):

    0 every image done · 1 no such job (or another error) · 2 refused · 3 some images failed
    4 timed out waiting (the job goes on) · 5 not confirmed on the replicas (run it again)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ocrq import errors
from ocrq.errors import RefusedRef, TooLarge
from ocrq.redact import redact_message, redact_text, redact_url, shown_ref

if TYPE_CHECKING:
    from producer.intake import IntakePlan

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_REFUSED = 2
EXIT_SOME_FAILED = 3
EXIT_TIMEOUT = 4
EXIT_NOT_REPLICATED = 5


class ClientError(Exception):
    """Base of every error a client gets: its HTTP status, exit code and a short machine code."""

    http_status = 400
    exit_code = EXIT_ERROR
    code = "error"

    def body(self) -> dict[str, Any]:
        """The API's error body: ``{"error": {"type", "code", "message"}}`` (secrets redacted)."""
        return {"error": {"type": type(self).__name__, "code": self.code, "message": redact_message(str(self))}}

    def headers(self) -> dict[str, str]:
        return {}


class Refused(ClientError):
    http_status = 422
    exit_code = EXIT_REFUSED
    code = "refused"


class SubmissionRefused(Refused, RefusedRef):
    """Some refs were refused at submit; nothing was published. ``plan`` lists them."""

    code = "refs_refused"

    def __init__(self, plan: IntakePlan) -> None:
        first = plan.refused_sample[0] if plan.refused_sample else None
        super().__init__(f"{plan.refused} refs refused, nothing published"
                         + (f"; first: {redact_text(first.reason)}" if first else ""))
        self.plan = plan

    def body(self) -> dict[str, Any]:
        out = super().body()
        out["error"]["refused"] = [{"ref": shown_ref(e.value), "reason": redact_message(e.reason, 500)}
                                   for e in self.plan.refused_sample]
        out["error"]["counts"] = {"accepted": self.plan.accepted, "skipped": self.plan.skipped,
                                  "refused": self.plan.refused}
        return out


class InvalidName(Refused, ValueError):
    code = "invalid_name"


class UnsupportedTask(Refused, errors.UnsupportedTask, ValueError):
    """A task, or a prompt, no engine of the fleet can honour (ocrq.capabilities): the message
    names the engines that can. An OpenAI Batch line asking for one gets it as its error line."""

    code = "unsupported_task"


class InputUnreadable(Refused):
    """A manifest, folder or OpenAI Batch file that cannot be read (missing, not JSON lines, …)."""

    code = "unreadable"


class ParamsTooLarge(Refused, TooLarge):
    code = "params_too_large"


class Unauthorized(ClientError):
    http_status = 401
    exit_code = EXIT_REFUSED
    code = "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class UnknownJob(ClientError, LookupError):
    http_status = 404
    exit_code = EXIT_ERROR
    code = "not_found"

    def __init__(self, name: str, what: str = "job") -> None:
        super().__init__(f"no such {what}: {name!r}")
        self.name = name


class Conflict(ClientError):
    http_status = 409
    exit_code = EXIT_REFUSED
    code = "conflict"


class RateLimited(ClientError):
    http_status = 429
    exit_code = EXIT_REFUSED
    code = "rate_limited"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, int(self.retry_after + 0.999)))}


class BrokerFull(ClientError, RuntimeError):
    """The broker's Redis is (nearly) at its ``maxmemory``: the submission was refused, nothing
    was published; the running jobs go on."""

    http_status = 503
    exit_code = EXIT_REFUSED
    code = "broker_full"

    def __init__(self, url: str, used: int, limit: int) -> None:
        super().__init__(
            f"the broker's Redis ({redact_url(url)}) holds {used / 2**20:,.0f} MiB of its maxmemory "
            f"{limit / 2**20:,.0f} MiB ({used / max(limit, 1):.0%}): new work is refused so running jobs can "
            "finish. Wait for them, or raise the server's maxmemory (redis.max_memory, OCRQ_REDIS__MAX_MEMORY, "
            "for the Redis `ocrq up` starts; refused from redis.refuse_submit_at of it)")
        self.used = used
        self.limit = limit

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "30"}


class NotReplicated(ClientError, RuntimeError):
    """The submission could not be confirmed on enough replicas: it may be lost in a failover."""

    http_status = 503
    exit_code = EXIT_NOT_REPLICATED
    code = "not_replicated"


class Unreachable(ClientError, ConnectionError):
    """Redis (the broker, the job index) cannot be reached."""

    http_status = 503
    exit_code = EXIT_REFUSED
    code = "unavailable"


def unreachable(url: str, exc: BaseException) -> Unreachable:
    """The one message for a Redis that cannot be reached: where, why, and what to do."""
    why = " ".join(str(exc).split()) or type(exc).__name__
    return Unreachable(f"cannot reach Redis at {redact_url(url)} ({why}): start the embedded stack with "
                       "`ocrq up`, or point OCRQ_REDIS__URL (redis.url) at your Redis")


class NotFinished(ClientError):
    """The job is not finished: what needs all of it (its export) waits, or is refused."""

    http_status = 409
    exit_code = EXIT_REFUSED
    code = "not_finished"


class ImagesFailed(ClientError):
    """Every image of the wait is final and ``failed`` of them failed (their reasons are in the
    failed registry: ``ocrq failed --job J``)."""

    http_status = 200
    exit_code = EXIT_SOME_FAILED
    code = "images_failed"

    def __init__(self, job: str, failed: int, total: int, what: str = "images") -> None:
        super().__init__(f"{failed} of {total} {what} failed in job {job}")
        self.job = job
        self.failed = failed
        self.total = total


class WaitTimedOut(ClientError, TimeoutError):
    """A wait ran out of time; the job goes on."""

    http_status = 202
    exit_code = EXIT_TIMEOUT
    code = "wait_timeout"
