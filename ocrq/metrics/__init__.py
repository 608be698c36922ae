"""Prometheus: the Redis-level series one exporter serves for the whole fleet and that workers
reuse for their own queues (``redis_series``), and the HTTP server every ``/metrics`` runs on
(``server``: loopback unless set, optional basic auth)."""
