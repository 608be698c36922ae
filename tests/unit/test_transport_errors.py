"""kombu's ensure() on ocrq's transports keeps retrying a connection error after a reconnect: a
publish right after a Sentinel promotion can meet "not the master" more than once."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from kombu import Connection

from ocrq.broker.transport_aliases import install


class FakeProducer:
    """What ensure() revives after a reconnect (here: nothing to restore)."""

    def revive(self, channel: Any) -> None:
        pass


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "sentinel://127.0.0.1:1/0"])
def test_a_repeated_connection_error_is_retried_within_the_policy(url, monkeypatch):
    # Given ocrq's transport, with the reconnect itself faked (no server)
    install()
    conn = Connection(url)
    monkeypatch.setattr(conn, "_ensure_connection", lambda *a, **k: None)
    monkeypatch.setattr(Connection, "default_channel", property(lambda self: None))
    calls: list[int] = []

    def publish() -> str:
        calls.append(1)
        if len(calls) <= 3:
            raise redis.ConnectionError("The previous master is now a slave.")
        return "published"

    # When a publish fails three times, reconnecting in between, under a policy of 5 retries
    # Then it succeeds on the fourth try
    assert conn.ensure(FakeProducer(), publish, max_retries=5, interval_start=0, interval_max=0)() == "published"
    assert len(calls) == 4


def test_errors_past_the_policy_still_raise(monkeypatch):
    install()
    conn = Connection("sentinel://127.0.0.1:1/0")
    monkeypatch.setattr(conn, "_ensure_connection", lambda *a, **k: None)
    monkeypatch.setattr(Connection, "default_channel", property(lambda self: None))

    def publish() -> str:
        raise redis.ConnectionError("The previous master is now a slave.")

    with pytest.raises(Exception, match="previous master"):
        conn.ensure(FakeProducer(), publish, max_retries=2, interval_start=0, interval_max=0)()
