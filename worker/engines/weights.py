"""Which HunyuanOCR checkpoint an engine runs, as a stable id: the engine revision every cached
result is keyed by (``ocrq.keys.cache_key``), the same for every engine that hosts the model."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_revision(model_dir: Path, version: str) -> str:
    """Stable id of a checkpoint: hash of config.json, each safetensors header (names, shapes,
    offsets) and three 64 KiB samples of its data (random checkpoints share headers)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(path.name.encode() + f.read(n))
            for at in (8 + n, (8 + n + size) // 2, max(8 + n, size - 65536)):
                f.seek(at)
                h.update(f.read(65536))
    return f"hunyuanocr-{version}-{h.hexdigest()[:16]}"
