"""worker.decoding.decode.IsolatedDecoder with real child processes: a decoder that aborts or hangs on a
file costs that image (DecoderCrashed), never the caller, and the images decoding beside it."""

from __future__ import annotations

import io
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image, PngImagePlugin

from ocrq.errors import BadImage, DecoderCrashed, TooLarge
from ocrq.settings import LimitSettings
from worker.decoding import memfd_pipe
from worker.decoding.decode import (
    FAULT_ABORT,
    FAULT_HANG,
    FAULT_SLOW,
    FAULT_SLOW_S,
    FAULT_SPIN,
    InProcessDecoder,
    IsolatedDecoder,
)
from worker.decoding.images import decode

pytestmark = pytest.mark.integration


def png(seed: int, text: bytes = b"") -> bytes:
    img = Image.new("RGB", (64, 32), (seed % 256, 80, 160))
    info = PngImagePlugin.PngInfo()
    if text:
        info.add_text("comment", text.decode())
    out = io.BytesIO()
    img.save(out, "PNG", pnginfo=info)
    return out.getvalue()


@pytest.fixture()
def limits() -> LimitSettings:
    return LimitSettings(decode_processes=2, decode_timeout_s=2.0, decode_fault_markers=True)


def test_same_pages_as_in_process(limits: LimitSettings) -> None:
    dec = IsolatedDecoder(limits)
    try:
        data = png(7)
        got, want = dec.decode(data), decode(data, limits)
        assert [(p.index, p.width, p.height, p.scale) for p in got] == [(p.index, p.width, p.height, p.scale)
                                                                        for p in want]
        assert got[0].image.tobytes() == want[0].image.tobytes()
        with pytest.raises(BadImage):  # typed errors cross the process boundary as themselves
            dec.decode(b"not an image at all")
    finally:
        dec.close()


def test_abort_costs_one_image_and_the_child_is_replaced(limits: LimitSettings) -> None:
    dec = IsolatedDecoder(limits)
    try:
        pids = {c.proc.pid for c in dec._children}
        goods = [png(i) for i in range(40)]
        with ThreadPoolExecutor(4) as pool:
            bad = pool.submit(dec.decode, png(99, FAULT_ABORT))
            ok = list(pool.map(dec.decode, goods))
            with pytest.raises(DecoderCrashed, match="SIGABRT"):
                bad.result()
        assert len(ok) == 40 and all(len(pages) == 1 for pages in ok)
        assert dec.crashes == 1
        assert len(dec._children) == 2 and {c.proc.pid for c in dec._children} != pids
        assert all(c.proc.is_alive() for c in dec._children)
        assert dec.decode(png(1))[0].width == 64  # still serving
    finally:
        dec.close()


def test_hang_is_killed_after_the_timeout(limits: LimitSettings) -> None:
    dec = IsolatedDecoder(limits)
    try:
        t0 = time.monotonic()
        with pytest.raises(DecoderCrashed, match="hung"):
            dec.decode(png(3, FAULT_HANG))
        assert 2.0 <= time.monotonic() - t0 < 10
        assert dec.crashes == 1 and dec.decode(png(4))[0].height == 32
    finally:
        dec.close()


def test_markers_are_inert_unless_enabled() -> None:
    plain = LimitSettings(decode_processes=1)
    dec = IsolatedDecoder(plain)
    try:
        assert dec.decode(png(5, FAULT_ABORT))[0].width == 64
    finally:
        dec.close()
    assert InProcessDecoder(plain).decode(png(5, FAULT_HANG))[0].width == 64


def test_close_ends_every_child(limits: LimitSettings) -> None:
    dec = IsolatedDecoder(limits)
    procs = [c.proc for c in dec._children]
    dec.close()
    assert all(not p.is_alive() for p in procs)


