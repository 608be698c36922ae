"""What a job cost: the engine seconds its images shared (``ImageRecord.engine_s``: each batch's
time split over its images), throughput, and dollars per 1,000 images — olmOCR's "$ per million
pages", per job. Cache hits and failures cost no engine time.

The seconds are named by what measured them: GPU-seconds priced at ``gpu_hour_usd`` when the
job's engines ran on GPUs, CPU-seconds at ``cpu_hour_usd`` when they ran on CPUs (RapidOCR, or an
engine on a host without a GPU), as the workers noted in the job's meta (``ocrq.jobs.progress``);
"engine-seconds" at the GPU price for a job that ran on both, or before workers noted it.

Read from the job's counts, which the index script sums as each image is first recorded done (one
round trip, whatever the job's size, and still there once the job is archived). ``batches`` adds
each image's share of its batch (1 / batch size): the batches of the job when they held only its
images.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ocrq.jobs.index import JobIndex
from ocrq.jobs.progress import engines

#: what the engine seconds are called, by the device the job's engines ran on
UNITS = {"gpu": "GPU-s", "cpu": "CPU-s", "mixed": "engine-s", "unknown": "engine-s"}


@dataclass
class JobCost:
    images: int
    done: int
    engine_images: int
    #: seconds of engine time the job's images shared, measured on ``device``
    engine_seconds: float
    wall_seconds: float
    img_per_s: float
    #: "gpu" | "cpu" | "mixed" (both ran it) | "unknown" (not noted: no engine work, or an older job)
    device: str
    #: the engine kinds that ran it
    engines: list[str]
    #: how the seconds are named ("GPU-s", "CPU-s", "engine-s") and the hourly price applied
    unit: str
    hour_usd: float
    usd: float
    usd_per_1000_images: float
    batches: int
    #: store requests the job made (its chunks, export and refs shards), per image, and what they
    #: cost per 1,000 images at ``store.put_usd_per_1000`` / ``get_usd_per_1000``
    store_puts_per_image: float = 0.0
    store_gets_per_image: float = 0.0
    store_usd_per_1000_images: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def job_cost(index: JobIndex, job: str, gpu_hour_usd: float, put_usd_per_1000: float = 0.005,
             get_usd_per_1000: float = 0.0004, cpu_hour_usd: float = 0.10) -> JobCost:
    return cost_of(index.counts(job), index.cost(job), index.meta(job), gpu_hour_usd, put_usd_per_1000,
                   get_usd_per_1000, cpu_hour_usd)


def cost_of(counts: dict[str, int], cost: dict[str, float], meta: dict[str, Any], gpu_hour_usd: float,
            put_usd_per_1000: float = 0.005, get_usd_per_1000: float = 0.0004, cpu_hour_usd: float = 0.10
            ) -> JobCost:
    """``job_cost`` from what the index holds (``JobIndex.counts``, ``cost`` and ``meta``): a
    reader with those in hand (a page of jobs read in one pipeline) pays no more."""
    created = meta.get("created")
    ran = engines(meta)
    device = _device(set(ran.values()))
    hour_usd = cpu_hour_usd if device == "cpu" else gpu_hour_usd
    first = float(created) if created is not None else None
    last = cost["last_done"] or None
    wall = max(0.0, (last - first)) if first is not None and last is not None else 0.0
    engine_s = cost["engine_s"]
    done = counts["done"]
    usd = engine_s / 3600 * hour_usd
    images = max(counts["total"], 1)
    puts, gets = cost["store_puts"] / images, cost["store_gets"] / images
    store_usd = (puts * put_usd_per_1000 + gets * get_usd_per_1000)  # per 1,000 images: per image × 1,000 / 1,000
    return JobCost(images=counts["total"], done=done, engine_images=int(cost["engine_images"]),
                   engine_seconds=engine_s, wall_seconds=wall, img_per_s=done / wall if wall > 0 else 0.0,
                   device=device, engines=sorted(ran), unit=UNITS[device], hour_usd=hour_usd, usd=usd,
                   usd_per_1000_images=usd / done * 1000 if done else 0.0, batches=round(cost["batches"]),
                   store_puts_per_image=puts, store_gets_per_image=gets, store_usd_per_1000_images=store_usd)


def _device(devices: set[str]) -> str:
    if not devices:
        return "unknown"
    if len(devices) == 1 and devices <= {"cpu", "gpu"}:
        return next(iter(devices))
    return "mixed"
