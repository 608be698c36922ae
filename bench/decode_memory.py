"""Peak memory of the decoding children (``worker.decoding.decode``) on small files that decode
huge: a 169 MP 16-bit PNG of ~330 KB and a 24-frame TIFF of 25 MP frames (~0.9 MB), with the decode
limits off (``limits.decode_memory_bytes`` 0, ``decode_cpu_s`` 0, no total-pixels cap), at their
defaults, and each limit tight alone (256 MiB; 1 s of CPU), side by side in one run. Run
against an older checkout (``PYTHONPATH=old-tree python bench/decode_memory.py``) it measures that
code: settings it does not know are ignored.

    .venv/bin/python -m bench.decode_memory            # a markdown table on stdout
    .venv/bin/python -m bench.decode_memory --json F   # and the rows as JSON

Peak RSS is the child's own high-water mark (``VmHWM`` in ``/proc/{pid}/status``), read every
5 ms while the image decodes, one fresh child per file; "replaced" says the child left after the
image (a limit hit) and a fresh one took its place.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ocrq.settings import LimitSettings
from worker.decoding.decode import IsolatedDecoder


def bombs(folder: Path) -> dict[str, Path]:
    """The two files: small on disk, huge decoded (uniform content compresses to almost nothing)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    png, tif = folder / "bomb-169mp-16bit.png", folder / "frames-24x25mp.tif"
    if not png.exists():
        a = np.zeros((13000, 13000), dtype=np.uint16)
        a[::100, :] = 40000
        Image.frombytes("I;16", (13000, 13000), a.tobytes()).save(png, compress_level=9)
    if not tif.exists():
        frames = []
        for i in range(24):
            f = np.full((5000, 5000), i * 10, dtype=np.uint8)
            f[::50, :] = 255
            frames.append(Image.frombytes("L", (5000, 5000), f.tobytes()))
        frames[0].save(tif, save_all=True, append_images=frames[1:], compression="tiff_adobe_deflate")
    return {"169 MP 16-bit PNG": png, "24-frame TIFF (25 MP frames)": tif}


@dataclass
class Row:
    limits: str
    file: str
    file_bytes: int
    outcome: str
    seconds: float
    peak_rss_mb: float
    replaced: bool


def _hwm_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(label: str, limits: LimitSettings, name: str, path: Path) -> Row:
    decoder = IsolatedDecoder(limits.model_copy(update={"decode_processes": 1}))
    try:
        pids = [c.proc.pid for c in decoder._children]
        data = path.read_bytes()
        result: dict[str, object] = {}

        def run() -> None:
            t0 = time.monotonic()
            outcome = decoder.decode_many([data])[0]
            result["seconds"] = time.monotonic() - t0
            result["outcome"] = (f"{len(outcome)} page(s)" if isinstance(outcome, list)
                                 else f"{type(outcome).__name__}: {str(outcome)[:90]}")

        thread = threading.Thread(target=run)
        thread.start()
        peak = 0
        while thread.is_alive():
            peak = max([peak, *(_hwm_kb(pid) for pid in pids)])
            thread.join(0.005)
        replaced = decoder.crashes + decoder.retired > 0
        return Row(label, name, len(data), str(result["outcome"]), round(float(result["seconds"]), 2),  # type: ignore[arg-type]
                   round(peak / 1024, 1), replaced)
    finally:
        decoder.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_memory")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--files", type=Path, default=Path(tempfile.gettempdir()) / "ocrq-decode-bombs")
    args = parser.parse_args(argv)
    files = bombs(args.files)
    configs = [
        ("limits off", LimitSettings(decode_memory_bytes=0, decode_cpu_s=0, max_document_pixels=10**12)),
        ("defaults", LimitSettings()),
        # tight, to show each limit at work alone (no total-pixels cap)
        ("decode_memory_bytes 256 MiB", LimitSettings(decode_memory_bytes=256 << 20, decode_cpu_s=0,
                                                      max_document_pixels=10**12)),
        ("decode_cpu_s 1", LimitSettings(decode_memory_bytes=0, decode_cpu_s=1, max_document_pixels=10**12)),
    ]
    rows = [measure(label, limits, name, path) for label, limits in configs for name, path in files.items()]
    d = LimitSettings().model_dump()
    print("defaults: " + ", ".join(f"{k} {d.get(k, 'absent')}" for k in
                                   ("decode_memory_bytes", "decode_cpu_s", "max_document_pixels", "bomb_pixels")))
    print()
    print("| limits | file | bytes | outcome | s | peak RSS of the child (MB) | child replaced |")
    print("|---|---|---:|---|---:|---:|---|")
    for r in rows:
        print(f"| {r.limits} | {r.file} | {r.file_bytes:,} | {r.outcome} | {r.seconds} | {r.peak_rss_mb} |"
              f" {'yes' if r.replaced else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
