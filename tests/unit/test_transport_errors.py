"""kombu's ensure() on ocrq's transports keeps retrying a connection error after a reconnect: a
publish right after a Sentinel promotion can meet "not the master" more than once. Past kombu's
retries (spent at once), ocrq's publish waits with backoff for the broker, and a publish that
still fails is told to the user as an unreachable Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from kombu import Connection
from kombu.exceptions import OperationalError

from ocrq.broker import publish
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


def _refusing(times: int, cause: Exception) -> tuple[list[int], Any]:
    calls: list[int] = []

    def send() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise OperationalError(str(cause)) from cause
        return "published"

    return calls, send


def test_a_publish_the_broker_refuses_for_a_moment_is_sent_once_it_takes_writes(monkeypatch):
    # Given a send that kombu gave up on three times (a master without a replica in sync)
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls, send = _refusing(3, redis.ConnectionError("not the master any more (NOREPLICAS)"))
    # When ocrq's publish sends it, Then the fourth try is sent
    assert publish._riding(send, window_s=30) == "published" and len(calls) == 4


def test_a_refused_login_is_not_tried_again_and_a_broker_away_past_the_window_raises(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls, send = _refusing(5, redis.AuthenticationError("invalid password"))
    with pytest.raises(OperationalError, match="invalid password"):
        publish._riding(send, window_s=30)
    assert len(calls) == 1
    calls, send = _refusing(10**6, redis.ConnectionError("refused"))
    with pytest.raises(OperationalError, match="refused"):
        publish._riding(send, window_s=0.05)
    assert len(calls) >= 2


def test_the_cli_tells_a_publish_that_failed_as_redis_unreachable(capsys):
    from ocrq_cli.main import report
    from producer.errors import EXIT_REFUSED

    assert report(OperationalError("The previous master is now a slave")) == EXIT_REFUSED
    out = capsys.readouterr().err
    assert "Unreachable" in out and "previous master" in out and "Traceback" not in out
