"""The naive design ocrq is measured against (bench/overhead.py): plain Celery, one task per image,
Celery's Redis result backend carrying each result back.

The task does the same per-image work as an ocrq worker with the null engine (read the file,
decode it, hash it, the simulated engine's output for it) and returns the output; there is no
cache, no job index and no durable store. The worker is what `celery worker` gives by default
(prefork pool, one child per core): the design a team writes first.

    OVERHEAD_REDIS_URL=redis://127.0.0.1:PORT/0 celery -A bench.plain_celery worker
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from celery import Celery

from ocrq.engine_settings import SimulatedSettings
from ocrq.settings import LimitSettings

URL = os.environ.get("OVERHEAD_REDIS_URL", "redis://127.0.0.1:6399/0")

app = Celery("plain", broker=URL, backend=URL)
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                task_acks_late=True, worker_prefetch_multiplier=4, result_expires=3600)

_ENGINE: Any = None
_LIMITS = LimitSettings(allowed_roots=[Path("/")])


def _engine() -> Any:
    global _ENGINE
    if _ENGINE is None:
        from worker.engines.simulated import SimulatedEngine

        _ENGINE = SimulatedEngine.from_settings(SimulatedSettings(kind="simulated"))
    return _ENGINE


@app.task(name="plain.ocr_image")
def ocr_image(path: str) -> dict[str, Any]:
    from worker.decoding.images import decode
    from worker.engines.base import OcrRequest

    data = Path(path).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    pages = decode(data, _LIMITS)
    outs = _engine().infer([OcrRequest(f"{path}#{p.index}", p.image) for p in pages])
    return {"ref": path, "sha256": sha, "outputs": [o.model_dump(mode="json") for o in outs]}
