"""Which kombu transport each broker URL scheme names in this process: ocrq's (``ocrq.broker.transport``
for ``redis://`` and ``rediss://``, ``ocrq.broker.transport_sentinel`` for ``sentinel://``), so broker URLs
keep their scheme (Flower picks its broker reader from it)."""

from __future__ import annotations

#: the kombu minor versions whose Redis channel internals (``_in_poll``, ``_brpop_sent_at``,
#: the BRPOP start/read pair) this transport was written and tested against
KOMBU_TESTED = ((5, 7),)

_ALIASES = {
    "redis": "ocrq.broker.transport:Transport",
    "rediss": "ocrq.broker.transport:Transport",
    # the same transport on a pool that follows the master
    "sentinel": "ocrq.broker.transport_sentinel:Transport",
}


def install() -> None:
    """Make ``redis://``, ``rediss://`` and ``sentinel://`` connections in this process use ocrq's
    transport."""
    import kombu
    import kombu.transport as kt

    version = tuple(int(p) for p in kombu.__version__.split(".")[:2])
    if version not in KOMBU_TESTED:
        raise RuntimeError(f"ocrq's broker transport overrides kombu's Redis channel internals and is tested "
                           f"with kombu {KOMBU_TESTED}, not {kombu.__version__}: install kombu>=5.7,<5.8")

    for scheme, target in _ALIASES.items():
        if kt.TRANSPORT_ALIASES.get(scheme) != target:
            kt.TRANSPORT_ALIASES[scheme] = target
            kt._transport_cache.pop(scheme, None)
