"""The grammar of the names a request or a broker message carries: tenants and jobs.

A job belongs to a tenant. The default tenant's jobs are named as their owners wrote them
(``invoices-2026-11``: what ``ocrq submit``, ``producer.Client`` and every job made before tenants
use); another tenant's job is qualified by its tenant, ``{tenant}~{name}`` (``acme~invoices``), in
Redis keys, store paths and messages alike, so two tenants' jobs of one name never meet. ``~`` is
in neither grammar, so a qualified name splits one way only, and no name holds a ``/``: a job
name can never step out of its folder in the store.

Producers check names before anything is published; workers check every name a message carries
(a message on the broker may come from anyone who can reach Redis).
"""

from __future__ import annotations

import re

#: a job's own name: letters, digits, '.', '_', '-', starting with a letter or digit, ≤ 128
JOB_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
#: a tenant's name: lower-case letters, digits, '_', '-', starting with a letter or digit, ≤ 32
TENANT_PATTERN = r"[a-z0-9][a-z0-9_-]{0,31}"
#: between a tenant and its job's name in a qualified job name
SEPARATOR = "~"
#: the tenant of the CLI, the Python client and the jobs made before tenants: its jobs are unqualified
DEFAULT_TENANT = "default"

# \Z, not $: "$" also matches before a final newline, and "job\n" is no job name
_JOB = re.compile(rf"^{JOB_PATTERN}\Z")
_TENANT = re.compile(rf"^{TENANT_PATTERN}\Z")
_QUALIFIED = re.compile(rf"^(?:(?P<tenant>{TENANT_PATTERN}){SEPARATOR})?(?P<name>{JOB_PATTERN})\Z")


def job_ok(name: object) -> bool:
    """Whether ``name`` is a job's own name (unqualified)."""
    return isinstance(name, str) and _JOB.match(name) is not None


def tenant_ok(name: object) -> bool:
    return isinstance(name, str) and _TENANT.match(name) is not None


def qualified_ok(name: object) -> bool:
    """Whether ``name`` is a job name as Redis, the store and messages carry it (a tenant's, or
    the default tenant's unqualified one)."""
    return isinstance(name, str) and _QUALIFIED.match(name) is not None


def check_job(name: str) -> str:
    """``name`` when it is a job's own name, else ``ValueError`` naming the rule."""
    if not job_ok(name):
        raise ValueError(f"job name {shown(name)}: use letters, digits, '.', '_', '-' (≤ 128), "
                         "starting with a letter or digit")
    return name


def check_tenant(name: str) -> str:
    if not tenant_ok(name):
        raise ValueError(f"tenant name {shown(name)}: use lower-case letters, digits, '_', '-' (≤ 32), "
                         "starting with a letter or digit")
    return name


def check_qualified(name: str) -> str:
    """``name`` when Redis and the store may carry it as a job name, else ``ValueError``."""
    if not qualified_ok(name):
        raise ValueError(f"job name {shown(name)} is not a job name ocrq writes "
                         f"([tenant{SEPARATOR}]name, no '/')")
    return name


def qualify(tenant: str, name: str) -> str:
    """The job name Redis and the store use for tenant ``tenant``'s job ``name``."""
    check_job(name)
    if tenant == DEFAULT_TENANT:
        return name
    return f"{check_tenant(tenant)}{SEPARATOR}{name}"


def split(job: str) -> tuple[str, str]:
    """(tenant, own name) of a qualified job name (``ValueError`` when it is none)."""
    m = _QUALIFIED.match(job) if isinstance(job, str) else None
    if m is None:
        raise ValueError(f"job name {shown(job)} is not a job name ocrq writes")
    return m.group("tenant") or DEFAULT_TENANT, m.group("name")


def tenant_of(job: str) -> str:
    return split(job)[0]


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message may show it: its repr, cut to ``limit`` characters (a
    hostile name may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
