"""Decoding in supervised child processes, so a decoder that crashes or hangs costs one image,
never the worker.

Image decoders are C code (libjpeg, libpng, libtiff, libwebp, openjpeg, libavif) fed bytes from
anyone who can submit a reference; a segfault or an endless loop there would otherwise take the
whole worker down — every chunk it holds, its engine — and, redelivered, take down the next
worker too. With ``limits.decode_isolation`` (the default) each decode runs in one of
``limits.decode_processes`` long-lived children forked from a forkserver (never from the
multithreaded worker itself). A fetch thread borrows one child for a batch of images (a group of
a chunk's cache misses: one message each way, not one per image), and for each image:

- the child answers: its pages (or its typed error, e.g. ``BadImage``) come back. Large files
  and pages travel in a memory file (``worker.decoding.memfd_pipe``), not pickled through the pipe:
  unpickling a 2048×1536 page held the worker's GIL 7-13 ms, time the engine thread waited;
- the child dies (segfault, abort, the OOM killer) on it: the image gets ``DecoderCrashed``;
- the child spends ``limits.decode_timeout_s`` on it: it is SIGKILLed and the image gets
  ``DecoderCrashed`` too;
- the image needs more than the child's limits: ``limits.decode_memory_bytes`` of address space
  (RLIMIT_AS, set once per child: the allocation fails, the child answers ``TooLarge`` and
  leaves, since a heap that ran out is not trusted with the next image) or
  ``limits.decode_cpu_s`` of CPU (RLIMIT_CPU, moved on before each image: the kernel kills the
  child with SIGXCPU). Either way the image fails ``TooLarge`` (permanent: the same bytes need
  the same again) and a fresh child takes the old one's place. A decoder library that aborts
  when an allocation fails (rather than reporting it) ends as a crash: ``DecoderCrashed``.

What runs in a child (its limits, its loop, its answers) is ``worker.decoding.child``. The child
records which image it is on (and since when) in memory shared with the worker, so a
crash costs exactly that image: the batch's images it had not answered yet are decoded again by
a fresh child. A dead or killed child is replaced at once; other images, decoding in other
children, are not touched. ``DecoderCrashed`` is retryable (the machine may have been short of memory); an image
that crashes its decoder on every attempt ends as ``RetriesExhausted`` naming it.

``limits.decode_fault_markers`` (tests only, off by default) makes the decoder abort, hang or
burn CPU on bytes that contain ``FAULT_ABORT`` / ``FAULT_HANG`` / ``FAULT_SPIN``: how the chaos
suite (bench/chaos) makes a real decoder crash on certain files. ``FAULT_SLOW`` makes it take
``FAULT_SLOW_S`` on a file (a slow decoder that still finishes), so a test's timing does not
depend on how fast the machine is.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ocrq.errors import DecoderCrashed, OcrqError, TooLarge
from ocrq.settings import LimitSettings
from worker.decoding import memfd_pipe
from worker.decoding.child import (  # noqa: F401 - the fault markers: tests and the chaos suite import them here
    FAULT_ABORT,
    FAULT_HANG,
    FAULT_SLOW,
    FAULT_SLOW_S,
    FAULT_SPIN,
    Outcome,
    _faults,
    _receive,
    _serve,
)
from worker.decoding.images import decode
from worker.decoding.page import Page

log = logging.getLogger("ocrq.decode")

#: images sent to a child in one message: at most this many bytes of them (at least one image)
_BATCH_BYTES = 8 << 20


class Decoder(Protocol):
    #: decodes that can run at once (a caller splits a chunk's images into this many groups)
    parallelism: int

    def decode(self, data: bytes) -> list[Page]: ...

    def decode_many(self, datas: Sequence[bytes]) -> list[Outcome]:
        """Each image's pages or its error, in order (never raises for one image's sake)."""
        ...

    def close(self) -> None: ...


class InProcessDecoder:
    """``limits.decode_isolation: false``: decode in the fetch thread (no per-image IPC; a
    decoder crash takes the worker down and the reaper hands its chunks to another)."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self.parallelism = max(1, limits.fetch_threads)  # Pillow decodes without the GIL

    def decode(self, data: bytes) -> list[Page]:
        _faults(data, self.limits)
        return decode(data, self.limits)

    def decode_many(self, datas: Sequence[bytes]) -> list[Outcome]:
        out: list[Outcome] = []
        for data in datas:
            try:
                out.append(self.decode(data))
            except Exception as exc:  # handed back per image; the chunk classifies it
                out.append(exc)
        return out

    def close(self) -> None:
        pass


