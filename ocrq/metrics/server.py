"""The HTTP server of every ``/metrics`` ocrq serves (each worker's, ``ocrq metrics``): on
loopback unless an address is given (``metrics_addr``: a deployment that a Prometheus elsewhere
scrapes sets it, as docker-compose.yml does), and behind HTTP basic auth when
``metrics_basic_auth`` is set (``user:pass``, several comma-separated): the series name jobs,
queues, workers and hosts.

prometheus-client's exposition (``make_wsgi_app``: content negotiation, gzip, ``?name[]=``)
behind a small WSGI guard, served by threads (a slow scraper holds one thread, not the server).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape is noise
        pass


def guarded(app: WsgiApp, credentials: str | None) -> WsgiApp:
    """``app`` behind basic auth for any of ``credentials`` ("user:pass,user2:pass2"); None: open."""
    if not credentials:
        return app
    allowed = [c.strip().encode() for c in credentials.split(",") if c.strip()]

    def check(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = str(environ.get("HTTP_AUTHORIZATION", ""))
        given = b""
        if header[:6].lower() == "basic ":
            try:
                given = base64.b64decode(header[6:].strip(), validate=True)
            except (binascii.Error, ValueError):
                given = b""
        if not any(hmac.compare_digest(given, one) for one in allowed):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="ocrq metrics"'),
                                                ("Content-Type", "text/plain; charset=utf-8")])
            return [b"basic auth required (metrics_basic_auth)\n"]
        return app(environ, start_response)

    return check


def start(registry: CollectorRegistry, addr: str, port: int, credentials: str | None = None
          ) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``addr:port`` in a daemon thread; (the server, its thread)."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    server: WSGIServer = make_server(addr, port, guarded(make_wsgi_app(registry), credentials), server_class, _Quiet)
    thread = threading.Thread(target=server.serve_forever, name="ocrq-metrics", daemon=True)
    thread.start()
    return server, thread
