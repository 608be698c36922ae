"""What a Redis server started by the embedded stack (``ocrq up``, ocrq_cli.embedded.stack) is given: a
password, and a configuration file that holds it.

A URL without a password gets one generated (``secrets.token_urlsafe``), recorded with the URL,
one a line, in ``{var}/redis-auth`` (mode 0600, like Flower's ``flower-auth``): every ocrq command
whose settings name that server without a password takes it from there
(``ocrq.settings.embedded_url``), and a later ``ocrq up`` restarts the server with the same one.
The server reads its password from a configuration file (mode 0600) rather than its command line,
which any local user reads in ``ps``; the file also renames ``CONFIG`` for clients (a client that
knows the password still cannot rewrite the server's configuration, turn persistence off or
point its dump elsewhere; the operator finds the new name in the file).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlparse

from ocrq.settings import REDIS_AUTH_FILE, RedisSettings


def with_password(var: Path, url: str) -> str:
    """``url`` with a password: its own, else one generated now and recorded in ``var``."""
    if urlparse(url).password:
        return url
    scheme, _, rest = url.partition("://")
    url = f"{scheme}://:{secrets.token_urlsafe(24)}@{rest.rpartition('@')[2]}"
    var.mkdir(parents=True, exist_ok=True)
    path = var / REDIS_AUTH_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as fh:
        fh.write(url + "\n")
    os.chmod(path, 0o600)  # (a file an older version or a person left readable)
    return url


def write_conf(data: Path, url: str, rs: RedisSettings, cache: bool) -> Path:
    """The server's configuration file under ``data`` (mode 0600): loopback, its data there, the
    URL's password, ``CONFIG`` renamed. The broker: AOF, ``noeviction`` at ``redis.max_memory``;
    ``cache``: no persistence, ``allkeys-lru`` over a little more than the hot cache's budget."""
    parsed = urlparse(url)
    lines = [f"port {parsed.port or 6379}", "bind 127.0.0.1", f'dir "{data}"', 'save ""',
             f'requirepass "{parsed.password}"', f"rename-command CONFIG CONFIG-{secrets.token_hex(8)}"]
    if cache:
        budget = rs.cache_max_bytes * 5 // 4 + 16 * 2**20
        lines += ["appendonly no", f"maxmemory {budget}", "maxmemory-policy allkeys-lru"]
    else:
        lines += ["appendonly yes", "maxmemory-policy noeviction"]
        if rs.max_memory:
            lines.append(f"maxmemory {rs.max_memory}")
    conf = data / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    os.chmod(conf, 0o600)
    return conf
