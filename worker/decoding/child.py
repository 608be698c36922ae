"""A decoding child's side (``worker.decoding.decode`` starts and supervises the children): its
limits, its loop, what it answers and how the parent reads an answer.

A child lives in its own address space under ``limits.decode_memory_bytes`` (RLIMIT_AS, set once)
and gets ``limits.decode_cpu_s`` of CPU per image (its soft RLIMIT_CPU, moved on before each one).
It takes a batch of images, decodes them one by one and answers with their pages or typed errors;
an image that runs it out of memory is answered ``TooLarge`` and the child leaves after that
answer (``_LEAVING``), since a heap that ran out once is not trusted with the next image.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import signal
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from PIL import Image

from ocrq.errors import DecoderCrashed, OcrqError, TooLarge, error_from_dict
from ocrq.settings import LimitSettings
from worker.decoding import memfd_pipe
from worker.decoding.images import decode
from worker.decoding.page import Page

#: test-only markers honoured when ``limits.decode_fault_markers`` is on
FAULT_ABORT = b"OCRQ-TEST-DECODER-ABORT"
FAULT_HANG = b"OCRQ-TEST-DECODER-HANG"
FAULT_SLOW = b"OCRQ-TEST-DECODER-SLOW"
FAULT_SPIN = b"OCRQ-TEST-DECODER-SPIN"
#: seconds a ``FAULT_SLOW`` file takes before it decodes
FAULT_SLOW_S = 0.1

#: what decoding one image gives: its pages, or the typed error it failed with
Outcome = list[Page] | Exception
#: a child sends what it decoded so far once its pages hold this many pixel bytes, so a batch of
#: large pages is never one huge reply
_REPLY_BYTES = 32 << 20


def _faults(data: bytes, limits: LimitSettings) -> None:
    if not limits.decode_fault_markers:
        return
    if FAULT_ABORT in data:
        os.abort()  # SIGABRT: what a failed assertion in a C decoder does
    if FAULT_HANG in data:
        while True:  # a decoder spinning forever on a crafted file
            time.sleep(3600)
    if FAULT_SLOW in data:
        time.sleep(FAULT_SLOW_S)
    if FAULT_SPIN in data:
        while True:  # a decoder burning CPU forever on a crafted file
            pass


#: the last reply of a child that leaves after it (its memory limit was hit): the rest of its
#: batch goes to a fresh child
_LEAVING = ("leave", None)


def _decode_reply(data: bytes, limits: LimitSettings) -> tuple[str, Any]:
    try:
        _faults(data, limits)
        return ("ok", decode(data, limits))
    except OcrqError as exc:
        return ("err", exc.to_dict())
    except MemoryError:
        pass  # answered below, once the traceback (and the half-decoded image it holds) is gone
    except Exception as exc:  # decode() types Pillow's errors; bugs land here
        return ("err", DecoderCrashed(f"decoder raised {type(exc).__name__}: {exc}").to_dict())
    return ("oom", TooLarge(f"decoding {len(data):,} bytes needs more memory than limits.decode_memory_bytes"
                            f" ({limits.decode_memory_bytes:,}) allows").to_dict())


def _limit_memory(limit: int) -> None:
    """This child's address space: ``limit`` bytes (0: as inherited); no core files either."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limit:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


