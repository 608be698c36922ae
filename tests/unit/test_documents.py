"""PDF pages through worker.decoding.images.decode (real PDFs made here with Pillow and pypdf)."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageDraw

from ocrq.errors import BadDocument, EncryptedDocument, TooLarge
from ocrq.settings import LimitSettings
from worker.decoding.images import decode


def make_pdf(n: int, size: tuple[int, int] = (850, 1100), resolution: float = 100.0,
             texts: list[str] | None = None) -> bytes:
    pages = []
    for i in range(n):
        img = Image.new("RGB", size, "white")
        ImageDraw.Draw(img).rectangle((50 + 40 * i, 50, 200 + 40 * i, 120), fill="black")
        if texts:
            ImageDraw.Draw(img).text((60, 300), texts[i], fill="black")
        pages.append(img)
    buf = io.BytesIO()
    pages[0].save(buf, "PDF", save_all=True, append_images=pages[1:], resolution=resolution)
    return buf.getvalue()


def encrypt(data: bytes, user_password: str = "secret") -> bytes:
    import pypdf

    writer = pypdf.PdfWriter()
    writer.append(pypdf.PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password, owner_password="owner", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def test_pages_rendered_at_the_configured_dpi_with_page_digests() -> None:
    # 850x1100 px at 100 dpi = 8.5x11 in; at 200 dpi 1700x2200 (3.74 MP, under 2048² = 4.19 MP)
    pages = decode(make_pdf(3), LimitSettings(pdf_dpi=200))
    assert [p.index for p in pages] == [0, 1, 2]
    assert all((p.width, p.height) == (1700, 2200) and p.frame_count == 3 for p in pages)
    assert all(p.image.mode == "RGB" and p.scale == pytest.approx(1.0) for p in pages)
    digests = [p.digest for p in pages]
    assert all(digests) and len(set(digests)) == 3  # different pages, different digests


def test_the_same_page_in_two_pdfs_has_the_same_digest() -> None:
    one = decode(make_pdf(1), LimitSettings())
    three = decode(make_pdf(3), LimitSettings())
    assert one[0].digest == three[0].digest
    assert decode(make_pdf(1), LimitSettings(pdf_dpi=150))[0].digest != one[0].digest  # render params count


def test_pages_stay_within_max_pixels() -> None:
    limits = LimitSettings(pdf_dpi=300, max_pixels=1_000_000)
    (page,) = decode(make_pdf(1), limits)
    assert page.width * page.height <= 1_000_000
    assert page.original_width == 2550 and page.scale == pytest.approx(page.width / 2550, rel=1e-3)


def test_page_count_and_document_pixels_are_capped() -> None:
    with pytest.raises(TooLarge, match="max_pages"):
        decode(make_pdf(3), LimitSettings(max_pages=2))
    with pytest.raises(TooLarge, match="max_document_pixels"):
        decode(make_pdf(3), LimitSettings(max_document_pixels=10_000_000))


def test_encrypted_and_broken_pdfs_are_typed() -> None:
    data = make_pdf(2)
    with pytest.raises(EncryptedDocument):
        decode(encrypt(data), LimitSettings())
    # an owner password alone (no user password) opens: permissions do not stop OCR
    assert len(decode(encrypt(data, user_password=""), LimitSettings())) == 2
    with pytest.raises(BadDocument):
        decode(b"%PDF-1.7\n1 0 obj\n<<>>\nendobj\n", LimitSettings())
    with pytest.raises(BadDocument):
        decode(data[: len(data) // 3], LimitSettings())
