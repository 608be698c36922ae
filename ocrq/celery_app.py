"""The ocrq Celery app as a module attribute, for tools that take ``-A`` (Flower, ``celery
inspect``): ``celery -A ocrq.celery_app flower``. Built from the process's settings (OCRQ_* env,
``OCRQ_CONFIG``) when this module is imported; nothing else in ocrq imports it."""

from __future__ import annotations

from ocrq.queue import make_celery
from ocrq.settings import load_settings

app = make_celery(load_settings())
