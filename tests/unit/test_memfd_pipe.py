"""worker.decoding.memfd_pipe over a real socket pair (both ends in this process): a message's blobs come
back byte for byte, and nothing (descriptor, mapping) outlives the ``with``."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from worker.decoding import memfd_pipe


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _memfd_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:ocrq-blobs" in line for line in f)


def test_blobs_and_meta_arrive_as_sent_and_nothing_is_left_open() -> None:
    a, b = mp.Pipe()
    try:
        blobs: list[memfd_pipe.Blob] = [os.urandom(3 << 20), b"", bytearray(b"x" * 17), memoryview(os.urandom(1000))]
        fds = _open_fds()
        memfd_pipe.send(a, {"n": 4}, blobs)
        with memfd_pipe.receive(b) as (meta, views):
            assert meta == {"n": 4}
            assert [bytes(v) for v in views] == [bytes(x) for x in blobs]
            assert _memfd_mappings() == 1
            kept = views[0]
        with pytest.raises(ValueError):  # a view does not outlive the message
            bytes(kept)
        assert _open_fds() == fds and _memfd_mappings() == 0
    finally:
        a.close()
        b.close()


def test_small_messages_travel_pickled_without_a_memory_file() -> None:
    a, b = mp.Pipe()
    try:
        fds = _open_fds()
        memfd_pipe.send(a, ["only", "meta"], [b"", b""])
        with memfd_pipe.receive(b) as (meta, views):
            assert meta == ["only", "meta"] and [bytes(v) for v in views] == [b"", b""]
        small = [os.urandom(1000) for _ in range(10)]
        memfd_pipe.send(a, None, small)
        with memfd_pipe.receive(b) as (meta, views):
            assert meta is None and [bytes(v) for v in views] == small
            assert _memfd_mappings() == 0
        assert _open_fds() == fds
    finally:
        a.close()
        b.close()


def test_a_closed_peer_is_eof() -> None:
    a, b = mp.Pipe()
    a.close()
    with pytest.raises(EOFError), memfd_pipe.receive(b):
        pass
    b.close()


def test_without_memfd_large_blobs_are_pickled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS has no memfd_create (not Linux), every message is pickled, as before."""
    monkeypatch.delattr(os, "memfd_create")
    a, b = mp.Pipe()
    try:
        big = os.urandom(3 << 20)
        sender = threading.Thread(target=memfd_pipe.send, args=(a, "m", [big]))  # more than the socket holds
        sender.start()
        assert b.poll(10), "nothing sent"  # a sender that raised sends nothing: fail, do not hang
        with memfd_pipe.receive(b) as (meta, views):
            assert meta == "m" and bytes(views[0]) == big and _memfd_mappings() == 0
        sender.join(10)
    finally:
        a.close()
        b.close()
