"""worker.decoding.images.decode: every image is generated here with Pillow."""

from __future__ import annotations

import dataclasses
import io
import random
import struct
import zlib

import pytest
from PIL import Image

from ocrq.errors import BadImage, TooLarge, UnsupportedFormat
from ocrq.settings import LimitSettings
from worker.decoding.images import decode, sha256_hex
from worker.decoding.page import Page

LIMITS = LimitSettings()
RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def close(a: tuple[int, ...], b: tuple[int, ...], tol: int = 12) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def px(page: Page, x: int, y: int) -> tuple[int, ...]:
    value = page.image.getpixel((x, y))
    assert isinstance(value, tuple)
    return value


def one(data: bytes, limits: LimitSettings = LIMITS) -> Page:
    pages = decode(data, limits)
    assert len(pages) == 1
    assert pages[0].image.mode == "RGB"
    return pages[0]


def test_plain_png_round_trips() -> None:
    img = Image.new("RGB", (30, 20), BLUE)
    page = one(encode(img, "PNG"))
    assert (page.width, page.height, page.index, page.scale) == (30, 20, 0, 1.0)
    assert (page.original_width, page.original_height) == (30, 20)
    assert px(page, 5, 5) == BLUE
    with pytest.raises(dataclasses.FrozenInstanceError):
        page.scale = 2.0  # type: ignore[misc]


def test_exif_rotated_jpeg_comes_out_upright() -> None:
    # Stored 80x40 with red on the left half; orientation 6 = "rotate 90° clockwise to view",
    # so the viewer sees 40x80 with red on the top half.
    img = Image.new("RGB", (80, 40), BLUE)
    img.paste(RED, (0, 0, 40, 40))
    exif = Image.Exif()
    exif[0x0112] = 6
    page = one(encode(img, "JPEG", exif=exif, quality=95))
    assert (page.width, page.height) == (40, 80)
    assert (page.original_width, page.original_height) == (40, 80)
    assert close(px(page, 20, 10), RED)
    assert close(px(page, 20, 70), BLUE)


def test_rgba_is_flattened_on_white() -> None:
    img = Image.new("RGBA", (3, 1))
    img.putpixel((0, 0), (0, 0, 0, 0))        # transparent -> white
    img.putpixel((1, 0), (255, 0, 0, 255))    # opaque red stays red
    img.putpixel((2, 0), (0, 0, 0, 128))      # half black -> mid grey
    page = one(encode(img, "PNG"))
    assert px(page, 0, 0) == WHITE
    assert px(page, 1, 0) == RED
    assert close(px(page, 2, 0), (127, 127, 127), tol=2)


def test_palette_with_transparency_is_flattened() -> None:
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    img.putpixel((0, 0), 0)
    img.putpixel((1, 0), 1)
    page = one(encode(img, "PNG", transparency=0))
    assert px(page, 0, 0) == WHITE
    assert px(page, 1, 0) == (0, 255, 0)


@pytest.mark.parametrize(("mode", "value", "expected"), [
    ("L", 100, (100, 100, 100)),
    ("1", 1, WHITE),
    ("LA", (50, 255), (50, 50, 50)),
])
def test_low_depth_modes(mode: str, value: object, expected: tuple[int, int, int]) -> None:
    page = one(encode(Image.new(mode, (4, 4), value), "PNG"))  # type: ignore[arg-type]
    assert px(page, 1, 1) == expected


def test_cmyk_tiff_converts_to_rgb() -> None:
    img = Image.new("CMYK", (4, 4), (0, 255, 255, 0))  # no cyan, full magenta+yellow: red
    page = one(encode(img, "TIFF"))
    assert px(page, 0, 0) == RED


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    img = Image.new("I;16", (4, 1))
    for x, v in enumerate((0, 257, 32768, 65535)):
        img.putpixel((x, 0), v)
    page = one(encode(img, "PNG"))
    greys = [px(page, x, 0)[0] for x in range(4)]
    assert greys == [0, 1, 128, 255]  # clipping would give [0, 255, 255, 255]


def test_float_tiff_in_unit_range_is_scaled() -> None:
    img = Image.new("F", (3, 1))
    for x, v in enumerate((0.0, 0.5, 1.0)):
        img.putpixel((x, 0), v)
    page = one(encode(img, "TIFF"))
    assert [px(page, x, 0)[0] for x in range(3)] == [0, 128, 255]


def test_multi_frame_tiff_gives_one_page_per_frame() -> None:
    colours = [RED, (0, 255, 0), BLUE]
    frames = [Image.new("RGB", (10 + i, 8), c) for i, c in enumerate(colours)]
    data = encode(frames[0], "TIFF", save_all=True, append_images=frames[1:])
    pages = decode(data, LIMITS)
    assert [p.index for p in pages] == [0, 1, 2]
    assert [p.width for p in pages] == [10, 11, 12]
    assert [px(p, 2, 2) for p in pages] == colours
    assert all(p.frame_count == 3 for p in pages)
    capped = decode(data, LimitSettings(max_pages=2))
    assert [p.index for p in capped] == [0, 1]
    assert capped[1].frame_count == 3


