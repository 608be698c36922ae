"""Redis as the broker and how ocrq talks to it: one factory for every client (``redis_conn``:
TLS, Sentinel), the Lua scripts and their loading (``scripts``), kombu's transport with a
take-and-record that cannot drop a message (``transport``, ``transport_sentinel``,
``transport_aliases``), the Celery app (``queue``; ``celery_app`` for ``celery -A``) and the one
way messages are published (``publish``). Above the contract; the jobs, the metrics and both
sides build on it."""
