"""worker.loop.engine_loop: the engine loop against the simulated engine (real threads, real futures)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from ocrq.engine_settings import SimulatedSettings
from ocrq.errors import (
    BadImage,
    EngineCrashed,
    EngineOOM,
    EngineTimeout,
    OcrqError,
    TooLargeForDevice,
)
from ocrq.results import OcrOutput
from ocrq.settings import BatchSettings
from tests.fakes.fake_nvml import FakeNvml
from worker.context import governor_for
from worker.engines.base import ImageCost, OcrRequest
from worker.engines.simulated import OutOfMemoryError, SimulatedEngine
from worker.governor.governor import Governor
from worker.loop.engine_loop import EngineLoop, downscale_for_memory, is_oom
from worker.loop.pace import Pace
from worker.memory.nvml import NvmlProbe

WEIGHTS = 1_000_000
PER_TOKEN = 1_000


def sim(capacity_images: float = 1000, weight_bytes: int = WEIGHTS, **kw: object) -> SimulatedEngine:
    """Small numbers: 1 MB of weights, 1 kB per token, 256×256 images cost 74 tokens.
    ``capacity_images``: how many 256×256 images fit at once next to the weights."""
    return SimulatedEngine(
        capacity_bytes=int(weight_bytes + capacity_images * 74 * PER_TOKEN), weight_bytes=weight_bytes,
        bytes_per_token=PER_TOKEN, min_pixels=32 * 32, max_pixels=1024 * 1024, prompt_tokens=0,
        output_tokens=0, **kw,  # type: ignore[arg-type]
    )


def image(i: int, size: tuple[int, int] = (256, 256)) -> Image.Image:
    return Image.new("RGB", size, (i % 256, (i // 256) % 256, 99))


def req(i: int, size: tuple[int, int] = (256, 256)) -> OcrRequest:
    return OcrRequest(key=f"img-{i}", image=image(i, size))


@pytest.fixture()
def loops() -> Iterator[list[EngineLoop]]:
    made: list[EngineLoop] = []
    yield made
    for loop in made:
        loop.stop(timeout=2)


def start(
    made: list[EngineLoop], engine: SimulatedEngine, *, linger_s: float = 0.01, oom_retries: int = 3,
    probe: FakeNvml | None = None, **gov: object,
) -> EngineLoop:
    gov.setdefault("max_size", 64)
    governor = Governor(engine.memory_profile, capacity_bytes=engine.capacity_bytes, **gov)  # type: ignore[arg-type]
    loop = EngineLoop(engine, governor, probe, linger_s=linger_s, oom_retries=oom_retries, oom_backoff_s=0)
    made.append(loop)
    loop.start()
    return loop


def outcome(fut: Future[OcrOutput], timeout: float = 10) -> OcrOutput | OcrqError:
    try:
        return fut.result(timeout)
    except OcrqError as exc:
        return exc


# ---- is_oom -------------------------------------------------------------------------------------


class OutOfMemoryErrorLike(Exception):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        EngineOOM("x"),
        OutOfMemoryError("anything"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("HIP out of memory. Tried to allocate 20.00 MiB"),
        EngineCrashed("OutOfMemoryError: CUDA out of memory."),  # classify() of a torch OOM
    ],
)
def test_recognises_oom(exc: BaseException) -> None:
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: device-side assert triggered"),
        ValueError("index out of range"),
        MemoryError("host RAM"),
        OutOfMemoryErrorLike("similar name, no marker"),
        EngineCrashed("engine died"),
        EngineTimeout("no answer in 120 s"),
        BadImage("out of memory in the PNG decoder"),  # not a device OOM message
    ],
)
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert not is_oom(exc)


def test_recognises_oom_wrapped_as_a_cause() -> None:
    try:
        try:
            raise OutOfMemoryError("CUDA out of memory")
        except OutOfMemoryError as inner:
            raise EngineCrashed("generate failed") from inner
    except EngineCrashed as outer:
        assert is_oom(outer)


# ---- the happy path -----------------------------------------------------------------------------


def test_concurrent_submitters_get_every_result_in_shared_batches(loops: list[EngineLoop]) -> None:
    engine = sim()
    loop = start(loops, engine, linger_s=0.05, initial_size=64)
    futures: dict[int, Future[OcrOutput]] = {}
    lock = threading.Lock()

    def submitter(offset: int) -> None:
        for i in range(offset, offset + 15):
            fut = loop.submit(req(i))
            with lock:
                futures[i] = fut

    threads = [threading.Thread(target=submitter, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {i: outcome(f) for i, f in futures.items()}
    assert len(results) == 60
    assert all(isinstance(r, OcrOutput) for r in results.values())
    assert sorted(k for b in engine.batches for k in b) == sorted(f"img-{i}" for i in futures)
    assert max(len(b) for b in engine.batches) > 1  # they really were batched
    assert loop.state()["images"] == 60 and loop.state()["pending"] == 0


def test_a_per_image_error_fails_only_that_image(loops: list[EngineLoop]) -> None:
    engine = sim(bad_keys=["img-2"])
    loop = start(loops, engine)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(5)])]
    assert isinstance(results[2], BadImage)
    assert all(isinstance(r, OcrOutput) for i, r in enumerate(results) if i != 2)


def test_each_request_gets_its_own_result_alone_or_in_a_mixed_batch(loops: list[EngineLoop]) -> None:
    """Routing, not batch invariance: the simulated engine's text depends on its request only, so
    equal outputs here mean the loop handed image 7's result to image 7's future in a batch of 13
    (a real engine's batch invariance is tested on the engines themselves)."""
    engine = sim()
    loop = start(loops, engine, linger_s=0.2, initial_size=64)
    alone = outcome(loop.submit(req(7, (300, 200))))
    mixed = loop.submit_many([req(i, (64 + 32 * (i % 5), 256)) for i in range(12)] + [req(7, (300, 200))])
    together = outcome(mixed[-1])
    assert isinstance(alone, OcrOutput) and isinstance(together, OcrOutput)
    assert alone.text == together.text and alone.lines == together.lines
    assert len(engine.batches[0]) == 1 and len(engine.batches[-1]) == 13


def test_linger_collects_stragglers_but_a_full_batch_goes_at_once(loops: list[EngineLoop]) -> None:
    engine = sim()
    loop = start(loops, engine, linger_s=0.5, initial_size=4, max_size=4)
    first = loop.submit(req(1))
    time.sleep(0.05)
    second = loop.submit(req(2))
    outcome(first), outcome(second)
    assert engine.batches == [["img-1", "img-2"]]
    patient = sim()
    loop = start(loops, patient, linger_s=60, initial_size=4, max_size=4)
    full = loop.submit_many([req(i) for i in range(10, 14)])  # count limit 4: full, no linger
    assert all(isinstance(outcome(f, timeout=10), OcrOutput) for f in full)
    assert patient.batches == [[f"img-{i}" for i in range(10, 14)]]


def test_big_and_small_images_are_packed_by_cost(loops: list[EngineLoop]) -> None:
    # before calibration (20% margin) the budget admits ~1800 tokens: a 1024×1024 image (1058
    # tokens) and ten 256×256 ones (74 each), not two big ones
    engine = sim(capacity_images=37)
    loop = start(loops, engine, linger_s=0.2, initial_size=64)
    requests = [req(0, (1024, 1024)), req(1, (1024, 1024))] + [req(i) for i in range(2, 30)]
    results = [outcome(f) for f in loop.submit_many(requests)]
    assert all(isinstance(r, OcrOutput) for r in results)
    first = engine.batches[0]
    assert "img-0" in first and "img-1" not in first and len(first) > 2  # skipped, filled with small
    assert max(engine.peaks) <= engine.capacity_bytes


# ---- failures -----------------------------------------------------------------------------------


def test_a_crash_is_not_mistaken_for_oom(loops: list[EngineLoop]) -> None:
    engine = sim(crashes=1)
    loop = start(loops, engine, linger_s=0.2, initial_size=8)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(6)])]
    assert all(isinstance(r, EngineCrashed) and r.retryable for r in results)
    assert len(engine.batches) == 1  # not bisected
    assert loop.state()["oom_count"] == 0 and loop.state()["engine_errors"] == 1
    assert isinstance(outcome(loop.submit(req(9))), OcrOutput)  # the loop lives on


