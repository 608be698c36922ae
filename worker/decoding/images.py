"""Fetched bytes -> upright RGB pages within the pixel cap, with typed errors.

The format is sniffed from the content (magic bytes), never from the name. PDFs are rendered page
by page (``worker.decoding.documents``). One page per frame (multi-page TIFF, animated GIF/WebP) up to
``max_pages``. EXIF orientation is
applied; alpha is flattened on white; 16-bit and float images are scaled to 8 bits (not clipped);
images above ``max_pixels`` are downscaled keeping their aspect and the scale is recorded, so
engine coordinates map back with ``x / page.scale``.

Errors: bytes that are not an image (or are truncated) -> ``BadImage``; a container we do not
accept (PostScript/EPS, SVG/XML, HEIC, or a Pillow format outside ``ACCEPTED_FORMATS``) ->
``UnsupportedFormat``; a frame above ``bomb_pixels`` -> ``TooLarge`` (checked from the header,
before any pixel is decoded).

An error describes the content (its size, the format its first bytes name, ``describe``) and
never quotes it: a file a worker may read can hold a password (the stack's own ``flower-auth``
among them), and an error travels to records, logs, Flower and the export. Pillow's own messages
are kept only without what they quote (``_without_quotes``).
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import threading

from PIL import Image, ImageOps

from ocrq.errors import BadImage, OcrqError, TooLarge, UnsupportedFormat
from ocrq.settings import LimitSettings
from worker.decoding.documents import decode_pdf, is_pdf
from worker.decoding.page import Page

#: Pillow formats we decode; anything else Pillow recognises is refused (smaller attack surface)
ACCEPTED_FORMATS = frozenset({
    "JPEG", "MPO", "PNG", "TIFF", "BMP", "DIB", "GIF", "WEBP", "PPM", "JPEG2000", "AVIF",
    "TGA", "ICO", "QOI", "PCX",
})
#: MPO's extra frames are stereo pairs or previews of the same photo, not pages
_SINGLE_FRAME = frozenset({"MPO"})
_REFUSED_MAGIC = ((b"%!PS", "PostScript/EPS"), (b"\xc5\xd0\xd3\xc6", "EPS"))
_HEIC_BRANDS = (b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis")
_ORIENTATION = 0x0112
_SIXTEEN_BIT = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_PIL_LIMIT_LOCK = threading.Lock()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode(data: bytes, limits: LimitSettings) -> list[Page]:
    """Decode every frame (up to ``limits.max_pages``) into an upright RGB ``Page``."""
    if not data:
        raise BadImage("empty image bytes")
    if is_pdf(data):
        return decode_pdf(data, limits)
    _refuse_known_unsupported(data)
    _raise_pillow_guard(limits.bomb_pixels)
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format or "unknown"
            if fmt not in ACCEPTED_FORMATS:
                raise UnsupportedFormat(f"{fmt} images are not accepted")
            frames = 1 if fmt in _SINGLE_FRAME else max(1, int(getattr(img, "n_frames", 1)))
            pages = []
            total = 0
            for index in range(min(frames, max(1, limits.max_pages))):
                if index:
                    img.seek(index)
                total += img.size[0] * img.size[1]  # (from the frame's header: nothing decoded yet)
                if total > limits.max_document_pixels:
                    raise TooLarge(f"{index + 1} frames of {fmt} hold {total:,} pixels together: more than"
                                   f" limits.max_document_pixels ({limits.max_document_pixels:,})")
                pages.append(_page(img, index, frames, limits))
            return pages
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise TooLarge(f"decompression bomb refused: {exc}") from exc
    except (OcrqError, MemoryError):
        raise
    except Image.UnidentifiedImageError as exc:  # no accepted format's signature: text, archives...
        what = describe(data)
        raise BadImage(f"not an image or a PDF: {what}" if what.endswith("no image format") else
                       f"cannot read {what}: its header is truncated or corrupt") from exc
    except Exception as exc:  # Pillow raises many types on corrupt input; all mean "not an image"
        raise BadImage(f"cannot decode {describe(data)}: {type(exc).__name__}: {_without_quotes(exc)}") from exc


#: what the first bytes of a file say it is (a description, never the bytes)
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
    (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"), (b"BM", "a BMP image"), (b"%PDF-", "a PDF"),
    (b"\x00\x00\x00\x0cjP  ", "a JPEG 2000 image"), (b"\xff\x4f\xff\x51", "a JPEG 2000 codestream"),
    (b"qoif", "a QOI image"), (b"PK\x03\x04", "a ZIP archive"), (b"\x1f\x8b", "a gzip file"),
    (b"7z\xbc\xaf\x27\x1c", "a 7z archive"), (b"Rar!", "a RAR archive"), (b"\x7fELF", "an ELF executable"),
)


def describe(data: bytes) -> str:
    """What the bytes are, as an error may say it: their size and the format their first bytes
    name (for an image format: "a PNG image of N bytes", truncated or corrupt since it failed),
    or "text" / "binary data" — never any of the bytes themselves."""
    size = f"{len(data):,} bytes"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return f"a WebP image of {size}"
    for magic, name in _SIGNATURES:
        if data.startswith(magic):
            return f"{name} of {size}"
    head = data[:4096]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the 4 KiB mark is still text
        text = head[:exc.start].decode("utf-8") if exc.start > len(head) - 4 else ""
    if text and all(c.isprintable() or c in "\t\r\n\f" for c in text):
        kind = "HTML" if text.lstrip().lower().startswith(("<!doctype html", "<html")) else (
            "JSON" if text.lstrip()[:1] in ("{", "[") else "text")
        return f"{kind} of {size}, no image format"
    return f"binary data of {size}, no image format"


_QUOTED = re.compile(r"""b?(['"])(?:\\.|(?!\1).)*\1""")


def _without_quotes(exc: Exception) -> str:
    """Pillow's message without what it quotes (a TIFF header's bytes, a chunk name ...), cut."""
    return _QUOTED.sub("…", str(exc))[:200]


def _refuse_known_unsupported(data: bytes) -> None:
    for magic, name in _REFUSED_MAGIC:
        if data.startswith(magic):
            raise UnsupportedFormat(f"{name} documents are not accepted (convert them to PDF or images)")
    if data[4:8] == b"ftyp" and data[8:12] in _HEIC_BRANDS:
        raise UnsupportedFormat("HEIC images are not accepted")
    head = data[:1024].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if head.startswith(b"<?xml") or b"<svg" in head:
        raise UnsupportedFormat("SVG/XML images are not accepted")


def _raise_pillow_guard(bomb_pixels: int) -> None:
    # Pillow's own guard is one process-wide number (warning above it, error above twice it).
    # Our per-frame check below is the real limit, so Pillow's is only ever raised to ours
    # (never lowered: other threads may rely on it), under a lock, and never disabled.
    with _PIL_LIMIT_LOCK:
        current = Image.MAX_IMAGE_PIXELS
        if current is not None and current < bomb_pixels:
            Image.MAX_IMAGE_PIXELS = bomb_pixels


def _page(img: Image.Image, index: int, frames: int, limits: LimitSettings) -> Page:
    width, height = img.size
    if width * height > limits.bomb_pixels:
        raise TooLarge(f"{width}x{height} pixels exceeds the {limits.bomb_pixels} pixel bomb guard")
    orientation = img.getexif().get(_ORIENTATION, 1)
    swap = orientation in (5, 6, 7, 8)
    original = (height, width) if swap else (width, height)
    if img.format == "JPEG" or img.format == "MPO":
        # Let libjpeg decode at 1/2..1/8 scale when we will downscale anyway (less memory/time).
        ratio = math.sqrt(limits.max_pixels / (width * height))
        if ratio < 1:
            img.draft(img.mode, (max(1, math.ceil(width * ratio)), max(1, math.ceil(height * ratio))))
    # exif_transpose copies an image it leaves as it is: a 169 MP 16-bit scan's 338 MB
    upright = img if orientation in (None, 1) else ImageOps.exif_transpose(img)
    assert upright is not None  # not in_place: always an image
    rgb = _to_rgb(upright, limits.max_pixels)
    if rgb is img:  # (a small RGB image, as it is): the page must outlive the file's image
        rgb = rgb.copy()
    return Page(
        image=rgb, index=index, width=rgb.width, height=rgb.height,
        original_width=original[0], original_height=original[1],
        scale=rgb.width / original[0], frame_count=frames,
    )


def _to_rgb(image: Image.Image, max_pixels: int) -> Image.Image:
    """The image as RGB within ``max_pixels``. A gray one (L, or 16-bit scaled to L) is downscaled
    before it becomes RGB, and an RGB one is not copied first: the same pixels (each band
    resamples alike) at a third of the memory; other modes are converted, then downscaled."""
    mode = image.mode
    if mode in _SIXTEEN_BIT:
        image = _sixteen_to_l(image)
    elif mode in ("I", "F"):
        image = _high_depth_to_l(image)
    has_alpha = image.mode in _ALPHA_MODES or "transparency" in image.info
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return _downscale(Image.alpha_composite(white, rgba).convert("RGB"), max_pixels)
    if image.mode == "L":
        return _downscale(image, max_pixels).convert("RGB")
    return _downscale(image if image.mode == "RGB" else image.convert("RGB"), max_pixels)


def _sixteen_to_l(image: Image.Image) -> Image.Image:
    """A 16-bit image as L, scaled (not clipped): ``_stretch(image.convert("I"), 0, 65535)`` a
    band of rows at a time (the same pixels), so the 32-bit copy is one band's, not the whole
    image's: a 169 MP scan's two copies were 1.4 GB of its 2.1 GB peak."""
    width, height = image.size
    out = Image.new("L", image.size)
    rows = max(1, (1 << 22) // max(1, width))  # ~4 M pixels a band
    for top in range(0, height, rows):
        band = image.crop((0, top, width, min(height, top + rows)))
        out.paste(_stretch(band.convert("I"), 0.0, 65535.0), (0, top))
    return out


def _high_depth_to_l(image: Image.Image) -> Image.Image:
    """32-bit int / float images: keep a known range (8-bit, 16-bit, 0..1), else stretch."""
    extrema = image.getextrema()
    lo, hi = float(extrema[0]), float(extrema[1])  # type: ignore[arg-type]
    if lo >= 0 and hi <= 255 and (image.mode == "I" or hi > 1):
        return _stretch(image, 0.0, 255.0)
    if image.mode == "F" and lo >= 0 and hi <= 1:
        return _stretch(image, 0.0, 1.0)
    if lo >= 0 and hi <= 65535:
        return _stretch(image, 0.0, 65535.0)
    return _stretch(image, lo, hi)


def _stretch(image: Image.Image, lo: float, hi: float) -> Image.Image:
    """Map [lo, hi] linearly onto 0..255 (rounded) as an L image."""
    factor = 255.0 / (hi - lo) if hi > lo else 0.0
    offset = 0.5 - lo * factor  # +0.5: the I/F -> L conversion truncates
    return image.point(lambda v: v * factor + offset).convert("L")


def _downscale(image: Image.Image, max_pixels: int) -> Image.Image:
    width, height = image.size
    if width * height <= max_pixels:
        return image
    ratio = math.sqrt(max_pixels / (width * height))
    new_w, new_h = max(1, int(width * ratio)), max(1, int(height * ratio))
    while new_w * new_h > max_pixels and (new_w > 1 or new_h > 1):  # float rounding guard
        if new_w >= new_h:
            new_w -= 1
        else:
            new_h -= 1
    return image.resize((new_w, new_h), Image.Resampling.LANCZOS, reducing_gap=3.0)
