"""Decoding in supervised child processes, so a decoder that crashes or hangs costs one image,
never the worker.

Image decoders are C code (libjpeg, libpng, libtiff, libwebp, openjpeg, libavif) fed bytes from
anyone who can submit a reference; a segfault or an endless loop there would otherwise take the
whole worker down — every chunk it holds, its engine — and, redelivered, take down the next
worker too. With ``limits.decode_isolation`` (the default) each decode runs in one of
``limits.decode_processes`` long-lived children forked from a forkserver (never from the
multithreaded worker itself). A fetch thread borrows one child for one image:

- the child answers: its pages (or its typed error, e.g. ``BadImage``) come back pickled;
- the child dies (segfault, abort, the OOM killer): the image gets ``DecoderCrashed``;
- the child is silent for ``limits.decode_timeout_s``: it is SIGKILLed and the image gets
  ``DecoderCrashed`` too.

A dead or killed child is replaced at once; other images, decoding in other children, are not
touched. ``DecoderCrashed`` is retryable (the machine may have been short of memory); an image
that crashes its decoder on every attempt ends as ``RetriesExhausted`` naming it.

``limits.decode_fault_markers`` (tests only, off by default) makes the decoder abort or hang on
bytes that contain ``FAULT_ABORT`` / ``FAULT_HANG``: how the chaos suite (bench/chaos) makes a
real decoder crash on certain files.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ocrq.errors import DecoderCrashed, OcrqError, error_from_dict
from ocrq.settings import LimitSettings
from worker.images import Page, decode

log = logging.getLogger("ocrq.decode")

#: test-only markers honoured when ``limits.decode_fault_markers`` is on
FAULT_ABORT = b"OCRQ-TEST-DECODER-ABORT"
FAULT_HANG = b"OCRQ-TEST-DECODER-HANG"


class Decoder(Protocol):
    def decode(self, data: bytes) -> list[Page]: ...

    def close(self) -> None: ...


def _faults(data: bytes, limits: LimitSettings) -> None:
    if not limits.decode_fault_markers:
        return
    if FAULT_ABORT in data:
        os.abort()  # SIGABRT: what a failed assertion in a C decoder does
    if FAULT_HANG in data:
        while True:  # a decoder spinning forever on a crafted file
            time.sleep(3600)


class InProcessDecoder:
    """``limits.decode_isolation: false``: decode in the fetch thread (no per-image IPC; a
    decoder crash takes the worker down and the reaper hands its chunks to another)."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits

    def decode(self, data: bytes) -> list[Page]:
        _faults(data, self.limits)
        return decode(data, self.limits)

    def close(self) -> None:
        pass


def _serve(conn: Connection, limits: LimitSettings) -> None:
    """A child's loop: bytes in, pages (or a typed error) out, until the pipe closes."""
    # the worker's warm shutdown (SIGTERM/SIGINT to its process group) must not kill a decode
    # in flight; the child leaves when the worker closes the pipe or dies (EOF)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            _faults(data, limits)
            reply: tuple[str, Any] = ("ok", decode(data, limits))
        except OcrqError as exc:
            reply = ("err", exc.to_dict())
        except Exception as exc:  # decode() types Pillow's errors; MemoryError and bugs land here
            reply = ("err", DecoderCrashed(f"decoder raised {type(exc).__name__}: {exc}").to_dict())
        conn.send(reply)


class _Child:
    def __init__(self, ctx: Any, limits: LimitSettings) -> None:
        self.conn, child_end = mp.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child_end, limits), daemon=True, name="ocrq-decode")
        self.proc.start()
        child_end.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class IsolatedDecoder:
    """A fixed set of decoding children; each ``decode`` borrows one for one image."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self.timeout_s = limits.decode_timeout_s
        self._ctx = mp.get_context("forkserver")
        # the forkserver imports Pillow and the decoder once; each child is a cheap fork of it
        self._ctx.set_forkserver_preload(["worker.decode"])
        n = limits.decode_processes or min(limits.fetch_threads, os.cpu_count() or 1)
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()
        self._children: list[_Child] = []
        self._closed = False
        #: children that died or hung and were replaced
        self.crashes = 0
        for _ in range(max(1, n)):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Child:
        child = _Child(self._ctx, self.limits)
        with self._lock:
            self._children.append(child)
        return child

    def _replace(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._children.remove(child)
            self.crashes += 1
            closed = self._closed
        if not closed:
            self._idle.put(self._spawn())

    def decode(self, data: bytes) -> list[Page]:
        child = self._idle.get()
        try:
            child.conn.send_bytes(data)
            answered = child.conn.poll(self.timeout_s)
            reply = child.conn.recv() if answered else None
        except (EOFError, OSError):
            child.proc.join(5)
            code = child.proc.exitcode
            self._replace(child)
            raise DecoderCrashed(f"decoder process died on this image ({_describe(code)})") from None
        except BaseException:
            self._replace(child)  # interrupted mid-exchange: the pipe's state is unknown
            raise
        if reply is None:
            self._replace(child)
            raise DecoderCrashed(f"decoder hung on this image: no answer within {self.timeout_s:g}s, killed")
        self._idle.put(child)
        status, payload = reply
        if status == "ok":
            pages: list[Page] = payload
            return pages
        raise error_from_dict(payload)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            children = list(self._children)
        for child in children:
            child.conn.close()  # EOF: the child leaves its loop
        for child in children:
            child.proc.join(2)
            if child.proc.is_alive():
                child.proc.kill()


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def make_decoder(limits: LimitSettings) -> Decoder:
    return IsolatedDecoder(limits) if limits.decode_isolation else InProcessDecoder(limits)