@pytest.mark.parametrize("raw", [False, True])
def test_oom_bisects_and_every_image_succeeds(loops: list[EngineLoop], raw: bool) -> None:
    # the prior is 10x too optimistic: the governor's first batch of 16 cannot fit (10 do)
    engine = sim(capacity_images=10, prior_scale=0.1, raw_oom=raw)
    loop = start(loops, engine, linger_s=0.3, initial_size=16)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(16)])]
    assert all(isinstance(r, OcrOutput) for r in results)
    assert [len(b) for b in engine.batches[:3]] == [16, 8, 8]
    state = loop.state()
    assert state["oom_count"] == 1 and state["count_limit"] <= 8
    assert max(engine.peaks) <= engine.capacity_bytes


def test_oom_past_the_retry_levels_hands_images_back_retryable(loops: list[EngineLoop]) -> None:
    # one image fits, two do not; the prior believes all eight do
    engine = sim(capacity_images=1.5, weight_bytes=10_000, prior_scale=0.01)
    loop = start(loops, engine, linger_s=0.3, initial_size=8, oom_retries=1)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(8)])]
    assert [len(b) for b in engine.batches] == [8, 4, 4]
    assert all(isinstance(r, EngineOOM) and r.retryable for r in results)


def test_a_lone_image_too_large_even_downscaled_fails_permanently(loops: list[EngineLoop]) -> None:
    engine = sim(capacity_images=1)  # a 1024×768 image (794 tokens) cannot fit, nor 512×384 (206)
    loop = start(loops, engine)
    result = outcome(loop.submit(req(1, (1024, 768))))
    assert isinstance(result, TooLargeForDevice) and not result.retryable
    assert engine.batches == [["img-1"], ["img-1"]]  # full size, then one downscaled retry
    assert loop.state()["too_large"] == 1


