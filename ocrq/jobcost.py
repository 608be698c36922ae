"""What a job cost: the engine seconds its images shared (``ImageRecord.engine_s``: each batch's
time split over its images), throughput, and dollars per 1,000 images at ``gpu_hour_usd`` —
olmOCR's "$ per million pages", per job. Cache hits and failures cost no engine time.

Read from the job index (one HSCAN of the job's records), so it is exact for any finished job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ocrq.jobs import JobIndex
from ocrq.results import ImageStatus


@dataclass
class JobCost:
    images: int
    done: int
    engine_images: int
    gpu_seconds: float
    wall_seconds: float
    img_per_s: float
    gpu_hour_usd: float
    usd: float
    usd_per_1000_images: float
    batches: int

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def job_cost(index: JobIndex, job: str, gpu_hour_usd: float) -> JobCost:
    images = done = engine_images = 0
    gpu_s = 0.0
    first = last = None
    batches: set[str] = set()
    for rec in index.scan(job):
        images += 1
        if rec.status == ImageStatus.done:
            done += 1
            last = rec.updated if last is None else max(last, rec.updated)
        if rec.engine_s is not None:
            engine_images += 1
            gpu_s += rec.engine_s
            if rec.batch:
                batches.add(rec.batch)
    created = index.meta(job).get("created")
    first = float(created) if created is not None else None
    wall = max(0.0, (last - first)) if first is not None and last is not None else 0.0
    usd = gpu_s / 3600 * gpu_hour_usd
    return JobCost(images=images, done=done, engine_images=engine_images, gpu_seconds=gpu_s, wall_seconds=wall,
                   img_per_s=done / wall if wall > 0 else 0.0, gpu_hour_usd=gpu_hour_usd, usd=usd,
                   usd_per_1000_images=usd / done * 1000 if done else 0.0, batches=len(batches))
