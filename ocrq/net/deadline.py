"""One deadline for a whole network read: connect, headers and body together.

A socket timeout bounds each ``recv``, not the read: a server that sends one byte of its headers
every 2 s holds a fetch with a 3 s timeout for as long as it likes. Here every socket a fetch
opens is registered with its ``Deadline``; one watchdog thread (for the whole process) shuts
those sockets down when the deadline passes, which wakes whatever read is blocked on them
(plain or TLS: the watchdog holds a duplicate of the descriptor, and a shutdown acts on the
socket, not on one descriptor of it). The fetch then raises, and ``expired`` says why.

Cost: one heap entry per fetch and a duplicated descriptor per connection (a redirect opens
another); the watchdog sleeps until the earliest deadline.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from types import TracebackType


class Deadline:
    """``with Deadline(seconds) as d:`` — sockets given to ``d.watch`` are shut down at the
    deadline; ``d.remaining()`` is what is left (never below 0)."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = False

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down at the deadline (at once if it has passed)."""
        dup = socket.socket(fileno=os.dup(sock.fileno()))
        with self._lock:
            if not self._done:
                self._sockets.append(dup)
                dup = None  # type: ignore[assignment]
        if dup is not None:
            dup.close()
        if self.remaining() <= 0:
            self._expire()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed already, or never connected
                pass

    def __enter__(self) -> Deadline:
        _WATCHDOG.add(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            self._done = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()


class _Watchdog:
    """One thread for every deadline of the process, started on first use."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Deadline]] = []
        self._counter = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, deadline: Deadline) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline.at, next(self._counter), deadline))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ocrq-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                at, _, deadline = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
            if not deadline._done:
                deadline._expire()


_WATCHDOG = _Watchdog()
