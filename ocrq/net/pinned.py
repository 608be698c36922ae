"""HTTP(S) connections pinned to the addresses their own lookup vetted: a name that re-resolves
between the check and the connect (DNS rebinding) cannot point a fetch or a webhook at an internal
service. urllib handlers, for ``ocrq.net.fetch`` and the API's webhooks."""

from __future__ import annotations

import http.client
import socket
import urllib.request
from typing import Any

from ocrq.net.addresses import public_addresses
from ocrq.net.deadline import Deadline
from ocrq.settings import LimitSettings


def pinned(base: type[http.client.HTTPConnection], limits: LimitSettings, deadline: Deadline | None = None,
           vet: bool = True) -> Any:
    """``base`` whose socket goes to an address vetted by the same lookup that checked it: a
    name that re-resolves between check and connect (DNS rebinding) cannot redirect the fetch to
    an internal service. TLS still verifies the certificate against the host name. Every socket
    it opens is watched by ``deadline`` (the TLS handshake included); ``vet=False``: through a
    proxy, which resolves the name itself (the socket is still watched)."""

    class Pinned(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = self._connect_vetted

        def _connect_vetted(self, address: tuple[str, int], timeout: Any, source_address: Any = None) -> socket.socket:
            # http.client always passes its own timeout
            host, port = address
            error: OSError | None = None
            for ip in public_addresses(host, port, limits) if vet else [host]:
                if deadline is not None:
                    if deadline.remaining() <= 0:
                        raise TimeoutError(f"no answer within http_timeout ({limits.http_timeout:g} s)")
                    timeout = min(timeout, deadline.remaining())
                try:
                    sock = socket.create_connection((ip, port), timeout, source_address)
                except OSError as exc:
                    error = exc
                    continue
                if deadline is not None:
                    deadline.watch(sock)
                return sock
            raise error or OSError(f"no address for {host}")

    return Pinned


def direct(req: urllib.request.Request) -> bool:
    """Whether urllib connects to the URL's host itself: through a proxy (plain or CONNECT
    tunnel) the proxy resolves the name, and the check cannot be pinned here."""
    return not req.has_proxy() and not getattr(req, "_tunnel_host", None)


class PinnedHTTP(urllib.request.HTTPHandler):
    def __init__(self, limits: LimitSettings, deadline: Deadline | None = None) -> None:
        super().__init__()
        self._conn = pinned(http.client.HTTPConnection, limits, deadline)
        self._proxied = pinned(http.client.HTTPConnection, limits, deadline, vet=False)

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(self._conn if direct(req) else self._proxied, req)


class PinnedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, limits: LimitSettings, deadline: Deadline | None = None) -> None:
        super().__init__()
        self._conn = pinned(http.client.HTTPSConnection, limits, deadline)
        self._proxied = pinned(http.client.HTTPSConnection, limits, deadline, vet=False)

    def https_open(self, req: urllib.request.Request) -> Any:
        cls = self._conn if direct(req) else self._proxied
        return self.do_open(cls, req, context=getattr(self, "_context", None))