def test_a_lone_image_that_fits_at_half_size_runs_downscaled(loops: list[EngineLoop]) -> None:
    engine = sim(capacity_images=8)  # 592 tokens of room: 1024×768 needs 794, 512×384 206
    loop = start(loops, engine)
    result = outcome(loop.submit(req(1, (1024, 768))))
    assert isinstance(result, OcrOutput)
    info = result.meta["downscaled_for_memory"]
    assert info == {"from": [1024, 768], "to": [512, 384]}
    assert (result.width, result.height) == (1024, 768)
    # boxes are mapped back to the original image's pixels
    assert max(p[0] for p in result.lines[0].box or []) == pytest.approx(1024)
    assert loop.state()["downscaled"] == 1


def test_a_lone_image_survives_a_transient_oom_at_full_size(loops: list[EngineLoop]) -> None:
    engine = sim(transient_ooms=1)
    loop = start(loops, engine)
    result = outcome(loop.submit(req(1, (1024, 768))))
    assert isinstance(result, OcrOutput) and "downscaled_for_memory" not in result.meta
    assert engine.batches == [["img-1"], ["img-1"]]


def test_a_lone_image_that_should_fit_but_keeps_failing_is_retried_later(loops: list[EngineLoop]) -> None:
    # full size, full size again, downscaled: all OOM, yet the model says it fits: the device is
    # short right now, so Celery should retry it later rather than fail it for good
    engine = sim(transient_ooms=3)
    loop = start(loops, engine)
    result = outcome(loop.submit(req(1, (1024, 768))))
    assert isinstance(result, EngineOOM) and result.retryable
    assert len(engine.batches) == 3
    assert isinstance(outcome(loop.submit(req(2))), OcrOutput)


def test_downscale_targets_tokens_not_raw_pixels() -> None:
    engine = sim()
    big = OcrRequest("k", Image.new("RGB", (4000, 3000)))  # above the 1024² cap: the model shrinks it
    small = downscale_for_memory(big, engine.cost)
    assert small is not None
    assert engine.cost(small).vision_tokens <= engine.cost(big).vision_tokens / 2
    w, h = small.image.size
    assert abs(w / h - 4 / 3) < 0.02 and small.key == "k"
    floor = OcrRequest("k", Image.new("RGB", (32, 32)))  # at the model's minimum already
    assert downscale_for_memory(floor, engine.cost) is None


