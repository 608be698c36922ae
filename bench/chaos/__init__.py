"""The chaos suite behind ``make reliability`` (``python -m bench.chaos``): load through real
Redis, real ``ocrq worker`` processes and moto's S3 server while faults are injected, then a
check that every accepted image ended exactly once. docs/reliability.md has the table."""
