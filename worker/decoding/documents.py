"""PDF documents -> one upright RGB ``Page`` per PDF page, rendered with PDFium (pypdfium2).

Each page is rendered at ``limits.pdf_dpi``, or smaller when that would exceed
``limits.max_pixels`` (the page is rendered at the final size, never rendered big and then
downscaled). Before any page is rendered, the page count must be within ``limits.max_pages`` and
the pixels of all pages together within ``limits.max_document_pixels``, else ``TooLarge``.

Every page carries the sha256 of its rendered pixels (size and mode included): the worker caches
PDF pages by that hash rather than by the file's bytes, so the same page inside two different
PDFs (a cover sheet, a form reused across documents) is OCRed once. The render parameters are in
the pixels: a different DPI is a different hash.

Errors, all on the first attempt: a PDF that needs a password -> ``EncryptedDocument``; one
PDFium cannot open or render -> ``BadDocument``. PDFium is not thread-safe: calls are serialised
by one process-wide lock (the fetch pool's other threads keep decoding images meanwhile).
"""

from __future__ import annotations

import hashlib
import math
import threading

from ocrq.errors import BadDocument, EncryptedDocument, TooLarge
from ocrq.settings import LimitSettings
from worker.decoding.page import Page

_PDFIUM_LOCK = threading.Lock()
_POINTS_PER_INCH = 72.0


def is_pdf(data: bytes) -> bool:
    # the header may follow up to 1 KiB of junk (PDF 1.7, annex H)
    return b"%PDF-" in data[:1024]


def page_digest(image: object) -> str:
    """sha256 over the page's size, mode and pixels: the page's content for the cache."""
    from PIL import Image

    assert isinstance(image, Image.Image)
    head = f"{image.width}x{image.height}:{image.mode}:".encode()
    return hashlib.sha256(head + image.tobytes()).hexdigest()


def decode_pdf(data: bytes, limits: LimitSettings) -> list[Page]:
    import pypdfium2 as pdfium

    with _PDFIUM_LOCK:
        try:
            doc = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            if getattr(exc, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD:
                raise EncryptedDocument(f"the PDF is encrypted (a password is needed to open it): {exc}") from exc
            raise BadDocument(f"cannot open the PDF: {exc}") from exc
        try:
            return _render_all(doc, limits)
        except pdfium.PdfiumError as exc:
            raise BadDocument(f"cannot render the PDF: {exc}") from exc
        finally:
            doc.close()


def _render_all(doc: object, limits: LimitSettings) -> list[Page]:
    count = len(doc)  # type: ignore[arg-type]
    if count == 0:
        raise BadDocument("the PDF has no pages")
    if count > limits.max_pages:
        raise TooLarge(f"{count} pages > limits.max_pages ({limits.max_pages}): split the document or raise the cap")
    sizes = [doc[i].get_size() for i in range(count)]  # type: ignore[index]
    scales = [_scale(w, h, limits) for w, h in sizes]
    total = sum(round(w * s) * round(h * s) for (w, h), s in zip(sizes, scales, strict=True))
    if total > limits.max_document_pixels:
        raise TooLarge(f"{count} pages render to {total} pixels > limits.max_document_pixels "
                       f"({limits.max_document_pixels})")
    pages = []
    for index, ((w, h), scale) in enumerate(zip(sizes, scales, strict=True)):
        page = doc[index]  # type: ignore[index]
        try:
            image = page.render(scale=scale, fill_color=(255, 255, 255, 255)).to_pil().convert("RGB")
        finally:
            page.close()
        full = _scale(w, h, LimitSettings(max_pixels=1 << 62, pdf_dpi=limits.pdf_dpi))
        pages.append(Page(
            image=image, index=index, width=image.width, height=image.height,
            original_width=max(1, round(w * full)), original_height=max(1, round(h * full)),
            scale=scale / full, frame_count=count, digest=page_digest(image),
        ))
    return pages


def _scale(width_pt: float, height_pt: float, limits: LimitSettings) -> float:
    """Pixels per point: the configured DPI, lowered so the page stays within max_pixels."""
    scale = limits.pdf_dpi / _POINTS_PER_INCH
    area = max(width_pt, 1.0) * max(height_pt, 1.0)
    if area * scale * scale > limits.max_pixels:
        scale = math.sqrt(limits.max_pixels / area) * 0.999  # rounding must not cross the cap
    return scale
