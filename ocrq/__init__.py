"""ocrq: an OCR task-queue fleet (Celery on Redis, HunyuanOCR/vLLM or RapidOCR workers).

This package is the shared contract imported by both sides: settings, errors, Redis keys and
S3 prefixes, message and result schemas, references, result storage. It never imports an engine.
"""

__version__ = "0.1.0"