def test_animated_gif_frames() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in (RED, BLUE)]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    pages = decode(data, LIMITS)
    assert [px(p, 1, 1) for p in pages] == [RED, BLUE]


def test_pixel_cap_downscales_keeping_aspect() -> None:
    img = Image.new("RGB", (400, 100), RED)
    page = one(encode(img, "PNG"), LimitSettings(max_pixels=10_000))
    assert page.width * page.height <= 10_000
    assert (page.width, page.height) == (200, 50)
    assert page.scale == pytest.approx(0.5)
    assert (page.original_width, page.original_height) == (400, 100)


def test_large_rotated_jpeg_is_downscaled_upright() -> None:
    img = Image.new("RGB", (1600, 800), BLUE)
    img.paste(RED, (0, 0, 800, 800))
    exif = Image.Exif()
    exif[0x0112] = 6
    page = one(encode(img, "JPEG", exif=exif), LimitSettings(max_pixels=20_000))
    assert page.width * page.height <= 20_000
    assert (page.original_width, page.original_height) == (800, 1600)
    assert page.height / page.width == pytest.approx(2.0, rel=0.02)
    assert page.scale == pytest.approx(page.width / 800)
    assert close(px(page, page.width // 2, page.height // 4), RED)


def test_pixels_above_bomb_guard_refused() -> None:
    with pytest.raises(TooLarge):
        decode(encode(Image.new("L", (100, 100)), "PNG"), LimitSettings(bomb_pixels=9_999))


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_bomb_header_refused_before_decoding() -> None:
    # 10^10 pixels declared in 57 bytes: refused from the header, never allocated.
    with pytest.raises(TooLarge):
        decode(_png_header_only(100_000, 100_000), LIMITS)


def test_random_bytes_are_bad_image() -> None:
    with pytest.raises(BadImage):
        decode(random.Random(7).randbytes(4096), LIMITS)
    with pytest.raises(BadImage):
        decode(b"", LIMITS)


def test_truncated_jpeg_is_bad_image() -> None:
    noisy = Image.frombytes("RGB", (64, 64), random.Random(3).randbytes(64 * 64 * 3))
    data = encode(noisy, "JPEG", quality=90)
    with pytest.raises(BadImage):
        decode(data[: len(data) // 2], LIMITS)


@pytest.mark.parametrize("data", [
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",
    b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>',
    b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00",
])
def test_documents_and_vector_formats_unsupported(data: bytes) -> None:
    with pytest.raises(UnsupportedFormat):
        decode(data, LIMITS)


def test_pillow_format_outside_allowlist_unsupported() -> None:
    with pytest.raises(UnsupportedFormat):
        decode(encode(Image.new("RGB", (4, 4), RED), "SGI"), LIMITS)


def test_sha256_hex() -> None:
    assert sha256_hex(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_frames_over_the_document_pixel_cap_are_refused() -> None:
    """A multi-frame image's frames count together (limits.max_document_pixels), from their
    headers: 24 frames of a few pixels each stop at the cap, not after decoding them all."""
    frames = [Image.new("L", (1000, 1000), i * 10) for i in range(24)]
    buf = io.BytesIO()
    frames[0].save(buf, "TIFF", save_all=True, append_images=frames[1:], compression="tiff_deflate")
    with pytest.raises(TooLarge, match=r"4 frames of TIFF hold 4,000,000 pixels together: more than "
                                       r"limits.max_document_pixels"):
        decode(buf.getvalue(), LimitSettings(max_document_pixels=3_500_000))
    assert len(decode(buf.getvalue(), LimitSettings(max_document_pixels=24_000_000))) == 24


def test_sixteen_bit_bands_give_the_pixels_the_whole_image_gives() -> None:
    """16-bit → 8-bit is done a band of rows at a time (memory), with the same arithmetic as the
    whole image at once: every value 0..65535, across band edges."""
    from worker.decoding.images import _sixteen_to_l, _stretch

    rng = random.Random(3)
    width, height = 2003, 2500  # bands of 2,094 rows: one edge inside the image
    data = b"".join(struct.pack("<H", v) for v in range(65536))
    data += bytes(rng.getrandbits(8) for _ in range(width * height * 2 - len(data)))
    img = Image.frombytes("I;16", (width, height), data)
    assert _sixteen_to_l(img).tobytes() == _stretch(img.convert("I"), 0.0, 65535.0).tobytes()
