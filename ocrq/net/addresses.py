"""Which addresses a fetch may connect to: public ones only, unless ``limits.http_allow_private``.

Python's ``is_global`` judges an IPv6 address by its own ranges, and several ranges carry an IPv4
address inside: ``::169.254.169.254`` (IPv4-compatible, deprecated), ``::ffff:…`` (IPv4-mapped),
``64:ff9b::/96`` and ``64:ff9b:1::/48`` (NAT64: a gateway connects to the IPv4 address in the last
32 bits), ``2002::/16`` (6to4: the IPv4 address in bits 16-48) and ``2001::/32`` (Teredo: the
server and the obfuscated client). Python calls several of those global whatever IPv4 address
they carry, so a name resolving to ``64:ff9b::a9fe:a9fe`` reached the cloud metadata service
through a NAT64 gateway. Here an address is public only when it is global and so is every IPv4
address it embeds.
"""

from __future__ import annotations

import ipaddress
import socket

from ocrq.errors import HostNotFound, RefusedRef, StorageUnavailable
from ocrq.settings import LimitSettings

_COMPATIBLE = ipaddress.ip_network("::/96")
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: getaddrinfo's "no such name" answers (EAI_NODATA is not defined everywhere)
_NO_SUCH_HOST = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)


def embedded_ipv4(addr: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (none for an IPv4 address)."""
    if isinstance(addr, ipaddress.IPv4Address):
        return []
    out: list[ipaddress.IPv4Address] = []
    low32 = ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    if addr.ipv4_mapped is not None:
        out.append(addr.ipv4_mapped)
    elif addr in _COMPATIBLE and int(addr) > 1:  # (not :: nor ::1)
        out.append(low32)
    if any(addr in net for net in _NAT64):
        out.append(low32)
    if addr.sixtofour is not None:
        out.append(addr.sixtofour)
    if addr.teredo is not None:
        out.extend(addr.teredo)
    return out


def is_public(text: str) -> bool:
    """Whether a fetch may connect to the address ``text`` (scope ids ``%eth0`` ignored)."""
    addr = ipaddress.ip_address(text.split("%")[0])
    return addr.is_global and all(v4.is_global for v4 in embedded_ipv4(addr))


def public_addresses(host: str, port: int, limits: LimitSettings) -> list[str]:
    """Resolve ``host`` once; refuse it if any address is not public (unless allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_HOST:  # NXDOMAIN: retrying cannot make the name exist
            raise HostNotFound(f"host does not resolve: {host}: {exc}") from exc
        raise StorageUnavailable(f"cannot resolve {host}: {exc}") from exc
    addresses = [str(info[4][0]).split("%")[0] for info in infos]
    if not limits.http_allow_private:
        for text in addresses:  # (an IPv6 address is judged with the IPv4 ones it embeds too)
            if not is_public(text):
                raise RefusedRef(f"{host} resolves to a non-public address ({text})")
    return list(dict.fromkeys(addresses))
