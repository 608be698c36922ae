"""Every Redis client ocrq opens comes from here: plain ``redis://``/``rediss://`` URLs, or Sentinel.

A Sentinel URL is Celery's: ``sentinel://:password@h1:26379/0;sentinel://h2:26379/0``. The
password in it is the Redis servers'; the Sentinels' own is ``redis.sentinel_password``, the
monitored master's name ``redis.master_name`` (``redis.cache_master_name`` for a Sentinel
``cache_url``), TLS ``redis.sentinel_tls`` (+ ``sentinel_tls_ca``).

A client on a Sentinel URL talks to the master through ``FollowingConnection``:

- every (re)connect asks the Sentinels where the master is now. A plain connection that loses its
  server reconnects to the address it had, so after a failover it waits for the dead master to
  come back (celery#6348);
- a server that answers ``READONLY`` (a master demoted to a replica while the connection stayed
  open: celery#7946), that unblocks a ``BRPOP`` because it was demoted, or that refuses a write
  for want of replicas (``NOREPLICAS``: ``min-replicas-to-write``) is not the master to write to:
  the connection drops and the error is a ``ConnectionError``, which the client's retry policy
  (``RETRY``: ~30 s of reconnecting) and kombu treat as "reconnect", never as fatal.

Clients retry on connection errors (a plain URL too: a restarted Redis). A retried write may have
reached the old master: every ocrq script is idempotent for a retry (docs/reliability.md,
"Failover").
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from ocrq.settings import RedisSettings

T = TypeVar("T")

#: replies that mean "this server is not the master to write to (any more)"
NOT_MASTER = ("READONLY", "UNBLOCKED force unblock", "NOREPLICAS", "MASTERDOWN", "LOADING")
#: how long a client keeps reconnecting before an operation fails: a Sentinel failover takes
#: down-after-milliseconds + an election (a few seconds); a worker's chunk then waits it out
RETRY_WINDOW_S = 30.0


class DeadlineRetry(Retry):
    """Retry for ``window_s`` seconds from the first failure (backoff 50 ms doubling to 1 s),
    however many attempts that takes: a count of attempts is spent fast by the instant refusals of
    a dead server and slowly by timeouts, a failover lasts what it lasts."""

    def __init__(self, window_s: float = RETRY_WINDOW_S,
                 supported_errors: tuple[type[Exception], ...] = (RedisConnectionError, RedisTimeoutError,
                                                                  socket.timeout)) -> None:
        super().__init__(ExponentialBackoff(cap=1.0, base=0.05), retries=-1, supported_errors=supported_errors)
        self.window_s = window_s

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any],
                        is_retryable: Callable[[Exception], bool] | None = None,
                        with_failure_count: bool = False) -> T:
        self._backoff.reset()
        failures = 0
        started = time.monotonic()
        while True:
            try:
                return do()
            except self._supported_errors as error:
                failures += 1
                checker = getattr(self, "_is_retryable", None)
                retryable = (checker is None or checker(error)) and (is_retryable is None or is_retryable(error))
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if not retryable or time.monotonic() - started > self.window_s:
                    raise
                time.sleep(self._backoff.compute(failures))


def retry_policy() -> Retry:
    """Reconnect with backoff for about ``RETRY_WINDOW_S``."""
    return DeadlineRetry()


def no_retry() -> Retry:
    """One attempt: for probes that must answer quickly ("is Redis up?")."""
    return Retry(ExponentialBackoff(), retries=0)


def _not_master(exc: Exception) -> bool:
    return isinstance(exc, ReadOnlyError) or str(exc).startswith(NOT_MASTER)


class FollowingConnection(SentinelManagedConnection):
    """A connection to whatever the Sentinels call the master: looked up on every connect, and
    dropped (a retryable ``ConnectionError``) when the server answers as a replica.

    redis-py's ``SentinelManagedConnection`` looks the master up in ``connect()`` only; a command
    sent on a dropped connection reconnects through ``connect_check_health`` straight to the
    address it had, so a client retrying after a failover kept talking to the demoted or dead
    server. Here the lookup is in the socket connect itself, on every path."""

    def _connect(self) -> Any:
        if self.connection_pool.is_master:
            self.host, self.port = self.connection_pool.get_master_address()
        return super()._connect()

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if self.connection_pool.is_master and _not_master(exc):
                self.disconnect()
                raise RedisConnectionError(f"not the master any more ({exc}): reconnecting through Sentinel") from exc
            raise


class FollowingSSLConnection(FollowingConnection, SentinelManagedSSLConnection):
    """``FollowingConnection`` over TLS."""


@dataclass(frozen=True)
class SentinelTarget:
    """What a Sentinel URL names: the Sentinels, the database, the Redis servers' credentials."""

    sentinels: list[tuple[str, int]]
    db: int
    username: str | None
    password: str | None


def is_sentinel(url: str | None) -> bool:
    return bool(url) and str(url).split(";", 1)[0].strip().lower().startswith("sentinel://")


def parse_sentinel(url: str) -> SentinelTarget:
    """``sentinel://[user:pass@]host:port[/db]`` joined by ``;`` (Celery's and kombu's format)."""
    sentinels: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    for part in url.split(";"):
        part = part.strip()
        if not part:
            continue
        parsed = urlparse(part)
        if parsed.scheme.lower() != "sentinel" or not parsed.hostname:
            raise ValueError(f"redis.url: {part!r} is not sentinel://host:port (join Sentinels with ';')")
        sentinels.append((parsed.hostname, parsed.port or 26379))
        if parsed.path.strip("/"):
            db = int(parsed.path.strip("/"))
        username = unquote(parsed.username) if parsed.username else username
        password = unquote(parsed.password) if parsed.password else password
    if not sentinels:
        raise ValueError("redis.url: no Sentinel in the URL")
    return SentinelTarget(sentinels, db, username, password)


