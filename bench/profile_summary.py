"""Summarise a py-spy raw profile (``--format raw``, as ``bench.overhead --profile`` writes):
share of samples per function, self and inclusive (docs/bench/overhead.md quotes these).

    .venv/bin/python -m bench.profile_summary PROFILE.txt [--top 25]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"(.*) \((.*?)(?::\d+)?\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m.group(1)} ({m.group(2).rsplit('/', 1)[-1]})" if m else frame


def summarize(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, _, n = line.rpartition(" ")
        count = int(n)
        total += count
        names = [_name(f) for f in stack.split(";")]
        own[names[-1]] += count
        for name in set(names):
            incl[name] += count
    return total, own, incl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    total, own, incl = summarize(args.profile)
    print(f"{args.profile}: {total} samples")
    for title, counter in (("self", own), ("inclusive", incl)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
