"""Scenario 5: files that crash or hang the decoder for real (a SIGABRT in the decoding process,
or a decode that never returns), mixed into an ordinary load.

The files are real PNGs of the same kind as the rest, each carrying a test marker in a text
chunk (worker.decoding.decode.FAULT_ABORT / FAULT_HANG) that the workers honour only because this
scenario sets ``limits.decode_fault_markers``. Promised and checked: each such image ends
``failed`` with ``RetriesExhausted`` naming ``DecoderCrashed`` after ``queue.max_attempts``
attempts; every other image, its chunk-mates included, is ``done``; no worker process died or
was restarted (the decoder's child process did, and was replaced).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image, PngImagePlugin

from bench.chaos.stack import Special, Workers
from ocrq import keys
from worker.decoding.decode import FAULT_ABORT, FAULT_HANG

#: poison files per 100 images, half aborting, half hanging
PER_100 = 1
MAX_ATTEMPTS = 4
DECODE_TIMEOUT_S = 3
#: the suite's chunk size (bench.chaos.worker_env): which images shared a message
CHUNK_SIZE = 16


def make_poison(images: Path, out: Path, n: int) -> list[Path]:
    """n copies of real images with a marker each: even ones abort, odd ones hang."""
    out.mkdir(parents=True, exist_ok=True)
    made = []
    for i, src in enumerate(sorted(images.iterdir())[:n]):
        info = PngImagePlugin.PngInfo()
        info.add_text("comment", (FAULT_ABORT if i % 2 == 0 else FAULT_HANG).decode())
        path = out / f"poison_{i:03d}_{'abort' if i % 2 == 0 else 'hang'}.png"
        with Image.open(src) as img:
            img.save(path, "PNG", pnginfo=info)
        made.append(path)
    return made


def poison_special() -> Special:
    poison: list[str] = []
    order: list[str] = []

    def refs(env: Any, n: int) -> list[str]:
        bad = max(2, n * PER_100 // 100)
        poison[:] = [str(p) for p in make_poison(env.images, env.root / "poison", bad)]
        out = [str(p) for p in sorted(env.images.iterdir())[:n - bad]]
        for i, ref in enumerate(poison):  # spread out, so each shares its chunk with ordinary images
            out.insert(i * (n // bad) + 5, ref)
        order[:] = out
        return out

    def check(env: Any, workers: Workers, records: dict[str, Any], notes: list[str]) -> list[str]:
        problems = []
        job = "chaos-decoder"
        bad_ids = {keys.image_id(job, ref) for ref in poison}
        for image_id in bad_ids:
            rec = records.get(image_id)
            err = rec.error if rec else None
            if rec is None or rec.status.value != "failed" or err is None or err.type != "RetriesExhausted" \
                    or "DecoderCrashed" not in err.message or rec.attempts != MAX_ATTEMPTS:
                problems.append(f"poison {image_id}: {rec.status.value if rec else 'no record'} {err}")
        others = [r for i, r in records.items() if i not in bad_ids]
        not_done = [r for r in others if r.status.value != "done"]
        if not_done:
            problems.append(f"{len(not_done)} ordinary images not done, e.g. {not_done[0].ref}: {not_done[0].error}")
        size = CHUNK_SIZE
        mates = {keys.image_id(job, ref) for start in range(0, len(order), size)
                 for ref in order[start:start + size] if set(order[start:start + size]) & set(poison)} - bad_ids
        mates_done = sum(1 for i in mates if records.get(i) and records[i].status.value == "done")
        if mates_done != len(mates):
            problems.append(f"only {mates_done} of {len(mates)} chunk-mates of poison files done")
        dead = [n for n, p in workers.procs.items() if p.poll() is not None]
        if dead or workers.starts != len(workers.names):
            problems.append(f"worker processes died: {dead}, {workers.starts} starts for {len(workers.names)}")
        hung = sum("hung" in (records[i].error.message if records.get(i) and records[i].error else "")
                   for i in bad_ids)
        notes.append(f"{len(bad_ids)} poison files ({len(bad_ids) - hung} abort, {hung} hang): RetriesExhausted"
                     f" after {MAX_ATTEMPTS} attempts naming DecoderCrashed;"
                     f" {mates_done}/{len(mates)} chunk-mates done;"
                     f" {workers.starts - len(workers.names)} worker restarts")
        return problems

    return Special(env={"OCRQ_LIMITS__DECODE_FAULT_MARKERS": "true",
                        "OCRQ_LIMITS__DECODE_TIMEOUT_S": str(DECODE_TIMEOUT_S),
                        "OCRQ_QUEUE__MAX_ATTEMPTS": str(MAX_ATTEMPTS)},
                   refs=refs, check=check)
