"""How fast a machine hands a process fresh memory, first touch against re-touch (the GPU
benchmark hosts are microVMs whose RAM starts small and grows as it is used).

A worker's first set of pages allocates host memory the VM has not backed yet (decoded images,
rendered pixel patches, vLLM's buffers); a later set reuses it. When first touches are much slower,
the first set measures the VM, not the code: ``--keep`` leaves the memory touched once, so the rows
after it start from a machine whose RAM is already there (the same for every row).

    python3 bench/vm_memory.py --gib 48 --threads 8     # prints one JSON line per pass
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

GIB = 2**30


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            if name in ("MemTotal", "MemFree", "MemAvailable", "Cached"):
                out[name] = int(value.split()[0]) // (1024 * 1024)  # GiB
    return out


def touch(gib: int, threads: int) -> tuple[float, list[np.ndarray]]:
    """Seconds to allocate and write ``gib`` GiB in 1 GiB arrays on ``threads`` threads."""
    arrays: list[np.ndarray] = []
    lock = threading.Lock()
    todo = list(range(gib))

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            a = np.empty(GIB, dtype=np.uint8)
            a.fill(1)  # every page written: the kernel (and the VM) must back it
            with lock:
                arrays.append(a)

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0, arrays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=int, default=48)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    for n in range(args.passes):
        before = _meminfo()
        seconds, arrays = touch(args.gib, args.threads)
        after = _meminfo()
        del arrays  # freed: numpy's 1 GiB buffers go back to the kernel (munmap)
        print(json.dumps({"pass": n + 1, "gib": args.gib, "threads": args.threads, "s": round(seconds, 2),
                          "gib_per_s": round(args.gib / seconds, 2), "meminfo_before_gib": before,
                          "meminfo_after_gib": after}), flush=True)


if __name__ == "__main__":
    main()
