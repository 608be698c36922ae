"""Sentinel URLs: what they name, what Celery is told, what logs show (no server needed)."""

from __future__ import annotations

import pytest

from ocrq.broker import redis_conn
from ocrq.settings import RedisSettings

URL = "sentinel://:s3cret@10.0.0.1:26379/2;sentinel://10.0.0.2/2;sentinel://10.0.0.3:26380/2"


def test_a_sentinel_url_names_the_sentinels_the_database_and_the_servers_password():
    target = redis_conn.parse_sentinel(URL)
    assert target.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26380)]
    assert target.db == 2 and target.password == "s3cret" and target.username is None


@pytest.mark.parametrize(("url", "sentinel"), [(URL, True), ("SENTINEL://h:1", True),
                                               ("redis://127.0.0.1:6379/0", False), ("rediss://h/0", False)])
def test_only_sentinel_urls_are_sentinel(url, sentinel):
    assert redis_conn.is_sentinel(url) is sentinel


def test_a_url_mixing_schemes_is_refused_naming_the_part():
    with pytest.raises(ValueError, match="redis://h:6379"):
        redis_conn.parse_sentinel("sentinel://a:26379;redis://h:6379")


def test_celery_gets_the_master_name_and_the_sentinels_password_and_tls_only_on_sentinel(tmp_path):
    assert redis_conn.celery_options(RedisSettings()) == {}
    ca = tmp_path / "ca.pem"
    opts = redis_conn.celery_options(RedisSettings(url=URL, master_name="fleet", sentinel_password="sp",
                                                   sentinel_tls=True, sentinel_tls_ca=ca))
    assert opts["master_name"] == "fleet"
    assert opts["sentinel_kwargs"]["password"] == "sp"
    assert opts["sentinel_kwargs"]["ssl"] is True and opts["sentinel_kwargs"]["ssl_ca_certs"] == str(ca)


def test_with_sentinel_tls_celery_reaches_the_master_over_tls_too(tmp_path):
    import ssl

    from ocrq.broker.queue import make_celery
    from ocrq.settings import Settings

    ca = tmp_path / "ca.pem"
    assert redis_conn.celery_tls(RedisSettings()) is None
    assert redis_conn.celery_tls(RedisSettings(url=URL)) is None
    tls = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(ca)}
    assert redis_conn.celery_tls(RedisSettings(url=URL, sentinel_tls=True, sentinel_tls_ca=ca)) == tls
    app = make_celery(Settings(redis={"url": URL, "sentinel_tls": True, "sentinel_tls_ca": ca}))
    assert app.conf.broker_use_ssl == tls and app.conf.redis_backend_use_ssl == tls
    assert not make_celery(Settings(redis={"url": URL})).conf.broker_use_ssl


def test_passwords_are_redacted_in_every_part():
    shown = redis_conn.redacted("sentinel://:pw1@a:26379/0;sentinel://:pw2@b:26379/0")
    assert "pw1" not in shown and "pw2" not in shown and shown.count(":***@") == 2


def test_a_sentinel_client_follows_the_master_and_retries_for_the_window():
    client = redis_conn.client(RedisSettings(url=URL, master_name="fleet"))  # no I/O until a command
    pool = client.connection_pool
    assert pool.connection_class is redis_conn.FollowingConnection and pool.service_name == "fleet"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "s3cret"
    assert isinstance(pool.connection_kwargs["retry"], redis_conn.DeadlineRetry)


def test_the_deadline_retry_gives_up_after_its_window_not_after_a_count():
    import redis

    retry = redis_conn.DeadlineRetry(window_s=0.3)
    calls = []

    def fail() -> None:
        calls.append(1)
        raise redis.ConnectionError("down")

    with pytest.raises(redis.ConnectionError):
        retry.call_with_retry(fail, lambda error: None)
    assert 3 <= len(calls) <= 10
