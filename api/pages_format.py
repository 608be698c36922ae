"""How the jobs page writes numbers: durations, ages, bytes, dollars, rates, and one job's row
(the list's cells and its progress bar's segments). The HTML templates and the live JSON the
page polls both go through these, so a cell reads the same whether it was rendered or updated."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

#: the progress bar's segments, left to right: (count field, CSS class, what it is called)
SEGMENTS = (("fresh", "seg-done", "done"), ("cached", "seg-cached", "cached"), ("failed", "seg-failed", "failed"),
            ("cancelled", "seg-cancelled", "cancelled"))
#: states shown as still moving (the page keeps polling them)
MOVING = ("queued", "running", "finalizing", "cancelling")


def duration(seconds: float | None) -> str:
    """``42 s``, ``3 min 20 s``, ``2 h 05 min``, ``3 d 4 h``; ``–`` when unknown."""
    if seconds is None:
        return "–"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{d} d {h} h"


def age(epoch: float | None, now: float | None = None) -> str:
    """How long ago ``epoch`` was: ``12 s ago``; ``–`` when unknown."""
    if not epoch:
        return "–"
    return duration((time.time() if now is None else now) - epoch) + " ago"


def iso(epoch: float | None) -> str:
    """UTC ISO-8601 (a ``<time datetime>`` and a tooltip), ``""`` when unknown."""
    if not epoch:
        return ""
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clock(epoch: float | None) -> str:
    """``2026-12-06 21:07:17 UTC``."""
    if not epoch:
        return "–"
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def size(n: float | None) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 GiB``; ``–`` when unknown."""
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # (not reached)


def usd(amount: float | None) -> str:
    """Dollars with the digits that matter for a small job: ``$0.0042``, ``$12.30``."""
    if amount is None:
        return "–"
    if amount == 0:
        return "$0"
    if amount < 0.01:
        return f"${amount:.4f}"
    if amount < 100:
        return f"${amount:.2f}"
    return f"${amount:,.0f}"


def rate(per_s: float | None) -> str:
    if per_s is None:
        return "–"
    return f"{per_s:.1f}" if per_s < 100 else f"{per_s:,.0f}"


def count(n: int | float | None) -> str:
    return "–" if n is None else f"{int(n):,}"


def progress(counts: dict[str, int]) -> dict[str, Any]:
    """The progress bar of a job: each segment's share of the total (percent, for the SVG's
    rects, laid end to end), what is final, and the sentence screen readers hear."""
    total = max(int(counts.get("total", 0)), 0)
    parts = {"fresh": counts.get("done", 0) - counts.get("cached", 0), "cached": counts.get("cached", 0),
             "failed": counts.get("failed", 0), "cancelled": counts.get("cancelled", 0)}
    final = sum(parts.values())
    segments, x = [], 0.0
    for field, css, _ in SEGMENTS:
        width = 100.0 * parts[field] / total if total else 0.0
        segments.append({"name": field, "class": css, "x": round(x, 3), "width": round(width, 3)})
        x += width
    left = max(total - final, 0)
    text = (f"{final:,} of {total:,} images final: {counts.get('done', 0):,} done ({parts['cached']:,} from the "
            f"cache), {parts['failed']:,} failed, {parts['cancelled']:,} cancelled, {left:,} not yet")
    return {"total": total, "final": final, "left": left, "segments": segments, "text": text,
            "label": f"{final:,} / {total:,}"}


def row(view: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """One job as the jobs list shows it (``api.views.job_view`` → display strings)."""
    counts = view["counts"]
    moving = view["state"] in MOVING
    return {
        "id": view["id"], "state": view["state"], "moving": moving,
        "progress": progress(counts),
        "rate": rate(view["images_per_second"]),
        "eta": duration(view["eta_seconds"]) if moving else "–",
        "cost": usd(view["cost"]["usd"]),
        "age": age(view["created_at"], now), "created": iso(view["created_at"]),
        "task": view["task"],
    }


def jobs_summary(page: dict[str, Any], state: str | None) -> str:
    """The line above the jobs table: which of the tenant's jobs it shows."""
    rows, total = page["rows"], page["total"]
    which = f" in state {state}" if state else ""
    if rows:
        return (f"Jobs {page['first']:,}–{page['first'] + len(rows) - 1:,}{which} of {total:,}, newest first"
                if not state else f"{len(rows):,} job(s){which}, newest first, of the tenant's {total:,}")
    if total:
        looked = f" among the {page['looked']:,} looked at" if state and page["next"] else ""
        return f"No job{which} here{looked}."
    return "No jobs yet."