class _Child:
    def __init__(self, ctx: Any, limits: LimitSettings) -> None:
        self.conn, child_end = mp.Pipe()
        #: [index in the current batch of the image being decoded, when it started
        #: (time.monotonic: one clock for every process of the host)]
        self.progress: Any = ctx.RawArray("d", 2)
        self.proc = ctx.Process(target=_serve, args=(child_end, limits, self.progress), daemon=True,
                                name="ocrq-decode")
        self.proc.start()
        child_end.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class IsolatedDecoder:
    """A fixed set of decoding children; each round trip borrows one for a batch of images.

    A batch is one message each way (one reply per ``_REPLY_BYTES`` of pages), not one per
    image: the round trip's pipe writes, wake-ups and queue hand-offs were most of the worker's
    cost of decoding a small image (docs/bench/overhead.md). What a crash costs is unchanged:
    the child records which image it is on, so only that image gets ``DecoderCrashed``; the
    batch's other images it had not answered yet are decoded again by a fresh child. Each image
    still has ``decode_timeout_s`` from its own start."""

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        self.timeout_s = limits.decode_timeout_s
        self._ctx = mp.get_context("forkserver")
        # the forkserver imports Pillow and the decoder once; each child is a cheap fork of it
        self._ctx.set_forkserver_preload(["worker.decoding.decode"])
        n = limits.decode_processes or min(limits.fetch_threads, os.cpu_count() or 1)
        self.parallelism = max(1, n)
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._lock = threading.Lock()
        self._children: list[_Child] = []
        self._closed = False
        #: children that died or hung and were replaced
        self.crashes = 0
        #: children that left after hitting their memory limit, and were replaced
        self.retired = 0
        for _ in range(self.parallelism):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Child:
        child = _Child(self._ctx, self.limits)
        with self._lock:
            self._children.append(child)
        return child

    def _replace(self, child: _Child, crashed: bool = True) -> None:
        child.kill()
        with self._lock:
            self._children.remove(child)
            if crashed:
                self.crashes += 1
            else:
                self.retired += 1
            closed = self._closed
        if not closed:
            self._idle.put(self._spawn())

    def decode(self, data: bytes) -> list[Page]:
        outcome = self.decode_many([data])[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def decode_many(self, datas: Sequence[bytes]) -> list[Outcome]:
        out: list[Outcome] = []
        start = 0
        while start < len(datas):  # batches of at most _BATCH_BYTES (a large image alone)
            end, size = start + 1, len(datas[start])
            while end < len(datas) and size + len(datas[end]) <= _BATCH_BYTES:
                size += len(datas[end])
                end += 1
            out += self._decode_batch(datas[start:end])
            start = end
        return out

    def _decode_batch(self, datas: Sequence[bytes]) -> list[Outcome]:
        """One batch through children until every image has an outcome: after a crash, the
        culprit fails and the images the child had not answered go to a fresh child."""
        outcomes: dict[int, Outcome] = {}
        pending = list(range(len(datas)))
        while pending:
            got, culprit, error = self._exchange([datas[i] for i in pending])
            outcomes.update(zip(pending, got, strict=False))
            if culprit is None or error is None:  # all answered, or the child left after len(got)
                pending = pending[len(got):]
                continue
            outcomes[pending[culprit]] = error
            pending = [i for k, i in enumerate(pending[len(got):], len(got)) if k != culprit]
        return [outcomes[i] for i in range(len(datas))]

    def _exchange(self, batch: list[bytes]) -> tuple[list[Outcome], int | None, OcrqError | None]:
        """Send ``batch`` to one child; the outcomes it answered (a prefix of the batch), and when
        it died or hung: the index of the image it was on, and that image's error."""
        child = self._idle.get()
        got: list[Outcome] = []
        try:
            child.progress[0], child.progress[1] = -1.0, time.monotonic()  # the clock runs from the send
            memfd_pipe.send(child.conn, None, batch)
            while len(got) < len(batch):
                if not self._answered(child):
                    culprit = self._culprit(child, len(got), len(batch))
                    self._replace(child)
                    return got, culprit, DecoderCrashed(
                        f"decoder hung on this image: no answer within {self.timeout_s:g}s, killed")
                answered, leaving = _receive(child.conn)
                got += answered
                if leaving:  # its memory limit was hit: a fresh child for the rest of the batch
                    self._replace(child, crashed=False)
                    return got, None, None
        except (EOFError, OSError):
            culprit = self._culprit(child, len(got), len(batch))
            child.proc.join(5)
            code = child.proc.exitcode
            self._replace(child)
            if code == -signal.SIGXCPU:
                return got, culprit, TooLarge(f"decoding took more than limits.decode_cpu_s"
                                              f" ({self.limits.decode_cpu_s:g} s of CPU): stopped")
            return got, culprit, DecoderCrashed(f"decoder process died on this image ({_describe(code)})")
        except BaseException:
            self._replace(child)  # interrupted mid-exchange: the pipe's state is unknown
            raise
        self._idle.put(child)
        return got, None, None

    def _answered(self, child: _Child) -> bool:
        """Wait for the child's next message while the image it is on is within its timeout."""
        while True:
            remaining = child.progress[1] + self.timeout_s - time.monotonic()
            if child.conn.poll(max(0.0, remaining)):
                return True
            if child.progress[1] + self.timeout_s <= time.monotonic():  # not moved on meanwhile
                return False

    @staticmethod
    def _culprit(child: _Child, answered: int, n: int) -> int:
        # the image the child was on; one it had not reached when killed from outside (between
        # two images) is blamed on the next unanswered one, as a single-image round trip would
        return min(n - 1, max(answered, int(child.progress[0])))

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
