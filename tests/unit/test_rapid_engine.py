"""RapidOcrEngine against the real RapidOCR (a pure CPU library, models inside its wheel) on the
rendered samples in examples/images."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from ocrq.engine_settings import RapidOcrSettings
from ocrq.errors import BadImage, EngineCrashed, OcrqError
from ocrq.results import OcrLine, OcrOutput
from worker.engines.base import Engine, OcrRequest
from worker.engines.rapid import RapidOcrEngine
from worker.engines.reading_order import reading_order

IMAGES = Path(__file__).resolve().parents[2] / "examples" / "images"
EXPECTED: dict[str, list[str]] = json.loads((IMAGES.parent / "expected.json").read_text(encoding="utf-8"))


def load(name: str) -> Image.Image:
    """What the worker's decoder hands the engine: EXIF-upright RGB."""
    with Image.open(IMAGES / name) as img:
        return ImageOps.exif_transpose(img).convert("RGB")


def truncated_png() -> Image.Image:
    """Opens (the header is fine) but fails when its pixels are read."""
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "white").save(buf, format="PNG")
    return Image.open(io.BytesIO(buf.getvalue()[:-40]))


@pytest.fixture(scope="module")
def engine() -> RapidOcrEngine:
    eng = RapidOcrEngine(RapidOcrSettings())
    eng.start()
    return eng


@pytest.fixture(scope="module")
def batch(engine: RapidOcrEngine) -> dict[str, OcrOutput | OcrqError]:
    """Every sample plus broken images, in one mixed batch."""
    requests = [OcrRequest(key=name, image=load(name)) for name in sorted(EXPECTED)]
    requests.insert(3, OcrRequest(key="tiny", image=Image.new("RGB", (1, 1), "white")))
    requests.insert(6, OcrRequest(key="empty", image=Image.new("RGB", (0, 0))))
    requests.insert(9, OcrRequest(key="truncated", image=truncated_png()))
    outcomes = engine.infer(requests)
    assert len(outcomes) == len(requests)
    return {req.key: out for req, out in zip(requests, outcomes, strict=True)}


def ok(outcome: OcrOutput | OcrqError) -> OcrOutput:
    assert isinstance(outcome, OcrOutput), repr(outcome)
    return outcome


