"""``Idempotency-Key``: a client retrying a create (a timeout, a dropped connection, a replica
killed mid-request) gets the job its first request made, not a second one; the same key with
another body is a conflict.

The key's record (``keys.idempotency``: its job and the digest of the request body) is written
before the job is, with SET NX. A request that finds it with the same body submits the same again
to that job: the producer knows a submission by its content (``ocrq.jobs.feed``), so that is a no-op
for one written whole and finishes one a killed process left half written (two requests racing
with one key write the same submission once). A request that fails (refused refs, a full broker)
removes the record: the same key may try again. Records last ``api.idempotency_ttl_s``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from typing import Any

from api.tenants import Tenant
from ocrq import keys
from producer.errors import Conflict


@contextlib.contextmanager
def claim(svc: Any, tenant: Tenant, key: str | None, digest: str, name: str) -> Iterator[str | None]:
    """The job name an earlier request with ``key`` made (``Conflict`` if its body differed), or
    None: this request makes job ``name``."""
    if key is None:
        yield None
        return
    record = keys.idempotency(tenant.name, hashlib.sha256(key.encode()).hexdigest())
    mine = json.dumps({"job": name, "body": digest})
    if svc.redis.set(record, mine, nx=True, ex=svc.settings.api.idempotency_ttl_s):
        try:
            yield None
        except BaseException:
            svc.redis.delete(record)
            raise
        return
    prior = json.loads(svc.redis.get(record) or "{}")
    if prior.get("body") != digest:
        raise Conflict("this Idempotency-Key was used with another request body: use a new key for a new job")
    yield prior["job"]
