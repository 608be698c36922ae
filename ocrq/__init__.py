"""ocrq: an OCR task-queue fleet (Celery on Redis, HunyuanOCR/vLLM or RapidOCR workers).

This package is the shared contract imported by both sides: settings, errors, Redis keys and
S3 prefixes, message and result schemas, references, result storage. It imports neither side
(``producer``, ``worker``) nor the command line above them (``ocrq_cli``): tests/unit/test_layers.py.
"""

__version__ = "0.1.0"