def _limit_cpu(seconds: float) -> None:
    """``seconds`` more of CPU for this child from now (its soft RLIMIT_CPU: SIGXCPU past it);
    the hard limit is left alone, so the soft one can move on for the next image."""
    if not seconds:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _serve(conn: Connection, limits: LimitSettings, progress: Any) -> None:
    """A child's loop: a batch of images in, their pages (or typed errors) out, until the pipe
    closes. Before each image it writes (index, start time) to ``progress``, shared with the
    parent: if it dies or hangs, the parent knows which image it was on."""
    # the worker's warm shutdown (SIGTERM/SIGINT to its process group) must not kill a decode
    # in flight; the child leaves when the worker closes the pipe or dies (EOF)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _limit_memory(limits.decode_memory_bytes)
    while True:
        try:
            with memfd_pipe.receive(conn) as (_, views):
                batch = [bytes(view) for view in views]
        except (EOFError, OSError):
            return
        replies: list[tuple[str, Any]] = []
        held = 0
        for i, data in enumerate(batch):
            progress[1] = time.monotonic()  # start first: the parent reads index, then start
            progress[0] = i
            _limit_cpu(limits.decode_cpu_s)
            reply = _decode_reply(data, limits)
            if reply[0] == "oom":  # this heap ran out once: answer, then leave for a fresh child
                _ship_or_fail(conn, [*replies, ("err", reply[1]), _LEAVING], held, limits)
                return
            replies.append(reply)
            if reply[0] == "ok":
                held += sum(3 * pg.width * pg.height for pg in reply[1])
            if held >= _REPLY_BYTES and i + 1 < len(batch):
                if not _ship_or_fail(conn, replies, held, limits):
                    return
                replies, held = [], 0
        if not _ship_or_fail(conn, replies, held, limits):
            return


#: a page as a child sends it: its fields but the image, the image's mode and size; its pixels
#: are the message's blob of the same index (``worker.decoding.memfd_pipe``)
_Shipped = tuple[dict[str, Any], str, tuple[int, int], int]
_PAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Page) if f.name != "image")


def _ship_or_fail(conn: Connection, replies: list[tuple[str, Any]], pixel_bytes: int, limits: LimitSettings) -> bool:
    """``_ship``; False when the memory limit was hit while shipping: the images whose pages were
    on their way fail ``TooLarge`` instead, and the child leaves."""
    # what each image answered, without its pages (an error's dict is kept as it is)
    answers = [(status, payload if status == "err" else None) for status, payload in replies if status != "leave"]
    try:
        _ship(conn, replies, pixel_bytes)
        return True
    except MemoryError:
        pass  # (below: the pages are dropped with the traceback)
    replies.clear()
    err = TooLarge(f"the pages decoded need more memory than limits.decode_memory_bytes"
                   f" ({limits.decode_memory_bytes:,}) allows").to_dict()
    memfd_pipe.send(conn, [a if a[0] == "err" else ("err", err) for a in answers] + [_LEAVING], [])
    return False


def _ship(conn: Connection, replies: list[tuple[str, Any]], pixel_bytes: int) -> None:
    """Send a reply: errors as they are, each page as its fields, its pixels as a blob; pages of
    few pixels in all go pickled whole, which costs the worker less for small images."""
    if pixel_bytes < memfd_pipe.INLINE_BYTES:
        memfd_pipe.send(conn, replies, [])
        return
    shipped: list[tuple[str, Any]] = []
    images: list[Image.Image] = []
    for status, payload in replies:
        if status != "ok":
            shipped.append((status, payload))
            continue
        pages: list[_Shipped] = []
        for pg in payload:
            pages.append(({k: getattr(pg, k) for k in _PAGE_FIELDS}, pg.image.mode, pg.image.size, len(images)))
            images.append(pg.image)
        shipped.append(("pages", pages))
    replies.clear()  # the pages are the images' only holders now: each is freed once written

    def blobs() -> Iterator[bytes]:  # one page's bytes at a time (a 64-page PDF: 4 B/px once, not 7)
        while images:
            image = images.pop(0)
            yield image.tobytes()
            image.close()

    memfd_pipe.send(conn, shipped, blobs())


def _receive(conn: Connection) -> tuple[list[Outcome], bool]:
    """One reply from a child (``_ship``): each page rebuilt from its pixels (Pillow unpacks them
    without the GIL), and whether the child leaves after it."""
    with memfd_pipe.receive(conn) as (shipped, pixels):
        leaving = bool(shipped) and tuple(shipped[-1]) == _LEAVING
        return [_outcome(reply, pixels) for reply in (shipped[:-1] if leaving else shipped)], leaving


def _outcome(reply: tuple[str, Any], pixels: list[memoryview]) -> Outcome:
    status, payload = reply
    if status == "ok":
        pages: list[Page] = payload
        return pages
    if status == "pages":
        shipped: list[_Shipped] = payload
        return [Page(image=Image.frombytes(mode, wh, pixels[i]), **fields) for fields, mode, wh, i in shipped]
    return error_from_dict(payload)
