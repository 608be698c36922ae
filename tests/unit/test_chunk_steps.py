"""worker.chunk's fetch, decode and store steps: hash first, decode on a cache miss only; PDFs
rendered up front, cached per page; each step returns the attempt one step on, the one before it
left as it was.

The context is a fake (``FakeContext``: settings, an engine revision and a counting decoder);
images and PDFs are real bytes."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from ocrq import keys
from ocrq.messages import Chunk, Item
from ocrq.results import OcrOutput
from ocrq.settings import Settings
from tests.unit.test_documents import make_pdf
from worker.chunk.attempt import Attempt
from worker.chunk.decode import decode as decode_step
from worker.chunk.decode import decode_many
from worker.chunk.fetch import fetch_one
from worker.chunk.store import assemble
from worker.decoding.images import decode, sha256_hex
from worker.decoding.page import Page


@dataclass
class CountingDecoder:
    settings: Settings
    calls: int = 0
    parallelism: int = 2
    batches: list[int] = field(default_factory=list)

    def decode(self, data: bytes) -> list[Page]:
        self.calls += 1
        return decode(data, self.settings.limits)

    def decode_many(self, datas: Sequence[bytes]) -> list[list[Page] | Exception]:
        self.batches.append(len(datas))
        out: list[list[Page] | Exception] = []
        for data in datas:
            try:
                out.append(self.decode(data))
            except Exception as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        pass


@dataclass
class FakeContext:
    settings: Settings
    decoder: CountingDecoder
    s3_client: Any = None
    store: Any = None
    engine: Any = field(default_factory=lambda: type("E", (), {"revision": "rev1"})())
    fetch_pool: Any = field(default_factory=lambda: ThreadPoolExecutor(2))


def _ctx(root: Path) -> Any:
    settings = Settings(limits={"allowed_roots": [root]})
    return FakeContext(settings, CountingDecoder(settings))


def _out(text: str, page: int = 0) -> OcrOutput:
    return OcrOutput(text=text, engine="fake", model="m", page=page)


def _attempt(ctx: Any, chunk: Chunk, *images: Any) -> Attempt:
    """An attempt past its fetch step (the images given), nothing in the cache."""
    from dataclasses import replace
    from types import MappingProxyType

    return replace(Attempt.begin(chunk), images=MappingProxyType({im.item.id: im for im in images}))


def test_a_plain_image_is_hashed_not_decoded_until_its_cache_misses(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (40, 20), "white").save(path)
    ctx, chunk = _ctx(tmp_path), Chunk(job="j", task="text", items=[Item(id="i", ref=str(path))])
    fetched = fetch_one(ctx, chunk, chunk.items[0])
    sha = sha256_hex(path.read_bytes())
    assert fetched.sha256 == sha and ctx.decoder.calls == 0 and fetched.units[0].pages == ()
    assert fetched.cache_key == keys.cache_key(sha, "rev1", "text", {})
    before = _attempt(ctx, chunk, fetched)
    after = decode_step(ctx, before)
    assert ctx.decoder.calls == 1 and after.decoded == 1
    assert len(after.images["i"].units[0].pages) == 1 and after.images["i"].data == b""
    # the attempt one step back is as it was: the step made a new one
    assert before.images["i"] is fetched and fetched.data == path.read_bytes() and fetched.units[0].pages == ()


def test_a_hit_is_never_decoded_and_its_bytes_are_let_go(tmp_path: Path) -> None:
    from dataclasses import replace
    from types import MappingProxyType

    path = tmp_path / "a.png"
    Image.new("RGB", (40, 20), "white").save(path)
    ctx, chunk = _ctx(tmp_path), Chunk(job="j", task="text", items=[Item(id="i", ref=str(path))])
    fetched = fetch_one(ctx, chunk, chunk.items[0])
    hit = replace(_attempt(ctx, chunk, fetched), hits=MappingProxyType({fetched.units[0].cache_key: [_out("t")]}))
    after = decode_step(ctx, hit)
    assert ctx.decoder.calls == 0 and after.decoded == 0 and after.images["i"].data == b""


def test_misses_decode_in_one_batch_per_decoder_slot_with_errors_per_image(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    datas = []
    for i in range(5):
        path = tmp_path / f"{i}.png"
        if i == 3:
            path.write_bytes(b"not an image")
        else:
            Image.new("RGB", (10 + i, 20), "white").save(path)
        datas.append(path.read_bytes())
    outcomes = decode_many(ctx, datas)
    assert sorted(ctx.decoder.batches) == [2, 3]  # parallelism 2: two round trips, not five
    assert [type(o).__name__ if isinstance(o, Exception) else None for o in outcomes] == [
        None, None, None, "BadImage", None]
    assert [o[0].width if not isinstance(o, Exception) else None for o in outcomes] == [10, 11, 12, None, 14]


def test_a_failed_decode_fails_its_image_alone(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (12, 20), "white").save(good)
    bad.write_bytes(b"not an image")
    ctx = _ctx(tmp_path)
    chunk = Chunk(job="j", task="text", items=[Item(id="g", ref=str(good)), Item(id="b", ref=str(bad))])
    after = decode_step(ctx, _attempt(ctx, chunk, *(fetch_one(ctx, chunk, it) for it in chunk.items)))
    assert set(after.errors) == {"b"} and type(after.errors["b"]).__name__ == "BadImage"
    assert after.images["g"].units[0].pages[0].width == 12


def test_a_pdf_is_rendered_at_once_and_each_page_is_a_unit(tmp_path: Path) -> None:
    path = tmp_path / "d.pdf"
    path.write_bytes(make_pdf(2))
    ctx = _ctx(tmp_path)
    fetched = fetch_one(ctx, Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    assert ctx.decoder.calls == 1 and fetched.document and fetched.cache_key is None
    assert [len(u.pages) for u in fetched.units] == [1, 1]
    assert [u.cache_key for u in fetched.units] == [keys.cache_key(u.pages[0].digest or "", "rev1", "text", {})
                                                   for u in fetched.units]


def test_assemble_plain_hit_uses_the_entry_as_stored_within_max_pages(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (40, 20), "white").save(path)
    fetched = fetch_one(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    entry = [_out("p0", 0), _out("p1", 1), _out("p2", 2)]
    outs, cached = assemble(fetched, {fetched.units[0].cache_key: entry}, {}, set(), max_pages=2)
    assert [o.text for o in outs] == ["p0", "p1"] and cached


def test_assemble_pdf_pages_take_this_documents_page_numbers(tmp_path: Path) -> None:
    path = tmp_path / "d.pdf"
    path.write_bytes(make_pdf(2))
    fetched = fetch_one(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    first, second = fetched.units
    # page 0 is cached (computed as page 5 of another document); page 1 runs the engine now
    outs, cached = assemble(fetched, {first.cache_key: [_out("cover", 5)]}, {1: [_out("body", 1)]}, set(),
                            max_pages=64)
    assert [(o.text, o.page) for o in outs] == [("cover", 0), ("body", 1)] and not cached
    assert [o.meta["cache_key"] for o in outs] == [first.cache_key, second.cache_key]
    _, all_shared = assemble(fetched, {first.cache_key: [_out("cover")]}, {1: [_out("body", 1)]}, {1}, 64)
    assert all_shared  # the computed page was another chunk's in-flight run: nothing ran for this one


def test_a_pdf_needs_no_file_ref_type(tmp_path: Path) -> None:
    # sniffed from the bytes, not the name: a PDF named .png is still rendered per page
    path = tmp_path / "scan.png"
    path.write_bytes(make_pdf(1))
    fetched = fetch_one(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    assert fetched.document and len(fetched.units) == 1
