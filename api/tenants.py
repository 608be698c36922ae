"""Tenants and their bearer tokens: who a request is, and what it may do.

A token (``ocrq_…``, 43 random characters after the prefix) is shown once, when it is made
(``ocrq token create --tenant T``); only its sha256 is kept, in ``api.tenants`` (settings) or in
``api.tenants_file`` (what the command writes, mode 0600, and every replica reads again when its
modification time changes). A request's token is hashed and looked up; a tenant sees and controls
only its own jobs, files and batches (their names are qualified by the tenant: ``ocrq.names``).

The tenants file:

    {"tenants": {"acme": {"tokens": ["<sha256>", ...], "webhook_secret": "whsec_…",
                          "names": {"<sha256>": "ci"}, "max_in_flight": 100000, ...}}}

(any ``TenantSettings`` field, plus ``names``: what each token was made for).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq import names
from ocrq.settings import LimitSettings, Settings, TenantSettings
from producer.errors import Unauthorized

TOKEN_PREFIX = "ocrq_"
#: seconds between looks at the tenants file's modification time
_RECHECK_S = 1.0


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` + base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True)
class Tenant:
    name: str
    settings: TenantSettings

    def limits(self, fleet: LimitSettings) -> LimitSettings:
        """The ref rules this tenant's submissions are checked with (see ``TenantSettings``)."""
        s = self.settings
        if self.name == names.DEFAULT_TENANT:
            schemes = s.allowed_schemes if s.allowed_schemes is not None else fleet.allowed_schemes
        else:
            schemes = s.allowed_schemes if s.allowed_schemes is not None else ["http", "https"]
        update: dict[str, Any] = {"allowed_schemes": [x for x in schemes if x != "store"]}
        if s.s3_buckets is not None:
            update["s3_buckets"] = s.s3_buckets
        if s.allowed_roots is not None:
            update["allowed_roots"] = s.allowed_roots
        return fleet.model_copy(update=update)


def tenants_path(settings: Settings) -> Path:
    return settings.api.tenants_file or settings.var_dir / "api-tenants.json"


class Tenants:
    """Token digests → tenants, from the settings and the tenants file (re-read when it changes)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.path = tenants_path(settings)
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._checked = 0.0
        self._by_digest: dict[str, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        self._load()

    def _load(self) -> None:
        merged: dict[str, dict[str, Any]] = {n: t.model_dump(exclude_unset=True)
                                             for n, t in self.settings.api.tenants.items()}
        try:
            self._mtime = self.path.stat().st_mtime
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            self._mtime, doc = None, {}
        for name, extra in (doc.get("tenants") or {}).items():
            base = merged.setdefault(name, {})
            extra = {k: v for k, v in extra.items() if k != "names"}
            base["tokens"] = list(dict.fromkeys([*base.get("tokens", []), *extra.pop("tokens", [])]))
            for k, v in extra.items():  # (settings win over the file)
                if base.get(k) is None:
                    base[k] = v
        by_name = {n: Tenant(names.check_tenant(n), TenantSettings.model_validate(cfg)) for n, cfg in merged.items()}
        self._by_name = by_name
        self._by_digest = {d: t for t in by_name.values() for d in t.settings.tokens}

    def _fresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < _RECHECK_S:
            return
        with self._lock:
            self._checked = now
            try:
                mtime: float | None = self.path.stat().st_mtime
            except FileNotFoundError:
                mtime = None
            if mtime != self._mtime:
                self._load()

    def authenticate(self, token: str | None) -> Tenant:
        """The tenant of ``token`` (``Unauthorized`` without one, or for one ocrq does not know)."""
        if not token:
            raise Unauthorized("a bearer token is required (Authorization: Bearer ocrq_…; `ocrq token create`)")
        self._fresh()
        tenant = self._by_digest.get(digest(token))
        if tenant is None:
            raise Unauthorized("this token is not known (revoked, or from another deployment)")
        return tenant

    def get(self, name: str) -> Tenant | None:
        self._fresh()
        return self._by_name.get(name)

    def all(self) -> list[Tenant]:
        self._fresh()
        return list(self._by_name.values())


def create_token(path: Path, tenant: str, label: str = "") -> tuple[str, str | None]:
    """A new token for ``tenant``, its digest written to the tenants file at ``path`` (made with
    mode 0600); returns (the token, the tenant's webhook secret when it was made now)."""
    names.check_tenant(tenant)
    doc = _read(path)
    entry = doc.setdefault("tenants", {}).setdefault(tenant, {})
    token = new_token()
    entry.setdefault("tokens", []).append(digest(token))
    entry.setdefault("names", {})[digest(token)] = label or time.strftime("%Y-%m-%dT%H:%M:%S")
    secret = None
    if not entry.get("webhook_secret"):
        secret = entry["webhook_secret"] = new_webhook_secret()
    _write(path, doc)
    return token, secret


def revoke(path: Path, tenant: str, label_or_digest: str) -> int:
    """Remove the tenant's tokens named ``label_or_digest`` (its label, or a prefix of its digest
    of at least 8 characters); returns how many."""
    doc = _read(path)
    entry = doc.get("tenants", {}).get(tenant)
    if not entry:
        return 0
    labels = entry.get("names", {})
    doomed = [d for d in entry.get("tokens", [])
              if labels.get(d) == label_or_digest or (len(label_or_digest) >= 8 and d.startswith(label_or_digest))]
    entry["tokens"] = [d for d in entry.get("tokens", []) if d not in doomed]
    for d in doomed:
        labels.pop(d, None)
    _write(path, doc)
    return len(doomed)


def listed(path: Path) -> list[dict[str, Any]]:
    """Every token of the file: tenant, label, digest prefix (never a token: none is kept)."""
    doc = _read(path)
    return [{"tenant": t, "label": entry.get("names", {}).get(d, ""), "digest": d[:12]}
            for t, entry in doc.get("tenants", {}).items() for d in entry.get("tokens", [])]


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {"tenants": {}}
    return doc if isinstance(doc, dict) else {"tenants": {}}


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)


def ensure_token_file(settings: Settings, token_file: Path, tenant: str = names.DEFAULT_TENANT) -> bool:
    """A token of ``tenant`` in ``token_file`` (mode 0600), made now when the file is missing
    (what ``ocrq up`` does for its embedded API, as for Flower's password); True when made."""
    if token_file.exists():
        os.chmod(token_file, 0o600)
        return False
    token, _ = create_token(tenants_path(settings), tenant, "ocrq up")
    token_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return True
