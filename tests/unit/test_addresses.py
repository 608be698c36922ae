"""ocrq.net.addresses: IPv6 forms that carry an IPv4 address are judged by it too, before any
connection (the resolver and the socket layer are fakes: no traffic is sent)."""

from __future__ import annotations

import socket

import pytest

from ocrq.errors import RefusedRef, StorageUnavailable
from ocrq.net.addresses import embedded_ipv4, is_public
from ocrq.net.fetch import fetch
from ocrq.settings import LimitSettings

#: (form, address, the IPv4 address it carries): each carries the cloud metadata address
METADATA_FORMS = [
    ("IPv4-compatible", "::169.254.169.254", "169.254.169.254"),
    ("IPv4-mapped", "::ffff:169.254.169.254", "169.254.169.254"),
    ("NAT64 well-known prefix", "64:ff9b::a9fe:a9fe", "169.254.169.254"),
    ("NAT64 local-use prefix", "64:ff9b:1::a9fe:a9fe", "169.254.169.254"),
    ("6to4", "2002:a9fe:a9fe::1", "169.254.169.254"),
    ("Teredo client", "2001:0:4136:e378:8000:63bf:5601:5601", "169.254.169.254"),
    ("IPv4-compatible loopback", "::127.0.0.1", "127.0.0.1"),
    ("6to4 private", "2002:0a00:0001::1", "10.0.0.1"),
    ("NAT64 loopback", "64:ff9b::7f00:1", "127.0.0.1"),
]


@pytest.mark.parametrize(("form", "address", "v4"), METADATA_FORMS, ids=[f[0] for f in METADATA_FORMS])
def test_an_ipv6_form_carrying_a_private_ipv4_is_not_public(form: str, address: str, v4: str) -> None:
    import ipaddress

    assert v4 in [str(a) for a in embedded_ipv4(ipaddress.ip_address(address))]
    assert not is_public(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8", "2002:0808:0808::1",
                                     "64:ff9b::808:808"])
def test_public_addresses_and_forms_carrying_public_ipv4_stay_public(address: str) -> None:
    assert is_public(address)


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "fe80::1%eth0", "fc00::1",
                                     "::", "2001:db8::1"])
def test_plain_private_addresses_are_not_public(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize(("form", "address", "v4"), METADATA_FORMS[:6], ids=[f[0] for f in METADATA_FORMS[:6]])
def test_a_name_resolving_to_such_a_form_is_refused_before_connecting(monkeypatch: pytest.MonkeyPatch, form: str,
                                                                       address: str, v4: str) -> None:
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    connects: list[object] = []

    def getaddrinfo(host: str, port: int, *args: object, **kwargs: object) -> list[tuple[object, ...]]:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port or 0, 0, 0))]

    def create_connection(addr: object, *args: object, **kwargs: object) -> None:  # a fake: never connects
        connects.append(addr)
        raise ConnectionRefusedError("fake network")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    with pytest.raises(RefusedRef, match="non-public"):
        fetch("http://metadata.example/latest/meta-data/", LimitSettings())
    assert connects == []
    with pytest.raises(StorageUnavailable):  # allowed: it would connect (the fake refuses)
        fetch("http://metadata.example/latest/meta-data/", LimitSettings(http_allow_private=True))
    assert connects
