"""worker.engines.vllm.render_ahead: renders ahead of their batch, bounded, urgent first (real threads;
the render function is a stand-in that records its calls)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from worker.engines.vllm.render_ahead import RenderAhead


class Item:
    def __init__(self, name: str, priority: int = 0) -> None:
        self.name, self.priority = name, priority


class Recorder:
    """Render stand-in: returns the item's name upper-cased, in the order it was called; blocks
    while ``gate`` is clear; fails items named ``bad*``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def __call__(self, item: Item) -> str:
        with self.lock:
            self.calls.append(item.name)
        self.gate.wait(5)
        if item.name.startswith("bad"):
            raise ValueError(f"cannot render {item.name}")
        return item.name.upper()


@pytest.fixture()
def made() -> Iterator[list[RenderAhead]]:
    queues: list[RenderAhead] = []
    yield queues
    for q in queues:
        q.close()


def queue(made: list[RenderAhead], render: Recorder, threads: int, ahead: int) -> RenderAhead:
    q = RenderAhead(render, threads=threads, ahead=ahead)
    made.append(q)
    return q


def wait_for(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.005)


def test_renders_ahead_most_urgent_first_and_at_most_ahead(made: list[RenderAhead]) -> None:
    render = Recorder()
    q = queue(made, render, threads=1, ahead=3)
    items = [Item(f"bulk-{i}", 9) for i in range(6)] + [Item("urgent", 0)]
    render.gate.clear()
    q.prepare(items[:6], [9] * 6)  # the thread starts bulk-0 and blocks on it
    wait_for(lambda: render.calls)
    q.prepare(items[6:], [0])
    render.gate.set()
    wait_for(lambda: len(render.calls) >= 3)
    time.sleep(0.1)
    assert render.calls == ["bulk-0", "urgent", "bulk-1"]  # then the bound: 3 held, none taken
    assert [f.result() for f in q.take(items[:2])] == ["BULK-0", "BULK-1"]
    wait_for(lambda: len(render.calls) >= 5)
    time.sleep(0.1)
    assert render.calls == ["bulk-0", "urgent", "bulk-1", "bulk-2", "bulk-3"]  # two places freed


def test_a_batch_renders_its_own_items_at_once_even_when_the_bound_is_reached(made: list[RenderAhead]) -> None:
    render = Recorder()
    q = queue(made, render, threads=2, ahead=1)
    ahead = [Item(f"a-{i}") for i in range(4)]
    q.prepare(ahead, [0] * 4)
    wait_for(lambda: render.calls)
    batch = [Item(f"b-{i}") for i in range(5)]  # never prepared
    assert [f.result() for f in q.take(batch)] == [f"B-{i}" for i in range(5)]
    assert render.calls[0] == "a-0" and "a-1" not in render.calls  # the bound held the rest back


def test_zero_ahead_renders_only_what_a_batch_takes(made: list[RenderAhead]) -> None:
    render = Recorder()
    q = queue(made, render, threads=2, ahead=0)
    items = [Item(f"x-{i}") for i in range(3)]
    q.prepare(items, [0, 0, 0])
    time.sleep(0.1)
    assert render.calls == []
    assert [f.result() for f in q.take(items)] == ["X-0", "X-1", "X-2"]


def test_a_render_error_stays_with_its_item(made: list[RenderAhead]) -> None:
    render = Recorder()
    q = queue(made, render, threads=2, ahead=4)
    items = [Item("ok-1"), Item("bad-2"), Item("ok-3")]
    q.prepare(items, [0, 0, 0])
    futures = q.take(items)
    assert futures[0].result() == "OK-1" and futures[2].result() == "OK-3"
    with pytest.raises(ValueError, match="bad-2"):
        futures[1].result()
    assert q.pending() == 0


def test_dropped_items_free_their_places(made: list[RenderAhead]) -> None:
    render = Recorder()
    q = queue(made, render, threads=1, ahead=2)
    first = [Item(f"d-{i}") for i in range(2)]
    later = [Item(f"l-{i}") for i in range(2)]
    q.prepare(first + later, [0] * 4)
    wait_for(lambda: len(render.calls) >= 2)
    time.sleep(0.1)
    assert render.calls == ["d-0", "d-1"]
    q.drop(first)
    wait_for(lambda: len(render.calls) >= 4)
    assert render.calls == ["d-0", "d-1", "l-0", "l-1"] and q.pending() == 2


def test_each_item_renders_once_whoever_takes_it(made: list[RenderAhead]) -> None:
    """Batches taking while the threads render ahead: every item is rendered exactly once and
    every batch gets its own items' results (never another item's)."""
    render = Recorder()
    q = queue(made, render, threads=3, ahead=8)
    items = [Item(f"i-{i}") for i in range(200)]
    q.prepare(items, [i % 3 for i in range(200)])
    batches = [items[i:i + 10] for i in range(0, 200, 10)]
    results: dict[int, list[str]] = {}

    def run(n: int) -> None:
        results[n] = [f.result() for f in q.take(batches[n])]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert all(results[n] == [it.name.upper() for it in batches[n]] for n in range(len(batches)))
    assert sorted(render.calls) == sorted(it.name for it in items)
    assert q.pending() == 0