def _tls_kwargs(settings: RedisSettings) -> dict[str, Any]:
    if not settings.sentinel_tls:
        return {}
    out: dict[str, Any] = {"ssl": True, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    if settings.sentinel_tls_ca:
        out["ssl_ca_certs"] = str(settings.sentinel_tls_ca)
    return out


def sentinel_for(settings: RedisSettings, url: str | None = None, timeout: float = 2.0, **kwargs: Any) -> Sentinel:
    """A ``redis.sentinel.Sentinel`` on the URL's Sentinels (their password and TLS from settings)."""
    target = parse_sentinel(url or settings.url)
    sentinel_kwargs: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                                       **_tls_kwargs(settings)}
    if settings.sentinel_password is not None:
        sentinel_kwargs["password"] = settings.sentinel_password.get_secret_value()
    return Sentinel(target.sentinels, sentinel_kwargs=sentinel_kwargs, **kwargs)


def client(settings: RedisSettings, url: str | None = None, *, master_name: str | None = None,
           **kwargs: Any) -> redis.Redis:
    """The client for ``url`` (default ``settings.url``): a Sentinel URL gives a client that
    follows the master; either kind retries connection errors for about ``RETRY_WINDOW_S``.
    ``kwargs`` go to ``redis.Redis`` (timeouts, health_check_interval, decode_responses)."""
    url = url or settings.url
    kwargs.setdefault("retry", retry_policy())
    kwargs.setdefault("retry_on_error", [RedisConnectionError, RedisTimeoutError])
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    target = parse_sentinel(url)
    tls = _tls_kwargs(settings)
    conn_kwargs = {k: v for k, v in tls.items() if k != "ssl"}
    return sentinel_for(settings, url).master_for(
        master_name or settings.master_name, redis_class=redis.Redis,
        connection_class=FollowingSSLConnection if tls else FollowingConnection,
        db=target.db, username=target.username, password=target.password, **conn_kwargs, **kwargs)


#: how long a command line waits for Redis to answer before it says Redis cannot be reached
PROBE_TIMEOUT_S = 3.0


def probe(settings: RedisSettings, timeout: float = PROBE_TIMEOUT_S, url: str | None = None) -> None:
    """One ``PING`` within about ``timeout`` seconds, not retried: a ``redis.ConnectionError`` (or
    ``TimeoutError``) when Redis cannot be reached. The clients above reconnect for
    ``RETRY_WINDOW_S`` (right for a worker through a restart or a failover, 30 s of silence for
    a person at a prompt who mistyped the URL). On a Sentinel URL, Sentinels that answer but
    name no master yet (a failover under way) pass: the clients' own retries wait for it."""
    url = url or settings.url
    if not is_sentinel(url):
        c = redis.Redis.from_url(url, retry=no_retry(), socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            c.ping()
        finally:
            c.close()
        return
    sentinels = parse_sentinel(url).sentinels
    sentinel = sentinel_for(settings, url, timeout=max(0.2, timeout / len(sentinels)))
    try:
        sentinel.discover_master(settings.master_name)
    except MasterNotFoundError:
        for s in sentinel.sentinels:
            try:
                s.ping()
                return  # a Sentinel answers: the master is being elected
            except (RedisConnectionError, RedisTimeoutError):
                continue
        raise


def cache_client(settings: RedisSettings, **kwargs: Any) -> redis.Redis | None:
    """The hot cache's own client when ``cache_url`` names another Redis, else None (the broker's)."""
    if not settings.cache_url or settings.cache_url == settings.url:
        return None
    return client(settings, settings.cache_url, master_name=settings.cache_master_name or settings.master_name,
                  **kwargs)


def master_address(settings: RedisSettings, url: str | None = None) -> tuple[str, int] | None:
    """Where the Sentinels say the master is now (None for a plain URL)."""
    url = url or settings.url
    if not is_sentinel(url):
        return None
    host, port = sentinel_for(settings, url).discover_master(settings.master_name)
    return str(host), int(port)


def celery_options(settings: RedisSettings) -> dict[str, Any]:
    """Options Celery's broker and result backend need for ``settings.url`` (empty for plain
    URLs): the master name, the Sentinels' password and TLS."""
    if not is_sentinel(settings.url):
        return {}
    opts: dict[str, Any] = {"master_name": settings.master_name}
    sentinel_kwargs: dict[str, Any] = dict(_tls_kwargs(settings))
    if settings.sentinel_password is not None:
        sentinel_kwargs["password"] = settings.sentinel_password.get_secret_value()
    if sentinel_kwargs:
        opts["sentinel_kwargs"] = sentinel_kwargs
    return opts


def celery_tls(settings: RedisSettings) -> dict[str, Any] | None:
    """Celery's ``broker_use_ssl`` and ``redis_backend_use_ssl`` for a Sentinel URL with
    ``sentinel_tls`` (None otherwise): TLS to the master the Sentinels name. The Sentinels'
    ``sentinel_kwargs`` reach only the Sentinels; without this kombu and Celery's result backend
    opened the master's connection in plain text and a TLS-only server reset it."""
    if not is_sentinel(settings.url) or not settings.sentinel_tls:
        return None
    return {k: v for k, v in _tls_kwargs(settings).items() if k != "ssl"}


def redacted(url: str) -> str:
    """``url`` without its passwords (for messages and logs)."""
    out = []
    for part in url.split(";"):
        parsed = urlparse(part)
        if parsed.password:
            part = part.replace(f":{parsed.password}@", ":***@", 1)
        out.append(part)
    return ";".join(out)
