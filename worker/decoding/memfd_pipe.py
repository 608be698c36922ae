"""Messages between the worker and its decoding children whose large byte strings (a file's
bytes going out, a page's pixels coming back) travel in a memory file, not through the pipe.

Pickling bytes through a ``Connection`` copies them in Python on both sides (pickle's buffer,
the pipe's reads gathered into one buffer, the unpickled object), holding the GIL. In a GPU
worker that time is taken from the engine thread, which needs the GIL to launch each decode
step. Measured (docs/bench/gpu-worker.md, 2026-12-04): a 2048×1536 page held the
worker's GIL 7-13 ms pickled and 0.3-0.6 ms here; on the H200 the same batches took the
transformers engine 5-15 % less time in the worker.

The sender writes the byte strings into one anonymous memory file (``memfd_create``;
``os.write`` copies without the GIL), sends the small rest of the message pickled, then the
file's descriptor over the same Unix socket (``SCM_RIGHTS``). The receiver maps the file and
sees each byte string as a ``memoryview``: no copy until it keeps one. The file is freed once
both descriptors and the mapping are closed, also when either side dies.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

Blob = bytes | bytearray | memoryview
#: blobs smaller than this in all are pickled with the message: memory files' system calls
#: (create, write, pass, map, close) cost ~120 µs more a round trip, 3.5-4 µs a small image in
#: batches of 32, than pickling them
INLINE_BYTES = 1 << 20


def send(conn: Connection, meta: Any, blobs: Sequence[Blob] | Iterator[Blob]) -> None:
    """Send ``meta`` with ``blobs`` (pickled alongside when small, else in a memory file). An
    iterator of blobs always goes in a memory file, each written as it comes (the sender need
    not hold them all at once: a child's pages, made bytes one at a time)."""
    if not isinstance(blobs, Iterator) or not hasattr(os, "memfd_create"):
        blobs = list(blobs)
        if sum(len(blob) for blob in blobs) < INLINE_BYTES or not hasattr(os, "memfd_create"):
            conn.send((meta, [len(blob) for blob in blobs], [bytes(blob) for blob in blobs]))  # memfd is Linux's
            return
    sizes: list[int] = []
    fd = os.memfd_create("ocrq-blobs", os.MFD_CLOEXEC)
    try:
        for blob in blobs:
            view = memoryview(blob).cast("B")
            sizes.append(len(view))
            while view:
                view = view[os.write(fd, view):]
            del view, blob
        conn.send((meta, sizes, None))
        reduction.send_handle(conn, fd, 0)
    finally:
        os.close(fd)


@contextmanager
def receive(conn: Connection) -> Iterator[tuple[Any, list[memoryview]]]:
    """The next message: its ``meta`` and a view of each blob, valid inside the ``with`` only.
    Raises ``EOFError``/``OSError`` as ``Connection.recv`` does when the peer is gone."""
    meta, sizes, inline = conn.recv()
    if inline is not None:
        yield meta, [memoryview(blob) for blob in inline]
        return
    fd = reduction.recv_handle(conn)
    try:
        with mmap.mmap(fd, sum(sizes), prot=mmap.PROT_READ) as mapped, memoryview(mapped) as whole:
            views, at = [], 0
            for n in sizes:
                views.append(whole[at:at + n])
                at += n
            try:
                yield meta, views
            finally:
                for view in views:
                    view.release()  # the mapping closes only once no view of it is left
    finally:
        os.close(fd)