def test_a_batch_costs_only_its_crashing_images(limits: LimitSettings) -> None:
    """One round trip carries many images; an abort and a hang inside it fail those two only:
    the child's progress names the culprit, and the images it had not answered go to a fresh child."""
    dec = IsolatedDecoder(limits)
    try:
        batch = [png(1), png(2, FAULT_ABORT), png(3), png(4, FAULT_HANG), png(5), b"not an image"]
        t0 = time.monotonic()
        out = dec.decode_many(batch)
        assert 2.0 <= time.monotonic() - t0 < 10  # the hang, killed after its own timeout
        assert [type(o).__name__ for o in out] == ["list", "DecoderCrashed", "list", "DecoderCrashed", "list",
                                                    "BadImage"]
        assert "SIGABRT" in str(out[1]) and "hung" in str(out[3])
        assert all(o[0].image.tobytes() == decode(batch[i], limits)[0].image.tobytes()
                   for i, o in enumerate(out) if isinstance(o, list))
        assert dec.crashes == 2 and len(dec._children) == 2
        assert dec.decode_many([png(6), png(7)])[1][0].width == 64  # still serving
    finally:
        dec.close()


def test_each_image_of_a_batch_has_its_own_timeout(limits: LimitSettings) -> None:
    """Images that each decode well within the timeout are not killed for adding up past it."""
    # each page takes FAULT_SLOW_S (0.1 s) whatever the machine's speed, far under a timeout a busy
    # CI box cannot reach for one page by a stall (0.25 s was reached once, with the suite's other
    # processes on the two cores); 30 of them in one round trip go past the timeout three times
    slow = limits.model_copy(update={"decode_timeout_s": 1.0, "decode_processes": 1})
    dec = IsolatedDecoder(slow)
    try:
        pages = [png(seed, FAULT_SLOW) for seed in range(30)]
        t0 = time.monotonic()
        got = dec.decode_many(pages)
        took = time.monotonic() - t0
        assert took >= len(pages) * FAULT_SLOW_S >= 2 * slow.decode_timeout_s
        assert all(isinstance(o, list) and o[0].width == 64 for o in got), [
            o for o in got if not isinstance(o, list)][:3]
        assert dec.crashes == 0
    finally:
        dec.close()


def test_pages_cross_in_memory_files_that_are_freed(limits: LimitSettings) -> None:
    """Files go to a child and pages come back as blobs in memory files (worker.decoding.memfd_pipe): a
    batch of large pages spans several replies, a multi-frame file keeps every frame, a bad file
    keeps its typed error, and every page is the in-process decode's, pixel for pixel. Nothing
    stays open or mapped in the worker afterwards."""
    def noise_png(w: int, h: int, seed: int) -> bytes:
        out = io.BytesIO()
        Image.frombytes("RGB", (w, h), bytes((seed + i) % 251 for i in range(w * h * 3))).save(out, "PNG")
        return out.getvalue()

    frames = io.BytesIO()
    first, second = Image.new("RGB", (300, 200), (10, 20, 30)), Image.new("RGB", (200, 300), (200, 100, 0))
    first.save(frames, "TIFF", save_all=True, append_images=[second])
    # four 2048x2048 pages (12 MiB of pixels each) pass the child's 32 MiB reply size
    batch = [noise_png(2048, 2048, s) for s in range(4)] + [b"not an image", frames.getvalue(), png(3)]
    dec = IsolatedDecoder(limits.model_copy(update={"decode_processes": 1}))
    try:
        dec.decode_many([png(1)])  # the children's own descriptors are open from here on
        fds = len(os.listdir("/proc/self/fd"))
        out = dec.decode_many(batch)
        assert isinstance(out[4], BadImage)
        for data, got in zip(batch, out, strict=True):
            if isinstance(got, Exception):
                continue
            want = decode(data, limits)
            assert [(p.index, p.width, p.height, p.frame_count, p.image.mode) for p in got] == [
                (p.index, p.width, p.height, p.frame_count, p.image.mode) for p in want]
            assert [p.image.tobytes() for p in got] == [p.image.tobytes() for p in want]
        assert [p.width for p in out[5]] == [300, 200]  # type: ignore[union-attr]
        assert len(os.listdir("/proc/self/fd")) == fds
        with open("/proc/self/maps") as maps:
            assert "memfd:ocrq-blobs" not in maps.read()
    finally:
        dec.close()