def test_identity(engine: RapidOcrEngine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name == "rapidocr"
    rev = engine.revision
    assert rev.startswith("rapidocr-3.") and "det" in rev and "rec" in rev and "cls" in rev
    # tuning changes outputs, so it changes the cache key
    other = RapidOcrEngine(RapidOcrSettings(rapid_limit_side_len=1280))
    assert other.revision != rev


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_words(batch: dict[str, OcrOutput | OcrqError], name: str) -> None:
    text = ok(batch[name]).text
    missing = [word for word in EXPECTED[name] if word not in text]
    assert not missing, f"{name}: missing {missing} in {text!r}"


@pytest.mark.parametrize(("name", "text"), [
    ("single_line.png", "Hello from ocrq 2024"),
    ("notice_zh.png", "营业时间\n周一至周五 09:00-21:00\n周六 10:00-18:00\n周日休息\n欢迎光临"),
    ("shop_sign_en.jpg", "CORNER BAKERY\nFresh Bread Daily"),
    ("rotated_exif.jpg", "PLATFORM 3\nNext train: Riverside 08:45\nMind the gap"),
])
def test_exact_text(batch: dict[str, OcrOutput | OcrqError], name: str, text: str) -> None:
    assert ok(batch[name]).text == text


def test_receipt_rows_pair_items_with_prices(batch: dict[str, OcrOutput | OcrqError]) -> None:
    rows = ok(batch["receipt_en.png"]).text.splitlines()
    for row in ("GREENLEAF MARKET", "Sourdough Bread 4.25", "Subtotal 26.63", "TOTAL 28.76"):
        assert row in rows
    assert rows.index("GREENLEAF MARKET") < rows.index("Subtotal 26.63") < rows.index("TOTAL 28.76")
    assert "合计 39.10" in ok(batch["receipt_zh.png"]).text.splitlines()


def test_lines_have_pixel_boxes(batch: dict[str, OcrOutput | OcrqError]) -> None:
    out = ok(batch["invoice_en.png"])
    assert (out.width, out.height) == load("invoice_en.png").size
    assert out.engine == "rapidocr" and out.model
    assert len(out.lines) == len(out.text.splitlines())
    for line in out.lines:
        assert line.box is not None and len(line.box) == 4
        assert all(-2 <= x <= out.width + 2 and -2 <= y <= out.height + 2 for x, y in line.box)
        assert line.confidence is not None and 0.5 <= line.confidence <= 1.0
    tops = [min(y for _x, y in line.box or []) for line in out.lines]
    assert tops == sorted(tops)  # one box per row here: reading order is top-down


def test_exif_image_reads_after_transpose(batch: dict[str, OcrOutput | OcrqError]) -> None:
    with Image.open(IMAGES / "rotated_exif.jpg") as raw:
        assert raw.getexif().get(0x0112) == 6
        stored = raw.size
    out = ok(batch["rotated_exif.jpg"])
    assert (out.width, out.height) == (stored[1], stored[0])  # boxes refer to the upright image
    assert "Riverside 08:45" in out.text


def test_grayscale_and_duplicate(engine: RapidOcrEngine, batch: dict[str, OcrOutput | OcrqError]) -> None:
    with Image.open(IMAGES / "memo_gray.png") as img:
        assert img.mode == "L"
        gray = engine.infer([OcrRequest(key="gray", image=img.copy())])[0]  # not converted
    assert ok(gray) == ok(batch["memo_gray.png"])
    assert (IMAGES / "receipt_en.png").read_bytes() == (IMAGES / "receipt_en_copy.png").read_bytes()
    assert ok(batch["receipt_en_copy.png"]) == ok(batch["receipt_en.png"])


def test_bad_images_fail_alone(batch: dict[str, OcrOutput | OcrqError]) -> None:
    tiny = batch["tiny"]
    assert isinstance(tiny, OcrqError) or (tiny.text == "" and tiny.lines == [])
    assert isinstance(batch["empty"], BadImage)
    assert isinstance(batch["truncated"], BadImage)
    assert not batch["truncated"].retryable
    # their neighbours in the batch are untouched
    assert all(isinstance(batch[name], OcrOutput) for name in EXPECTED)


def test_batch_invariance(engine: RapidOcrEngine, batch: dict[str, OcrOutput | OcrqError]) -> None:
    names = ["single_line.png", "notice_zh.png", "street_sign_en.jpg"]
    alone = {n: engine.infer([OcrRequest(key=n, image=load(n))])[0] for n in names}
    shuffled = engine.infer([OcrRequest(key=n, image=load(n)) for n in reversed(names)])
    for name, again in zip(reversed(names), shuffled, strict=True):
        expected = ok(batch[name]).model_dump()
        assert ok(alone[name]).model_dump() == expected
        assert ok(again).model_dump() == expected


def test_cost_grows_with_pixels(engine: RapidOcrEngine) -> None:
    def cost(w: int, h: int) -> int:
        return engine.cost(OcrRequest(key="c", image=Image.new("RGB", (w, h)))).total_tokens

    assert cost(1, 1) >= 1
    assert cost(64, 64) < cost(1024, 768) < cost(2048, 1536)
    assert cost(1024, 768) == 768
    assert engine.memory().allocated is None


def test_infer_before_start_and_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = RapidOcrEngine(RapidOcrSettings())
    with pytest.raises(EngineCrashed):
        eng.infer([OcrRequest(key="x", image=load("single_line.png"))])

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("RapidOcrEngine tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    eng.start()
    model_dir = next(iter(eng._model_files().values()))[0].parent
    assert model_dir.parent.name == "rapidocr"  # the wheel's own models/ directory
    out = eng.infer([OcrRequest(key="x", image=load("single_line.png"))])[0]
    assert ok(out).text == "Hello from ocrq 2024"
    eng.close()


def box_line(text: str, x0: float, y0: float, x1: float, y1: float, tilt: float = 0.0) -> OcrLine:
    """An OcrLine with a 4-point box; ``tilt`` lifts the right end by that many pixels."""
    return OcrLine(text=text, box=[[x0, y0], [x1, y0 - tilt], [x1, y1 - tilt], [x0, y1]])


def test_reading_order_columns_and_rows() -> None:
    # a heading over two columns of running text: column by column, heading first
    page = [box_line("A Heading Across Both Columns", 100, 10, 900, 50)]
    for i in range(6):
        y = 80 + 40 * i
        page.append(box_line(f"left column line number {i}", 100, y, 480, y + 30))
        page.append(box_line(f"right column line number {i}", 520, y + 5, 900, y + 35))
    rows = [" ".join(line.text for line in row) for row in reading_order(page)]
    assert rows[0] == "A Heading Across Both Columns"
    assert rows[1:7] == [f"left column line number {i}" for i in range(6)]
    assert rows[7:] == [f"right column line number {i}" for i in range(6)]

    # a receipt's name | price layout is a table, not two columns: rows stay paired
    receipt = []
    for i in range(6):
        y = 40 * i
        receipt.append(box_line(f"Item number {i}", 20, y, 260, y + 30))
        receipt.append(box_line(f"{i}.99", 400, y, 470, y + 30))
    rows = [" ".join(line.text for line in row) for row in reading_order(receipt)]
    assert rows == [f"Item number {i} {i}.99" for i in range(6)]

    # a photo tilted ~5 degrees: the right end of a row sits as high as the next row's left end
    tilted = []
    for i in range(5):
        y = 100 + 30 * i
        tilted.append(box_line(f"name {i}", 0, y, 300, y + 24, tilt=26))
        tilted.append(box_line(f"{i}.00", 500, y - 44, 580, y - 20, tilt=7))
    rows = [" ".join(line.text for line in row) for row in reading_order(tilted)]
    assert rows == [f"name {i} {i}.00" for i in range(5)]
