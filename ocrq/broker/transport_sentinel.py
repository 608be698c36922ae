"""ocrq's broker transport (ocrq.broker.transport) on a Sentinel URL: the same atomic take-and-record, on
a pool that follows the master.

Kombu's own Sentinel transport builds its pool from redis-py's ``SentinelManagedConnection``;
Celery on it fails over badly: a demoted master's ``READONLY`` reply is a ``ResponseError``, fatal
to the consumer (celery#7946), and the channel's BRPOP connection keeps waiting on the old server.
Here the pool's connections are ``ocrq.broker.redis_conn.FollowingConnection``: each connect asks the
Sentinels for the master, and a reply that says "not the master" is a ``ConnectionError``, the
kind of error kombu and Celery answer by reconnecting. The pool is dropped with the connection
(kombu's ``_disconnect_pools``), so a reconnect starts from what the Sentinels say now.

``ocrq.broker.transport_aliases.install()`` points kombu's ``sentinel`` alias here.
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import redis as kredis

from ocrq.broker import redis_conn
from ocrq.broker import transport as base


class Channel(base.Channel, kredis.SentinelChannel):
    """ocrq's channel (claim script, wake-up tokens, delivery-scoped acks) on a Sentinel pool."""

    connection_class = redis_conn.FollowingConnection
    # redis-py's SentinelManagedSSLConnection, as kombu's own is (kombu types it as its class)
    connection_class_ssl = redis_conn.FollowingSSLConnection  # type: ignore[assignment]

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> Any:
        pool = super()._sentinel_managed_pool(asynchronous)
        # kombu's pool uses redis-py's SentinelManagedConnection: use the following kind. TLS
        # (``broker_use_ssl``) shows as an SSLConnection subclass: kombu's own
        # SentinelManagedSSLConnection, or ours (which is not a subclass of kombu's)
        pool.connection_class = (redis_conn.FollowingSSLConnection
                                 if issubclass(pool.connection_class, redis.SSLConnection)
                                 else redis_conn.FollowingConnection)
        # no retry inside redis-py: a connection error goes to kombu, which reconnects the channel
        # (and asks Sentinel again). redis-py's retry reconnects a PUBSUB connection in place and
        # then blocks the worker's event loop reading the fresh socket (the consumer stops)
        pool.connection_kwargs["retry"] = redis_conn.no_retry()
        return pool


class Transport(kredis.SentinelTransport):
    Channel = Channel
    recoverable_connection_errors = base.Transport.recoverable_connection_errors  # (see there)
