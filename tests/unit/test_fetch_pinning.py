"""HTTP fetches connect to the address their own lookup vetted (DNS rebinding). The resolver and
the socket layer are fakes: a name that resolves to a public address at check time and to
loopback afterwards must never be connected to on loopback."""

from __future__ import annotations

import socket

import pytest

from ocrq.errors import RefusedRef, StorageUnavailable
from ocrq.net.fetch import fetch
from ocrq.settings import LimitSettings

PUBLIC, INTERNAL = "93.184.216.34", "127.0.0.1"


@pytest.fixture()
def fake_net(monkeypatch: pytest.MonkeyPatch):
    """A rebinding resolver (public first, loopback after) and a socket layer that records where
    it was asked to connect and refuses."""
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    lookups: list[str] = []
    connects: list[tuple[str, int]] = []

    def getaddrinfo(host, port, *args, **kwargs):
        lookups.append(host)
        ip = PUBLIC if len(lookups) == 1 else INTERNAL
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port or 0))]

    def create_connection(address, *args, **kwargs):
        connects.append(address)
        raise ConnectionRefusedError("fake network: refused")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return lookups, connects


def test_connects_to_the_address_it_checked(fake_net) -> None:
    lookups, connects = fake_net
    with pytest.raises(StorageUnavailable):
        fetch("http://rebind.example/scan.png", LimitSettings())
    assert lookups == ["rebind.example"]  # one lookup: the one that was checked
    assert connects == [(PUBLIC, 80)]


def test_https_is_pinned_too(fake_net) -> None:
    lookups, connects = fake_net
    with pytest.raises(StorageUnavailable):
        fetch("https://rebind.example/scan.png", LimitSettings())
    assert lookups == ["rebind.example"] and connects == [(PUBLIC, 443)]


def test_a_private_answer_is_refused_before_connecting(fake_net) -> None:
    lookups, connects = fake_net
    lookups.append("primed")  # the fake now answers loopback
    with pytest.raises(RefusedRef, match="non-public"):
        fetch("http://internal.example/x.png", LimitSettings())
    assert connects == []
