"""The Celery application, built from settings (never at import time).

Choices (docs/ARCHITECTURE.md explains them):
- JSON only, for tasks and results: messages are a schema (ocrq.messages), never pickles.
- ``acks_late`` + ``reject_on_worker_lost``: a message is acked only after its results are
  stored; a worker killed mid-chunk gives the chunk back to the queue.
- ``visibility_timeout`` (Redis transport): an unacked message is redelivered after this many
  seconds; it must exceed the longest chunk attempt, so it defaults to 1 h.
- prefetch multiplier 1: a worker reserves at most ``concurrency`` chunks, and the prefetch
  window is further narrowed by the governor (worker.prefetch) so no worker hoards the queue.
- task events on, so Flower shows workers, tasks, retries and failures.
- on Redis, ocrq's broker transport (ocrq.broker.transport): a worker takes a message and records it
  unacked in one atomic step, so a kill or a Redis restart at that moment loses nothing.
"""

from __future__ import annotations

from celery import Celery

from ocrq.broker.redis_conn import celery_options, celery_tls, is_sentinel
from ocrq.broker.transport_aliases import install as install_transport
from ocrq.settings import Settings

#: kombu's ensure() policy for publishing on a Sentinel URL: 20 tries; the pauses (0.1, 0.6, 1.1,
#: 1.6, then 2 s) are kombu's between connects that fail. A connect that succeeds to a server that
#: then refuses is tried again at once: ocrq.broker.publish waits out that kind
PUBLISH_RETRY_POLICY = {"max_retries": 20, "interval_start": 0.1, "interval_step": 0.5, "interval_max": 2.0}


def make_celery(settings: Settings, name: str = "ocrq") -> Celery:
    install_transport()
    app = Celery(name, broker=settings.redis.url, backend=settings.redis.url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        task_default_queue=settings.queue.name,
        task_track_started=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.redis.visibility_timeout,
            # kombu sweeps every interval × throttle seconds; one knob, one sweep per interval
            "unacked_restore_interval": settings.redis.unacked_restore_s,
            "unacked_restore_throttle": 1,
            # 0..9 priority levels; Redis emulates them with one list per level
            "queue_order_strategy": "priority",
            "priority_steps": list(range(10)),
            # a Sentinel URL: the master's name, the Sentinels' password and TLS (ocrq.broker.redis_conn)
            **celery_options(settings.redis),
        },
        result_backend_transport_options={"visibility_timeout": settings.redis.visibility_timeout,
                                          **celery_options(settings.redis)},
        # chunk results are tiny summaries; the real results are in the job index and the store
        result_expires=24 * 3600,
    )
    if is_sentinel(settings.redis.url):
        # a publish (and its queue declare) that cannot connect (the Sentinels away) tries again
        # for ~35 s (Celery's default gives up after ~0.6 s)
        app.conf.task_publish_retry_policy = PUBLISH_RETRY_POLICY
    tls = celery_tls(settings.redis)
    if tls:  # Sentinel with TLS: the master's connection too, for the broker and the results
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=dict(tls))
    return app
