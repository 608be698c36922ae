"""Reading order of detected text lines: rows top-down, lines left-right, columns one by one.

A recursive XY-cut: a region splits at a column gutter when one qualifies, else at its widest
horizontal gap, and a leaf is grouped into text rows. Without a gutter this equals plain row
grouping (top-down, left-right); with one, a two-column page reads column by column instead of
interleaving the columns line by line (measured on the UNLV pages of the corpus). Rows are
grouped in a frame turned by the page's skew, which helps photographed receipts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ocrq.results import OcrLine

#: two boxes share a text row when their vertical overlap is at least this share of the
#: shorter box's height (tolerates the slight skew of photographed receipts)
_ROW_OVERLAP = 0.5
#: text-column test of the reading order (see ``_column_split``): lines per side, a side's
#: share of the region width, median line width over the side's width, median characters/line
_MIN_COLUMN_LINES = 3
_MIN_COLUMN_SHARE = 0.25
_COLUMN_FILL = 0.5
_MIN_COLUMN_CHARS = 10
#: share of a region's lines that may cross a column gutter (headings, pull quotes)
_MAX_CROSSING = 0.15
#: recursion bound of the XY-cut (a leaf beyond it is grouped into rows as a whole)
_MAX_DEPTH = 64


@dataclass(frozen=True)
class _Item:
    x0: float
    y0: float
    x1: float
    y1: float
    line: OcrLine


def _skew(lines: Sequence[OcrLine]) -> float:
    """Median slope (radians) of the boxes' top edges: a photographed page is often tilted a
    few degrees, enough for neighbouring rows to overlap vertically."""
    slopes = sorted(
        math.atan2(b[1][1] - b[0][1], b[1][0] - b[0][0])
        for b in (ln.box for ln in lines) if b and len(b) >= 2 and b[1][0] > b[0][0]
    )
    return slopes[len(slopes) // 2] if slopes else 0.0


def reading_order(lines: Sequence[OcrLine]) -> list[list[OcrLine]]:
    """Lines -> text rows in reading order (rows top-down, lines left-right within a row),
    computed in a frame turned by the page's skew."""
    angle = _skew(lines)
    cos, sin = math.cos(-angle), math.sin(-angle)
    items = []
    for line in lines:
        pts = line.box or [[0.0, 0.0]]
        xs = [x * cos - y * sin for x, y in pts]
        ys = [x * sin + y * cos for x, y in pts]
        items.append(_Item(min(xs), min(ys), max(xs), max(ys), line))
    return _xycut(items, depth=0)


def _xycut(items: list[_Item], depth: int) -> list[list[OcrLine]]:
    if len(items) < 2 * _MIN_COLUMN_LINES or depth > _MAX_DEPTH:
        return _rows(items)
    split = _column_split(items)
    if split is not None:
        left, right, crossing = split
        # a heading across the columns reads first; captions and pull quotes after them
        top = min(it.y0 for it in left + right)
        head = [it for it in crossing if it.y1 <= top]
        tail = [it for it in crossing if it.y1 > top]
        return _rows(head) + _xycut(left, depth + 1) + _xycut(right, depth + 1) + _rows(tail)
    gap = _widest_gap([(it.y0, it.y1) for it in items])
    if gap is None:
        return _rows(items)
    above = [it for it in items if it.y1 <= gap]
    below = [it for it in items if it.y1 > gap]
    return _xycut(above, depth + 1) + _xycut(below, depth + 1)


def _widest_gap(spans: list[tuple[float, float]]) -> float | None:
    """Start of the widest empty interval between the union of ``spans`` (None: no gap)."""
    spans = sorted(spans)
    reach, best, best_width = spans[0][1], None, 0.0
    for start, end in spans[1:]:
        if start - reach > best_width:
            best, best_width = reach, start - reach
        reach = max(reach, end)
    return best