def test_transient_ooms_are_absorbed(loops: list[EngineLoop]) -> None:
    engine = sim(transient_ooms=2)
    loop = start(loops, engine, linger_s=0.2, initial_size=16)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(12)])]
    assert all(isinstance(r, OcrOutput) for r in results)
    assert loop.state()["oom_events"] == 2


class FakeMiscountingEngine(SimulatedEngine):
    """Returns one outcome too few: a broken engine the loop must not trust."""

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        return super().infer(batch)[:-1]


class FakeUnpriceableEngine(SimulatedEngine):
    """cost() fails for one image (e.g. an engine-side validation)."""

    def cost(self, request: OcrRequest) -> ImageCost:
        if request.key == "img-1":
            raise ValueError("cannot price this image")
        return super().cost(request)


def test_a_wrong_number_of_outcomes_fails_the_batch(loops: list[EngineLoop]) -> None:
    engine = FakeMiscountingEngine(capacity_bytes=10**9, weight_bytes=WEIGHTS, bytes_per_token=PER_TOKEN)
    loop = start(loops, engine, linger_s=0.2)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(3)])]
    assert all(isinstance(r, EngineCrashed) for r in results)


def test_a_cost_failure_fails_only_that_image(loops: list[EngineLoop]) -> None:
    engine = FakeUnpriceableEngine(capacity_bytes=10**9, weight_bytes=WEIGHTS, bytes_per_token=PER_TOKEN)
    loop = start(loops, engine)
    results = [outcome(f) for f in loop.submit_many([req(i) for i in range(3)])]
    assert isinstance(results[1], EngineCrashed) and "cannot price" in str(results[1])
    assert isinstance(results[0], OcrOutput) and isinstance(results[2], OcrOutput)


# ---- governor feedback --------------------------------------------------------------------------


def test_vllm_like_pressure_shrinks_the_batch(loops: list[EngineLoop]) -> None:
    # paged: never OOMs; over capacity it preempts, and the KV cache reads full
    engine = sim(capacity_images=6, paged=True, prior_scale=0.01)
    loop = start(loops, engine, linger_s=0.01, initial_size=32)
    for round_ in range(4):
        [outcome(f) for f in loop.submit_many([req(100 * round_ + i) for i in range(32)])]
    state = loop.state()
    assert state["pressure_count"] >= 1
    assert len(engine.batches[-1]) < 32


def test_other_processes_on_the_device_shrink_batches(loops: list[EngineLoop]) -> None:
    engine = sim(capacity_images=40)
    capacity = engine.capacity_bytes
    probe = FakeNvml(total=capacity, used=WEIGHTS + 30 * 74 * PER_TOKEN)  # a neighbour holds 30 images' worth
    loop = start(loops, engine, linger_s=0.3, probe=probe, initial_size=64, headroom=0.0)
    [outcome(f) for f in loop.submit_many([req(i) for i in range(40)])]
    assert probe.reads >= 1
    assert len(engine.batches[0]) <= 10


def test_the_worker_wiring_runs_the_simulated_engine(loops: list[EngineLoop]) -> None:
    # what worker.context builds: settings → engine → governor from the engine and the probe
    extra = {"capacity_bytes": 8e9, "transient_ooms": 1}
    engine = SimulatedEngine.from_settings(SimulatedSettings(kind="simulated", max_new_tokens=64, extra=extra))
    governor = governor_for(BatchSettings(mode="auto"), engine, NvmlProbe.for_current_device({}))
    assert governor.capacity == 8 * 10**9 and engine.output_tokens == 64
    loop = EngineLoop(engine, governor, None, linger_s=0.05, oom_retries=3, oom_backoff_s=0)
    loops.append(loop)
    loop.start()
    results = [outcome(f) for f in loop.submit_many([req(i, (1024, 768)) for i in range(6)])]
    assert all(isinstance(r, OcrOutput) for r in results)
    assert loop.desired_backlog() >= 2


