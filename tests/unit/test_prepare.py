"""worker.prepare: hash first, decode on a cache miss only; PDFs rendered up front, cached per page.

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
from worker.decoding.images import decode, sha256_hex
from worker.decoding.page import Page
from worker.prepare import assemble, decode_miss, decode_misses, prepare


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


def test_a_plain_image_is_hashed_not_decoded_until_its_cache_misses(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (40, 20), "white").save(path)
    ctx, chunk = _ctx(tmp_path), Chunk(job="j", task="text", items=[])
    prep = prepare(ctx, chunk, Item(id="i", ref=str(path)))
    sha = sha256_hex(path.read_bytes())
    assert prep.sha256 == sha and ctx.decoder.calls == 0 and prep.units[0].pages == []
    assert prep.cache_key == keys.cache_key(sha, "rev1", "text", {})
    decode_miss(ctx, prep)
    assert ctx.decoder.calls == 1 and len(prep.units[0].pages) == 1 and prep.data == b""


def test_misses_decode_in_one_batch_per_decoder_slot_with_errors_per_image(tmp_path: Path) -> None:
    ctx, chunk = _ctx(tmp_path), Chunk(job="j", task="text", items=[])
    preps = []
    for i in range(5):
        path = tmp_path / f"{i}.png"
        if i == 3:
            path.write_bytes(b"not an image")
        else:
            Image.new("RGB", (10 + i, 20), "white").save(path)
        preps.append(prepare(ctx, chunk, Item(id=str(i), ref=str(path))))
    errors = decode_misses(ctx, preps)
    assert sorted(ctx.decoder.batches) == [2, 3]  # parallelism 2: two round trips, not five
    assert [type(e).__name__ if e else None for e in errors] == [None, None, None, "BadImage", None]
    assert [p.units[0].pages[0].width if p.units[0].pages else None for p in preps] == [10, 11, 12, None, 14]
    assert all(p.data == b"" for i, p in enumerate(preps) if i != 3)


def test_a_pdf_is_rendered_at_once_and_each_page_is_a_unit(tmp_path: Path) -> None:
    path = tmp_path / "d.pdf"
    path.write_bytes(make_pdf(2))
    ctx = _ctx(tmp_path)
    prep = prepare(ctx, Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    assert ctx.decoder.calls == 1 and prep.document and prep.cache_key is None
    assert [len(u.pages) for u in prep.units] == [1, 1]
    assert [u.cache_key for u in prep.units] == [keys.cache_key(u.pages[0].digest or "", "rev1", "text", {})
                                                 for u in prep.units]


def test_assemble_plain_hit_uses_the_entry_as_stored_within_max_pages(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (40, 20), "white").save(path)
    prep = prepare(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    entry = [_out("p0", 0), _out("p1", 1), _out("p2", 2)]
    outs, cached = assemble(prep, {prep.units[0].cache_key: entry}, {}, set(), max_pages=2)
    assert [o.text for o in outs] == ["p0", "p1"] and cached


def test_assemble_pdf_pages_take_this_documents_page_numbers(tmp_path: Path) -> None:
    path = tmp_path / "d.pdf"
    path.write_bytes(make_pdf(2))
    prep = prepare(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    first, second = prep.units
    # page 0 is cached (computed as page 5 of another document); page 1 runs the engine now
    outs, cached = assemble(prep, {first.cache_key: [_out("cover", 5)]}, {1: [_out("body", 1)]}, set(),
                            max_pages=64)
    assert [(o.text, o.page) for o in outs] == [("cover", 0), ("body", 1)] and not cached
    assert [o.meta["cache_key"] for o in outs] == [first.cache_key, second.cache_key]
    _, all_shared = assemble(prep, {first.cache_key: [_out("cover")]}, {1: [_out("body", 1)]}, {1}, 64)
    assert all_shared  # the computed page was another chunk's in-flight run: nothing ran for this one


def test_a_pdf_needs_no_file_ref_type(tmp_path: Path) -> None:
    # sniffed from the bytes, not the name: a PDF named .png is still rendered per page
    path = tmp_path / "scan.png"
    path.write_bytes(make_pdf(1))
    prep = prepare(_ctx(tmp_path), Chunk(job="j", task="text", items=[]), Item(id="i", ref=str(path)))
    assert prep.document and len(prep.units) == 1