def test_a_crash_inside_a_memory_file_batch_costs_only_its_image(limits: LimitSettings) -> None:
    """The memory-file path (a round trip of ≥ 1 MiB of files, replies of large pages) keeps the
    crash rule: the aborting file fails alone and the others come back from a fresh child."""
    def noise(seed: int) -> bytes:
        out = io.BytesIO()
        Image.frombytes("RGB", (1024, 1024), random.Random(seed).randbytes(1024 * 1024 * 3)).save(out, "PNG")
        return out.getvalue()

    batch = [noise(1), png(2, FAULT_ABORT), noise(3), noise(4)]
    assert sum(map(len, batch)) > memfd_pipe.INLINE_BYTES  # what makes this the memory-file path
    dec = IsolatedDecoder(limits.model_copy(update={"decode_processes": 1}))
    try:
        out = dec.decode_many(batch)
        assert isinstance(out[1], DecoderCrashed) and "SIGABRT" in str(out[1])
        for i in (0, 2, 3):
            assert [p.image.tobytes() for p in out[i]] == [p.image.tobytes() for p in decode(batch[i], limits)]  # type: ignore[union-attr]
        assert dec.crashes == 1
    finally:
        dec.close()


def _sixteen_bit_png(side: int) -> bytes:
    """A 16-bit gray PNG of side² pixels: a few hundred KB that decode to 2 bytes per pixel."""
    img = Image.new("I;16", (side, side))
    out = io.BytesIO()
    img.save(out, "PNG", compress_level=9)
    return out.getvalue()


def test_an_image_over_the_memory_limit_fails_too_large_and_its_child_is_replaced() -> None:
    """RLIMIT_AS of the child (limits.decode_memory_bytes): the allocation fails, the child answers
    TooLarge and leaves; the batch's next image is decoded by a fresh child."""
    dec = IsolatedDecoder(LimitSettings(decode_processes=1, decode_memory_bytes=160 << 20, decode_cpu_s=0))
    try:
        pid = dec._children[0].proc.pid
        big = _sixteen_bit_png(9000)  # 81 MP: 162 MB decoded as 16-bit, before anything else
        outcomes = dec.decode_many([png(1), big, png(2)])
        assert isinstance(outcomes[0], list) and isinstance(outcomes[2], list)
        assert isinstance(outcomes[1], TooLarge) and "decode_memory_bytes" in str(outcomes[1])
        assert dec.retired == 1 and dec.crashes == 0 and dec._children[0].proc.pid != pid
        assert isinstance(dec.decode(png(3)), list)
    finally:
        dec.close()
    # the same file without the limit decodes (the limit, not the file, refused it)
    free = IsolatedDecoder(LimitSettings(decode_processes=1, decode_memory_bytes=0))
    try:
        assert len(free.decode(big)) == 1
    finally:
        free.close()


def test_an_image_over_the_cpu_limit_fails_too_large_and_its_child_is_replaced() -> None:
    """RLIMIT_CPU of the child, moved on before each image (limits.decode_cpu_s): a decoder burning
    CPU is killed by SIGXCPU long before decode_timeout_s, permanent TooLarge."""
    dec = IsolatedDecoder(LimitSettings(decode_processes=1, decode_cpu_s=0.5, decode_timeout_s=30,
                                        decode_fault_markers=True))
    try:
        for _ in range(3):  # the limit is per image: earlier images' CPU does not count
            dec.decode(png(4))
        started = time.monotonic()
        outcomes = dec.decode_many([png(5), png(6, FAULT_SPIN), png(7)])
        assert time.monotonic() - started < 10
        assert isinstance(outcomes[1], TooLarge) and "decode_cpu_s" in str(outcomes[1])
        assert isinstance(outcomes[0], list) and isinstance(outcomes[2], list)
        assert dec.crashes == 1
    finally:
        dec.close()