def _column_split(items: list[_Item]) -> tuple[list[_Item], list[_Item], list[_Item]] | None:
    """(left, right, crossing) when a vertical gutter splits ``items`` into two text columns.

    The gutter may be crossed by a few lines (a heading, a pull quote): at most
    ``_MAX_CROSSING`` of them. A receipt's name | price layout also has a full-height gap; what
    tells columns of running text apart is that both sides hold several long lines that fill
    most of their side's width, and neither side is a narrow strip (``_is_text_column``)."""
    left_edge = min(it.x0 for it in items)
    width = max(it.x1 for it in items) - left_edge
    heights = sorted(it.y1 - it.y0 for it in items)
    min_gap = 0.5 * heights[len(heights) // 2]
    allowed = int(_MAX_CROSSING * len(items))
    # x-coverage histogram (bins of >= 1 px): how many lines cover each x
    scale = max(1.0, width / 4000)
    bins = int(width / scale) + 2
    diff = np.zeros(bins + 1, dtype=np.int64)
    for it in items:
        diff[int((it.x0 - left_edge) / scale)] += 1
        diff[int((it.x1 - left_edge) / scale) + 1] -= 1
    cover = np.cumsum(diff)[:bins]
    runs: list[tuple[float, float]] = []
    for lo, hi in _true_runs(cover <= allowed):
        # the gutter proper is where the fewest lines cross, inside the low stretch
        floor = cover[lo:hi].min()
        for a, b in _true_runs(cover[lo:hi] == floor):
            a, b = lo + a, lo + b
            if a > 0 and b < bins and (b - a) * scale >= min_gap:  # margins are not gutters
                runs.append((left_edge + a * scale, left_edge + b * scale))
    for x0, x1 in sorted(runs, key=lambda r: r[0] - r[1]):  # widest first
        left = [it for it in items if it.x1 <= x0]
        right = [it for it in items if it.x0 >= x1]
        crossing = [it for it in items if it.x1 > x0 and it.x0 < x1]
        if len(crossing) <= allowed and all(_is_text_column(side, width) for side in (left, right)):
            return left, right, crossing
    return None


def _true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index pairs of the True stretches of a boolean array."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _is_text_column(side: list[_Item], region_width: float) -> bool:
    if len(side) < _MIN_COLUMN_LINES:
        return False
    extent = max(it.x1 for it in side) - min(it.x0 for it in side)
    widths = sorted(it.x1 - it.x0 for it in side)
    chars = sorted(len(it.line.text) for it in side)
    return (
        extent >= _MIN_COLUMN_SHARE * region_width
        and widths[len(widths) // 2] >= _COLUMN_FILL * extent
        and chars[len(chars) // 2] >= _MIN_COLUMN_CHARS
    )


def _rows(items: list[_Item]) -> list[list[OcrLine]]:
    """Group items into text rows: an item joins the row whose vertical band it overlaps most
    (by at least ``_ROW_OVERLAP`` of the shorter height); rows top-down, items left-right."""
    rows: list[tuple[float, float, list[_Item]]] = []
    for it in sorted(items, key=lambda i: ((i.y0 + i.y1) / 2, i.x0)):
        best, best_overlap = -1, 0.0
        for n, (top, bottom, _members) in enumerate(rows):
            shorter = max(min(it.y1 - it.y0, bottom - top), 1e-6)
            overlap = (min(it.y1, bottom) - max(it.y0, top)) / shorter
            if overlap >= _ROW_OVERLAP and overlap > best_overlap:
                best, best_overlap = n, overlap
        if best < 0:
            rows.append((it.y0, it.y1, [it]))
            continue
        members = rows[best][2] + [it]
        # the band is the members' median band, so one tall box cannot swallow the page
        tops, bottoms = sorted(m.y0 for m in members), sorted(m.y1 for m in members)
        rows[best] = (tops[len(tops) // 2], bottoms[len(bottoms) // 2], members)
    rows.sort(key=lambda r: (r[0] + r[1]) / 2)
    return [[m.line for m in sorted(members, key=lambda m: m.x0)] for _t, _b, members in rows]