def test_the_backlog_counts_the_batch_in_flight_on_top_of_the_next_ones(loops: list[EngineLoop]) -> None:
    # a chunk's message is acked when all its images are done: while a batch runs, its images hold
    # window too, so the worker asks for them plus the governor's backlog of batches to come
    engine = sim(batch_latency_s=0.5)
    loop = start(loops, engine, linger_s=0.0, initial_size=8, max_size=8)
    idle = loop.desired_backlog()
    assert idle == loop.governor.desired_backlog()
    futures = loop.submit_many([req(i) for i in range(8)])
    deadline = time.monotonic() + 5
    while loop.state()["inflight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.state()["inflight"] == 8
    assert loop.desired_backlog() == 8 + loop.governor.desired_backlog()
    [outcome(f) for f in futures]
    while loop.state()["inflight"] and time.monotonic() < deadline:  # cleared just after the results
        time.sleep(0.01)
    assert loop.desired_backlog() == loop.governor.desired_backlog()


def test_a_fast_engine_asks_for_what_its_intake_takes_to_keep_it_busy(loops: list[EngineLoop]) -> None:
    # Given an engine that reads 8 images in 10 ms (800 a second) behind an intake of ~50 ms a chunk
    engine = sim(batch_latency_s=0.01)
    loop = start(loops, engine, linger_s=0.0, initial_size=8, max_size=8)
    assert loop.desired_backlog() == loop.governor.desired_backlog()  # nothing measured yet
    for _ in range(3):
        with loop.expecting(8):
            time.sleep(0.05)
            futures = loop.submit_many([req(i) for i in range(8)])
        [outcome(f) for f in futures]
    # Then it holds rate × intake (Little's law: ~40 images) rather than the governor's 2 batches
    pace = loop.state()
    assert 0.04 <= pace["intake_s"] < 0.5 and 100 < pace["engine_img_s"] <= 800
    # backlog() is the ceiling of the exact product (< 1 above it); state() rounds rate to 0.1 and
    # intake to 1e-4, which moves the product by up to 0.05 × intake + rate × 5e-5 (0.04 at 800/s)
    held = loop.pace.backlog()
    slack = 1 + 0.05 * pace["intake_s"] + pace["engine_img_s"] * 5e-5
    assert loop.desired_backlog() >= held > 16 and abs(held - pace["engine_img_s"] * pace["intake_s"]) <= slack


def test_a_slow_engine_keeps_the_governors_backlog() -> None:
    # Little's law gives less than two batches when the engine is slow: the governor decides
    pace = Pace()
    pace.batch(4, 2.0)  # 2 images a second
    pace.intake(0.2)
    assert pace.backlog() == 1


# ---- intake: images the worker holds but is still decoding -------------------------------------


def intake_loop(made: list[EngineLoop], engine: SimulatedEngine, intake_wait_s: float) -> EngineLoop:
    governor = Governor(engine.memory_profile, capacity_bytes=engine.capacity_bytes, initial_size=64, max_size=64)
    loop = EngineLoop(engine, governor, None, linger_s=0.01, intake_wait_s=intake_wait_s, oom_backoff_s=0)
    made.append(loop)
    loop.start()
    return loop


def test_an_idle_engine_waits_for_the_chunks_still_being_decoded(loops: list[EngineLoop]) -> None:
    # Given a worker that received two chunks of 8: the first is decoded, the second is not yet
    engine = sim()
    loop = intake_loop(loops, engine, intake_wait_s=5.0)
    second = loop.expecting(8)
    with loop.expecting(8):
        first = loop.submit_many([req(i) for i in range(8)])
    time.sleep(0.3)  # decoding the second chunk: far past the 10 ms linger
    # Then the engine has not run the first chunk alone
    assert engine.batches == [] and loop.state()["incoming"] == 8
    # When the second chunk arrives, one batch runs both (the old loop ran 8, then 8)
    rest = loop.submit_many([req(i) for i in range(8, 16)])
    second.close()
    assert all(isinstance(outcome(f), OcrOutput) for f in first + rest)
    assert [len(b) for b in engine.batches] == [16]
    assert loop.state()["incoming"] == 0


def test_a_padded_engine_waits_for_pages_like_its_batch_while_others_are_left_behind(
    loops: list[EngineLoop],
) -> None:
    # Given a padded engine (a batch costs n x its longest page) with room for ~30 small pages,
    # and a worker holding two chunks: the first decoded (8 small pages, then 1 large one that
    # does not fit beside them), the second (8 small pages) still decoding
    engine = sim(capacity_images=40, padded=True)
    loop = intake_loop(loops, engine, intake_wait_s=5.0)
    second = loop.expecting(8)
    with loop.expecting(9):
        first = loop.submit_many([req(i) for i in range(8)] + [req(8, (512, 512))])
    time.sleep(0.3)
    # Then leaving the large page behind does not make the plan final while small pages are coming
    assert engine.batches == []
    # When they arrive: one batch of the 16 small pages, then the large one (the old loop ran
    # 8 at once because the plan left the large page behind, then 8, then 1)
    rest = loop.submit_many([req(i) for i in range(9, 17)])
    second.close()
    assert all(isinstance(outcome(f), OcrOutput) for f in first + rest)
    assert [len(b) for b in engine.batches] == [16, 1]


def test_the_wait_for_intake_is_bounded_and_a_full_batch_does_not_wait(loops: list[EngineLoop]) -> None:
    # Given a chunk announced that never arrives (its fetch hangs)
    engine = sim()
    loop = intake_loop(loops, engine, intake_wait_s=0.3)
    stuck = loop.expecting(32)
    # Then what is there runs once the intake wait is over, not never
    t0 = time.monotonic()
    assert all(isinstance(outcome(f), OcrOutput) for f in loop.submit_many([req(i) for i in range(4)]))
    assert 0.25 <= time.monotonic() - t0 < 3
    # and a batch already as big as it may get (the count limit, 64) goes at once
    t0 = time.monotonic()
    assert all(isinstance(outcome(f), OcrOutput) for f in loop.submit_many([req(i) for i in range(4, 68)]))
    assert time.monotonic() - t0 < 0.25
    assert [len(b) for b in engine.batches][1] == 64
    stuck.close()
    stuck.close()  # closing twice withdraws once
    assert loop.state()["incoming"] == 0


def test_the_engine_idle_time_between_batches_is_measured(loops: list[EngineLoop]) -> None:
    engine = sim(batch_latency_s=0.05)
    loop = intake_loop(loops, engine, intake_wait_s=0.0)
    assert all(isinstance(outcome(f), OcrOutput) for f in loop.submit_many([req(0)]))
    time.sleep(0.3)
    assert all(isinstance(outcome(f), OcrOutput) for f in loop.submit_many([req(1)]))
    assert 0.25 <= loop.state()["idle_s"] < 2


# ---- stop and no lost futures -------------------------------------------------------------------


def test_stop_completes_every_future(loops: list[EngineLoop]) -> None:
    engine = sim(batch_latency_s=0.2)
    loop = start(loops, engine, linger_s=0.0, initial_size=2, max_size=2)
    futures = loop.submit_many([req(i) for i in range(10)])
    time.sleep(0.05)
    loop.stop(timeout=0.1)
    results = [outcome(f, timeout=0) for f in futures]
    assert all(isinstance(r, OcrOutput | EngineCrashed) for r in results)
    assert any(isinstance(r, EngineCrashed) for r in results)
    late = outcome(loop.submit(req(99)), timeout=0)
    assert isinstance(late, EngineCrashed) and late.retryable


def test_a_cancelled_future_never_reaches_the_engine(loops: list[EngineLoop]) -> None:
    engine = sim()
    governor = Governor(engine.memory_profile, capacity_bytes=engine.capacity_bytes)
    loop = EngineLoop(engine, governor, None, linger_s=0.01, oom_retries=3)
    loops.append(loop)
    futures = loop.submit_many([req(i) for i in range(3)])
    assert futures[1].cancel()
    loop.start()
    assert isinstance(outcome(futures[0]), OcrOutput) and isinstance(outcome(futures[2]), OcrOutput)
    assert "img-1" not in [k for b in engine.batches for k in b]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.sampled_from([(64, 64), (256, 256), (512, 384), (1024, 768), (2000, 1500)]),
                   min_size=1, max_size=40),
    capacity_images=st.floats(2.0, 60.0),
    transient=st.integers(0, 3),
    crashes=st.integers(0, 1),
    prior_scale=st.floats(0.05, 3.0),
)
def test_no_future_is_ever_lost(
    sizes: list[tuple[int, int]], capacity_images: float, transient: int, crashes: int, prior_scale: float
) -> None:
    engine = sim(capacity_images, transient_ooms=transient, crashes=crashes, prior_scale=prior_scale,
                 bad_keys=["img-3"])
    made: list[EngineLoop] = []
    loop = start(made, engine, linger_s=0.005, initial_size=16)
    futures: dict[int, Future[OcrOutput]] = {}
    lock = threading.Lock()

    def submitter(part: list[tuple[int, tuple[int, int]]]) -> None:
        for i, size in part:
            fut = loop.submit(req(i, size))
            with lock:
                futures[i] = fut

    indexed = list(enumerate(sizes))
    threads = [threading.Thread(target=submitter, args=(indexed[k::3],)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        results = {i: outcome(f, timeout=20) for i, f in futures.items()}
    finally:
        loop.stop(timeout=1)
    assert len(results) == len(sizes)
    reference = sim()  # roomy: every image alone, full size
    for i, size in indexed:
        result = results[i]
        assert isinstance(result, OcrOutput | OcrqError)
        if i == 3:
            assert not isinstance(result, OcrOutput)
        elif isinstance(result, OcrOutput) and "downscaled_for_memory" not in result.meta:
            # an image's text never depends on the batch it ran in
            alone = reference.infer([req(i, size)])[0]
            assert isinstance(alone, OcrOutput) and result.text == alone.text


class FakePagedEngine:
    """Fake (unit tests only): a continuous-batching engine whose batches block until released;
    it records how many run at once."""

    name = "fake-paged"
    revision = "fake"
    concurrent_batches = 3

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running = 0
        self.most = 0
        self.sizes: list[int] = []
        self.keys: list[list[str]] = []
        self._lock = threading.Lock()

    def cost(self, request: OcrRequest) -> ImageCost:
        return ImageCost(vision_tokens=900, prompt_tokens=0, output_tokens=100)

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.sizes.append(len(batch))
            self.keys.append([r.key for r in batch])
        self.release.wait(10)
        with self._lock:
            self.running -= 1
        return [OcrOutput(text=r.key, lines=[], engine=self.name, model="fake", width=1, height=1)
                for r in batch]

    def start(self) -> None: ...
    def close(self) -> None: ...
    def reset_peak(self) -> None: ...

    def memory(self):  # type: ignore[no-untyped-def]
        from worker.engines.base import MemorySample

        return MemorySample(kv_usage=0.1, waiting=0, preemptions=0)


def bulk_then_urgent(
    loops: list[EngineLoop], engine: FakePagedEngine
) -> tuple[EngineLoop, list[Future[OcrOutput]], list[Future[OcrOutput]], float]:
    """A paged loop (12 images over the engine's 3 slots) running 30 bulk images (priority 9) in
    its 3 slots, then 2 urgent ones submitted (priority 0). Returns the loop, both futures lists
    and a deadline 5 s out."""
    from worker.memory.costs import ModelProfile

    gov = Governor(ModelProfile("fake", 0, 1, 1.0), capacity_bytes=None, max_size=12, token_capacity=10**6)
    loop = EngineLoop(engine, gov, linger_s=0.0)  # type: ignore[arg-type]
    loops.append(loop)
    loop.start()
    bulk = loop.submit_many([OcrRequest(key=f"bulk-{i}", image=image(i), priority=9) for i in range(30)])
    deadline = time.monotonic() + 5
    while engine.running < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    urgent = loop.submit_many([OcrRequest(key=f"urgent-{i}", image=image(i), priority=0) for i in range(2)])
    return loop, bulk, urgent, deadline


def test_a_continuous_engine_gets_several_batches_within_its_kv_room(loops: list[EngineLoop]) -> None:
    """Batches overlap up to the engine's slots, share the count limit (12 over 3 slots: 4 a
    batch), and together never plan more tokens than the KV room: 90 % of 11,112 KV tokens =
    10,000 tokens = 10 images of 1,000 tokens in flight."""
    from worker.memory.costs import ModelProfile

    engine = FakePagedEngine()
    gov = Governor(ModelProfile("fake", 0, 1, 1.0), capacity_bytes=None, max_size=12, token_capacity=11_112)
    loop = EngineLoop(engine, gov, linger_s=0.0)  # type: ignore[arg-type]
    loops.append(loop)
    loop.start()
    futures = loop.submit_many([req(i) for i in range(20)])
    deadline = time.monotonic() + 5
    while sum(engine.sizes) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert engine.most == 3 and engine.sizes == [4, 4, 2]  # the room, not the slots, binds the third
    engine.release.set()
    assert all(f.result(timeout=10).text == f"img-{i}" for i, f in enumerate(futures))
    shares = loop.state()
    assert shares["batches"] >= 5 and shares["inflight"] == 0


def test_a_more_urgent_image_runs_before_older_bulk_ones(loops: list[EngineLoop]) -> None:
    """A small urgent job behind a bulk one the worker already holds: its images go into the next
    batch, ahead of the older bulk images (arrival order within a priority)."""
    from worker.memory.costs import ModelProfile

    engine = FakePagedEngine()
    engine.concurrent_batches = 1
    gov = Governor(ModelProfile("fake", 0, 1, 1.0), capacity_bytes=None, max_size=4, mode="fixed", size=4)
    loop = EngineLoop(engine, gov, linger_s=0.0)  # type: ignore[arg-type]
    loops.append(loop)
    loop.start()
    bulk = loop.submit_many([OcrRequest(key=f"bulk-{i}", image=image(i), priority=9) for i in range(12)])
    deadline = time.monotonic() + 5
    while not engine.sizes and time.monotonic() < deadline:
        time.sleep(0.01)
    urgent = loop.submit_many([OcrRequest(key=f"urgent-{i}", image=image(i), priority=0) for i in range(2)])
    engine.release.set()
    assert [f.result(timeout=10).text for f in urgent] == ["urgent-0", "urgent-1"]
    [f.result(timeout=10) for f in bulk]
    assert engine.keys[1][:2] == ["urgent-0", "urgent-1"]  # the batch after the running one
    assert engine.keys[1][2:] == ["bulk-4", "bulk-5"] and engine.keys[2] == [f"bulk-{i}" for i in range(6, 10)]


def test_an_urgent_job_gets_one_more_slot_beside_the_bulk_batches(loops: list[EngineLoop]) -> None:
    """A paged engine running its 3 slots of bulk batches: an urgent job starts a 4th batch at
    once instead of waiting for a bulk batch to finish (with vLLM's priority scheduling it is then
    scheduled first); a second urgent job gets no 5th."""
    engine = FakePagedEngine()  # 3 slots; batches block until `release`
    loop, bulk, urgent, deadline = bulk_then_urgent(loops, engine)
    while engine.running < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 4 and engine.keys[3] == ["urgent-0", "urgent-1"]
    more = loop.submit_many([OcrRequest(key="urgent-2", image=image(2), priority=0)])
    time.sleep(0.2)
    assert engine.running == 4  # one extra slot, not one per urgent job
    engine.release.set()
    [f.result(timeout=10) for f in bulk + urgent + more]


class GatedPagedEngine(FakePagedEngine):
    """Fake (unit tests only): bulk and urgent batches are released separately."""

    def __init__(self) -> None:
        super().__init__()
        self.release_urgent = threading.Event()

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        if batch and batch[0].priority == 0:
            with self._lock:
                self.keys.append([r.key for r in batch])
                self.running += 1
            self.release_urgent.wait(10)
            with self._lock:
                self.running -= 1
            return [OcrOutput(text=r.key, lines=[], engine=self.name, model="fake", width=1, height=1)
                    for r in batch]
        return super().infer(batch)


def test_bulk_batches_wait_while_an_urgent_batch_runs(loops: list[EngineLoop]) -> None:
    """Once the urgent batch runs, bulk batches that finish are not replaced until it is done:
    new bulk prefills would slow every step the urgent images decode in."""
    engine = GatedPagedEngine()
    loop, bulk, urgent, deadline = bulk_then_urgent(loops, engine)
    while len(engine.keys) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.release.set()  # the three bulk batches finish; 18 bulk images wait
    time.sleep(0.3)
    assert len(engine.keys) == 4 and engine.running == 1  # only the urgent batch runs
    assert not any(f.done() for f in bulk[12:])
    engine.release_urgent.set()
    assert [f.result(timeout=10).text for f in urgent] == ["urgent-0", "urgent-1"]
    assert [f.result(timeout=10).text for f in bulk] == [f"bulk-{i}" for i in range(30)]
