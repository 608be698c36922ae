"""The ocrq Celery app as a module attribute, for tools that take ``-A`` (Flower, ``celery
inspect``): ``celery -A ocrq.broker.celery_app flower``. Built from the process's settings (OCRQ_* env,
``OCRQ_CONFIG``) when this module is imported; nothing else in ocrq imports it.

On a Sentinel URL, Flower's queue-length reader (its Broker page and ``/api/queues/length``)
asks only the first Sentinel of the URL (Flower 2.2 builds its Sentinel from the one address
kombu's ``as_uri`` gives), so with that Sentinel down the page failed with "No master found".
``flower_reads_every_sentinel`` gives it every Sentinel of ``redis.url``.
"""

from __future__ import annotations

from typing import Any

from ocrq.broker.queue import make_celery
from ocrq.broker.redis_conn import is_sentinel, parse_sentinel
from ocrq.settings import Settings, load_settings


def flower_reads_every_sentinel(settings: Settings) -> None:
    """Point Flower's Sentinel queue-length reader at every Sentinel of ``redis.url`` (a no-op
    without Flower or on a plain URL)."""
    if not is_sentinel(settings.redis.url):
        return
    try:
        from flower.utils import broker
    except ImportError:
        return
    sentinels = parse_sentinel(settings.redis.url).sentinels
    stock: Any = getattr(broker, "RedisSentinel", None)
    if stock is None or getattr(stock, "ocrq_sentinels", None) is not None:
        return

    class EverySentinel(stock):
        ocrq_sentinels = sentinels

        def _get_redis_client(self, *args: Any, **kwargs: Any) -> Any:
            client = super()._get_redis_client(*args, **kwargs)
            manager = client.connection_pool.sentinel_manager
            one = type(manager.sentinels[0])
            manager.sentinels = [one(host=host, port=port, **manager.sentinel_kwargs) for host, port in sentinels]
            return client

    broker.RedisSentinel = EverySentinel


settings = load_settings()
app = make_celery(settings)
flower_reads_every_sentinel(settings)
