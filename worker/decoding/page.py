"""A decoded page, what every decoder returns (images and PDF documents alike) and every engine
reads. Its own module so that the decoders share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True)
class Page:
    """One decoded frame, ready for an engine."""

    image: Image.Image
    #: frame number in the file (0-based)
    index: int
    width: int
    height: int
    #: upright (after EXIF orientation) full-resolution size
    original_width: int
    original_height: int
    #: width / original_width (1.0 when not downscaled)
    scale: float
    #: frames in the file; more than the pages returned when ``max_pages`` cut it short
    frame_count: int = 1
    #: sha256 of the rendered page when the page, not the file, is the unit of caching (PDF pages)
    digest: str | None = None
