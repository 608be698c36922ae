"""The API's answer when the broker will not take a publish (kombu's OperationalError, after
ocrq's publish gave up waiting) or Redis goes away: 503 in the API's error shape, never a 500."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from kombu.exceptions import OperationalError

from api.app import create_app
from ocrq.settings import Settings


@pytest.mark.parametrize("error", [OperationalError("The previous master is now a slave"),
                                   redis.ConnectionError("Connection refused")])
def test_a_broker_that_refuses_is_a_503_the_client_can_retry(error, tmp_path: Path):
    # Given the API on a Redis nobody listens on (no connection is made until a request needs one)
    app = create_app(Settings(redis={"url": "redis://127.0.0.1:1/0"}, store={"kind": "local", "path": tmp_path}))

    @app.get("/publish-fails")
    def publish_fails() -> None:
        raise error

    # When a request meets the error, Then it is the API's 503 "unavailable", not a server error
    r = TestClient(app, raise_server_exceptions=False).get("/publish-fails")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable"
