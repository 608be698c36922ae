"""worker.governor.governor: packing by cost, calibration against a simulated memory model, AIMD."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ocrq.settings import BatchSettings
from tests.fakes.fake_nvml import FakeNvml
from worker.context import governor_for
from worker.engines.base import ImageCost
from worker.engines.simulated import SimulatedEngine
from worker.governor.governor import Governor, batch_tokens
from worker.memory.costs import ModelProfile, resolve_capacity

GB = 10**9
# a round-number model: 2 GB of weights, 100 kB per token
PROFILE = ModelProfile("test", weight_bytes=2 * GB, kv_bytes_per_token=80_000, act_bytes_per_token=20_000.0)


def c(tokens: int) -> ImageCost:
    return ImageCost(vision_tokens=tokens, prompt_tokens=0, output_tokens=0)


def governor(capacity: int = 12 * GB, **kw: object) -> Governor:
    return Governor(PROFILE, capacity_bytes=capacity, **kw)  # type: ignore[arg-type]


def calibrated(gov: Governor, per_token: float = 100_000.0, rounds: int = 6) -> Governor:
    """Feed exact measurements so the margin drops to its floor."""
    for n in range(rounds):
        costs = [c(1000)] * (4 + 3 * n)
        gov.observe(costs, int(2 * GB + per_token * batch_tokens(costs, False)))
    return gov


@dataclass
class Run:
    sizes: list[int] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    ooms: list[int] = field(default_factory=list)
    errors: list[float | None] = field(default_factory=list)


def drive(
    gov: Governor,
    true_peak: Callable[[list[ImageCost]], float],
    capacity: float,
    next_image: Callable[[], ImageCost],
    batches: int,
    noise: float = 0.0,
    seed: int = 0,
) -> Run:
    """The engine loop's protocol without threads: plan, 'run' on the true model, feed back."""
    rng = random.Random(seed)
    pending = [next_image() for _ in range(4 * 256)]
    run = Run()
    for b in range(batches):
        chosen = gov.plan(pending)
        costs = [pending[i] for i in chosen]
        taken = set(chosen)
        pending = [x for i, x in enumerate(pending) if i not in taken] + [next_image() for _ in chosen]
        peak = true_peak(costs) * (1.0 + noise * (2.0 * rng.random() - 1.0))
        run.sizes.append(len(costs))
        if peak > capacity:
            run.ooms.append(b)
            gov.on_oom(costs)
            run.peaks.append(float("nan"))
        else:
            gov.observe(costs, int(peak))
            gov.on_success()
            run.peaks.append(peak)
        run.errors.append(gov.state()["calibration_error"])
    return run


# ---- prediction and packing ----------------------------------------------------------------------


def test_predict_starts_from_the_profile() -> None:
    gov = governor()
    assert gov.predict([c(1000), c(3000)]) == 2 * GB + 100_000 * 4000
    assert gov.state()["budget_bytes"] == int(12 * GB * 0.9)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 40_000), min_size=1, max_size=300),
    capacity_gb=st.integers(3, 40),
    max_size=st.integers(1, 64),
    padded=st.booleans(),
)
def test_plan_stays_within_budget_and_cap(
    tokens: list[int], capacity_gb: int, max_size: int, padded: bool
) -> None:
    profile = ModelProfile("p", 2 * GB, 80_000, 20_000.0, overhead_bytes=GB // 2, padded=padded)
    gov = Governor(profile, capacity_bytes=capacity_gb * GB, max_size=max_size, initial_size=max_size)
    pending = [c(t) for t in tokens]
    chosen = gov.plan(pending)
    assert chosen == sorted(set(chosen)) and chosen[0] == 0  # the oldest image always goes
    assert 1 <= len(chosen) <= min(max_size, len(pending))
    if len(chosen) > 1:  # a lone oversized head is the engine loop's to downscale, not a packing error
        peak = gov.predict([pending[i] for i in chosen]) * (1 + gov.state()["margin"]) + GB // 2
        assert peak <= _budget(gov)


def test_packs_by_cost_not_count() -> None:
    gov = calibrated(governor(capacity=10 * GB, max_size=128, initial_size=128))
    # budget 9 GB, 2 GB weights, margin 2%: room for ~68,600 tokens
    big, small = c(40_000), c(2_000)
    chosen = gov.plan([small, big, big, small, small, small])
    # the second big one does not fit next to the first: small ones fill instead
    assert chosen == [0, 1, 3, 4, 5]
    # one 2048×1536 page weighs about four 1024×768 ones
    n_small = len(gov.plan([c(794)] * 200))
    n_big = len(gov.plan([c(3122)] * 200))
    assert n_big == 21 and n_small == 85  # 68,235 tokens of room


def test_a_skipped_image_is_taken_after_max_skips() -> None:
    gov = calibrated(governor(capacity=10 * GB, max_size=64, initial_size=64, max_skips=3))
    pending = [c(30_000), c(20_000), c(40_000)] + [c(1_000)] * 30
    assert gov.plan(pending, skips=[0, 0, 2] + [0] * 30) == [0, 1] + list(range(3, 21))
    # skipped three times: it goes first, even before the oldest, which no longer fits
    chosen = gov.plan(pending, skips=[0, 0, 3] + [0] * 30)
    assert chosen == [1, 2] + list(range(3, 11))


def test_fixed_mode_takes_size_in_arrival_order() -> None:
    gov = governor(mode="fixed", size=4)
    assert gov.plan([c(90_000)] * 3 + [c(1)] * 10) == [0, 1, 2, 3]
    assert gov.plan([c(1)] * 2) == [0, 1]


def test_without_a_capacity_it_plans_by_count() -> None:
    gov = Governor(ModelProfile.cpu_default(), capacity_bytes=None, max_size=16, initial_size=16)
    assert gov.plan([c(10**9)] * 40) == list(range(16))
    assert gov.state()["budget_bytes"] is None


def test_other_processes_on_the_device_shrink_the_batch() -> None:
    gov = calibrated(governor(capacity=20 * GB, max_size=256, initial_size=256))
    pending = [c(1000)] * 256
    alone = len(gov.plan(pending, free_bytes=20 * GB - 2 * GB))
    shared = len(gov.plan(pending, free_bytes=20 * GB - 2 * GB - 8 * GB))
    assert alone >= 150 and shared <= alone - 75  # 8 GB taken: ~80 fewer 100 MB images


def test_overhead_counts_against_the_budget() -> None:
    lean = calibrated(governor(capacity=20 * GB, max_size=256, initial_size=256))
    heavy = Governor(
        ModelProfile("p", 2 * GB, 80_000, 20_000.0, overhead_bytes=4 * GB),
        capacity_bytes=20 * GB, max_size=256, initial_size=256,
    )
    calibrated(heavy)
    pending = [c(1000)] * 256
    assert len(heavy.plan(pending)) <= len(lean.plan(pending)) - 35


# ---- calibration -------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    prior_scale=st.floats(0.5, 2.0),
    hidden_fixed_gb=st.floats(0.0, 2.0),
    noise=st.sampled_from([0.0, 0.03, 0.05]),
    padded=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_calibration_converges_and_never_exceeds_the_budget(
    prior_scale: float, hidden_fixed_gb: float, noise: float, padded: bool, seed: int
) -> None:
    # the engine's true coefficient and fixed bytes differ from the prior the governor starts from
    engine = SimulatedEngine(
        capacity_bytes=24 * 2**30, prior_scale=prior_scale, fixed_bytes=int(hidden_fixed_gb * GB),
        padded=padded,
    )
    gov = Governor(engine.memory_profile, capacity_bytes=engine.capacity_bytes, max_size=256)
    rng = random.Random(seed)
    sizes = [(1024, 768), (2048, 1536), (640, 480), (1240, 1754)]

    def next_image() -> ImageCost:
        w, h = rng.choice(sizes)
        return ImageCost(_tokens(w, h), engine.prompt_tokens, engine.output_tokens)

    run = drive(gov, engine.true_peak, engine.capacity_bytes, next_image, 30, noise, seed)
    settled = run.peaks[10:]
    budget = _budget(gov)
    assert not run.ooms or max(run.ooms) < 10
    # exact peaks: never over budget. Random ±noise on every peak can beat any finite margin now
    # and then (1 run in 1000 of this sweep, by 0.02%): bounded at 1%, far inside the headroom
    assert max(settled) <= (budget if noise == 0 else budget * 1.01)
    # prediction error (measured before each batch ran) after 20 batches
    error = run.errors[19]
    assert error is not None and error <= 0.10
    # mixed workload: most of the budget is used. ±5 % noise on every peak costs the margin that
    # keeps it under budget: 600 seeds at prior 1.0 used at least 0.955 / 0.856 / 0.792 of it at
    # noise 0 / 0.03 / 0.05 (one run of the 600 under 0.80, found by this test)
    assert sum(settled) / len(settled) >= (0.80 if noise < 0.05 else 0.75) * budget


def _budget(gov: Governor) -> int:
    assert gov.budget is not None
    return gov.budget


def _tokens(w: int, h: int) -> int:
    from worker.memory.costs import hunyuan_vision_tokens

    return hunyuan_vision_tokens(w, h)


@settings(max_examples=20, deadline=None)
@given(prior_scale=st.floats(0.5, 2.0), noise=st.sampled_from([0.0, 0.05]), capacity_gb=st.integers(8, 40))
def test_uniform_workload_converges_near_the_best_feasible_batch(
    prior_scale: float, noise: float, capacity_gb: int
) -> None:
    engine = SimulatedEngine(capacity_bytes=capacity_gb * GB, prior_scale=prior_scale)
    gov = Governor(engine.memory_profile, capacity_bytes=engine.capacity_bytes, max_size=512)
    image = ImageCost(vision_tokens=794, prompt_tokens=16, output_tokens=256)
    budget = _budget(gov)
    best = int((budget - engine.weight_bytes) // (engine.bytes_per_token * image.total_tokens))
    assert engine.true_peak([image] * best) <= budget < engine.true_peak([image] * (best + 1))
    run = drive(gov, engine.true_peak, engine.capacity_bytes, lambda: image, 25, noise)
    tail = run.sizes[15:]
    if noise == 0:  # within 5% of the largest batch that fits (measured: 97-98%)
        assert min(tail) >= 0.95 * best
    else:
        # ±5% on every peak widens the margin to ~10-15% (it covers the whole peak, weights
        # included); in a 400-run sweep the tail's mean was >= 0.82 of best, its minimum >= 0.79
        assert sum(tail) / len(tail) >= 0.80 * best and min(tail) >= 0.75 * best
    assert max(run.peaks[10:]) <= (budget if noise == 0 else budget * 1.01)


def test_a_low_glitch_peak_does_not_double_the_batch() -> None:
    gov = calibrated(governor(capacity=20 * GB, max_size=512, initial_size=512))
    pending = [c(1000)] * 512
    before = len(gov.plan(pending))
    for _ in range(3):
        gov.observe([c(1000)] * 50, 1000)  # a lost peak counter reads nearly nothing
    assert len(gov.plan(pending)) == before
    assert gov.state()["rejected_peaks"] == 3


# ---- AIMD and pressure ---------------------------------------------------------------------------


def test_oom_halves_the_limit_and_raises_the_prediction() -> None:
    gov = governor(capacity=100 * GB, max_size=128, initial_size=64)
    batch = [c(1000)] * 40
    before = gov.predict(batch)
    gov.on_oom(batch)
    assert gov.count_limit() == 20
    assert gov.predict(batch) > before
    assert gov.state()["oom_count"] == 1


def test_a_lone_oversized_image_does_not_shrink_the_limit() -> None:
    gov = governor(capacity=10 * GB, initial_size=32)
    gov.on_oom([c(200_000)])
    assert gov.count_limit() == 32


def test_limit_grows_back_additively_only_while_it_binds() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=64)
    gov.on_oom([c(10)] * 40)
    assert gov.count_limit() == 20
    pending = [c(10)] * 200
    gov.plan(pending)  # 20 taken, more waiting: the limit is what binds
    gov.on_success()
    assert gov.count_limit() == 20  # growth needs a run of successes
    gov.on_success()
    assert gov.count_limit() == 23  # +ceil(20/8), not doubling: slow start ended with the OOM
    gov.plan([c(10)] * 5)  # light traffic: the limit is not what binds
    for _ in range(6):
        gov.on_success()
    assert gov.count_limit() == 23


def test_slow_start_doubles_until_the_first_oom() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=8)
    sizes = []
    for _ in range(6):
        sizes.append(len(gov.plan([c(10)] * 500)))
        gov.on_success()
    assert sizes == [8, 16, 32, 64, 128, 128]


def test_pressure_shrinks_to_three_quarters_of_every_batch_in_flight_not_of_one() -> None:
    """vLLM with 8 batches sharing the engine: a preemption after batches of 16 (128 in flight)
    takes the limit to 96. The old rule took ¾ of the last batch, 12: on the H200 that cut a job
    into 48 batches of 1-16 and 4.2 img/s (docs/bench/gpu-vllm.md)."""
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=128)
    gov.slots = 8
    gov.plan([c(10)] * 200)
    gov.on_pressure(0.5, 0, preemptions=0, in_flight=128)  # baseline
    gov.on_pressure(0.5, 0, preemptions=1, in_flight=128)
    assert gov.count_limit() == 96


def test_paged_admission_leaves_room_for_partly_filled_kv_blocks() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=128, token_capacity=100_000)
    assert gov._token_room(None) == pytest.approx(90_000)


def test_an_engine_that_gates_its_kv_is_booked_past_its_cache_in_batches_of_room_over_slots() -> None:
    """In-process vLLM admits requests to its cache itself (worker.engines.vllm.kv_gate): admission
    books 1.3× the KV tokens so a queue waits at the gate, the count limit caps each batch instead
    of all of them, and batches are the booked room over the slots."""
    gov = governor(capacity=1000 * GB, max_size=128, token_capacity=240_000, kv_gated=True)
    gov.slots = 8
    assert gov._token_room(None) == pytest.approx(312_000)
    pages = [ImageCost(vision_tokens=1456, prompt_tokens=16, output_tokens=256)] * 400
    first = gov.plan(pages)
    assert len(first) == -(-int(312_000 // 1728) // 8)  # 180 images the room holds, over 8 slots
    second = gov.plan(pages[: 400 - len(first)], inflight=[pages[0]] * len(first))
    assert len(second) == len(first)
    assert gov.desired_backlog() == 2 * (312_000 // 1728)
    # ungated, the same engine plans to 90 % of its cache and shares the count limit
    plain = governor(capacity=1000 * GB, max_size=128, token_capacity=240_000)
    plain.slots = 8
    assert plain._token_room(None) == pytest.approx(216_000) and len(plain.plan(pages)) == 16


def test_behind_a_kv_gate_a_full_cache_and_preemptions_hold_growth_but_never_shrink() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, token_capacity=100_000, kv_gated=True)
    gov.plan([c(10)] * 200)
    gov.on_pressure(0.99, 0, preemptions=0, in_flight=150)
    gov.on_pressure(0.99, 4, preemptions=3, in_flight=150)
    assert gov.count_limit() == 128 and gov.state()["kv_gated"] is True


def test_preemptions_and_full_kv_shrink_like_a_soft_oom() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=64)
    gov.plan([c(10)] * 200)
    gov.on_pressure(0.5, 0, preemptions=7)  # first sample: a baseline
    assert gov.count_limit() == 64
    gov.on_pressure(0.5, 0, preemptions=9)
    assert gov.count_limit() == 48
    gov.plan([c(10)] * 200)
    gov.on_pressure(0.97, 0, preemptions=9)
    assert gov.count_limit() == 36
    assert gov.state()["pressure_count"] == 2


def test_busy_kv_holds_growth_and_low_usage_lets_it_grow() -> None:
    gov = governor(capacity=1000 * GB, max_size=128, initial_size=16)
    for _ in range(3):  # the engine loop's order: pressure, then success
        gov.plan([c(10)] * 200)
        gov.on_pressure(0.85, 3, None)
        gov.on_success()
    assert gov.count_limit() == 16  # even slow start holds
    for _ in range(2):
        gov.plan([c(10)] * 200)
        gov.on_pressure(0.30, 0, None)
        gov.on_success()
    assert gov.count_limit() == 64


# ---- read-outs and construction ----------------------------------------------------------------


def test_desired_backlog_is_two_typical_batches() -> None:
    gov = calibrated(governor(capacity=12 * GB, max_size=256, initial_size=256))
    gov.plan([c(1000)] * 300)
    # (12·0.9 − 2) GB / 1.02 margin / 100 MB per image ≈ 86 images per batch
    assert 2 * 80 <= gov.desired_backlog() <= 2 * 90
    small = governor(capacity=12 * GB, max_size=4, initial_size=4)
    assert small.desired_backlog() == 8


def test_a_worker_holding_the_desired_backlog_lets_the_limit_grow_to_what_memory_admits() -> None:
    # Given a worker that holds desired_backlog() images, one batch of which is always in flight
    # (the engine runs it while the next is planned): only the rest is pending at plan time
    gov = calibrated(governor(capacity=12 * GB, max_size=256, initial_size=32))
    inflight, sizes = 32, []  # steady state: a batch of the current limit is running
    for _ in range(8):
        pending = [c(1000)] * max(0, gov.desired_backlog() - inflight)
        chosen = gov.plan(pending)
        gov.on_success()
        inflight = len(chosen)
        sizes.append(inflight)
    # Then batches grow from the limit (32) to what the budget admits (~86), not stuck at 32
    # (with a backlog of two limits, 64 held − 32 in flight = 32 pending never binds the limit)
    assert sizes[0] == 32 and sizes[-1] >= 80, sizes
    assert gov.desired_backlog() <= 2 * 90


def test_a_mixed_window_is_held_by_its_mean_page_not_its_largest() -> None:
    """The H200 mix (2 pages of ~1,000 tokens to 1 of ~4,000): the padded engine's packer groups
    the small pages, so the budget admits far more of them than room / the largest page. The
    backlog counted the largest page and the worker held too few images for the batches the
    in-process governor ran (≤ 64 vs 127)."""
    padded = ModelProfile("test", weight_bytes=2 * GB, kv_bytes_per_token=80_000, act_bytes_per_token=20_000.0,
                          padded=True)
    gov = calibrated(Governor(padded, capacity_bytes=24 * GB, max_size=256, initial_size=256))
    window = [c(1000), c(1000), c(4000)] * 40
    gov.plan(window)
    room = gov._token_room(None)
    assert room is not None
    mean = (2 * 1000 + 4000) / 3
    assert gov.desired_backlog() == 2 * min(2 * gov.count_limit(), int(room // mean))
    assert gov.desired_backlog() >= 1.5 * 2 * int(room // 4000)  # the old count: room / largest


def test_a_padded_plan_that_leaves_other_sizes_behind_is_final_only_at_the_count_limit_while_pages_come() -> None:
    """The H200 worker's first warm batch stopped at 45 pages: the packer kept the small pages
    and left the large ones behind, which ``full`` read as "no point waiting", while more small
    pages were still decoding (docs/bench/gpu-worker.md, 2026-12-03)."""
    padded = ModelProfile("test", weight_bytes=2 * GB, kv_bytes_per_token=80_000, act_bytes_per_token=20_000.0,
                          padded=True)
    gov = calibrated(Governor(padded, capacity_bytes=24 * GB, max_size=64, initial_size=64))
    window = [c(1000)] * 60 + [c(4000)] * 3  # 61 padded to 4,000 tokens would not fit
    assert len(gov.plan(window)) == 60  # the small pages only: the large ones wait
    assert gov.full(window)
    assert not gov.full(window, more_coming=True)
    assert gov.full([c(1000)] * 64 + [c(4000)], more_coming=True)  # the count limit is final
    # an unpadded engine leaves images behind only when its room is used up: final either way
    flat = calibrated(Governor(PROFILE, capacity_bytes=3 * GB, max_size=64, initial_size=64))
    many = [c(1000)] * 40
    assert len(flat.plan(many)) < 40 and flat.full(many, more_coming=True)


def test_state_reports_prediction_against_measurement() -> None:
    gov = governor(initial_size=16)
    batch = [c(1000)] * 10
    gov.plan(batch)
    gov.observe(batch, 3_100_000_000)
    state = gov.state()
    assert state["predicted_peak_bytes"] == 3_000_000_000
    assert state["measured_peak_bytes"] == 3_100_000_000
    assert state["calibration_error"] == pytest.approx(0.1 / 3.1, abs=1e-3)
    assert state["batch_size"] == 10 and state["observations"] == 1
    assert {"budget_bytes", "capacity_bytes", "oom_count", "bytes_per_token", "margin"} <= state.keys()


def test_from_settings_takes_capacity_from_engine_or_probe() -> None:
    batch = BatchSettings(mode="auto", max_size=32, headroom=0.2)
    engine = SimulatedEngine(capacity_bytes=16 * GB)
    # the wiring reads the engine's figures; the governor gets numbers
    assert governor_for(batch, engine, FakeNvml(total=80 * GB)).capacity == 16 * GB
    assert Governor.from_settings(batch, PROFILE, FakeNvml(total=80 * GB), engine_capacity=16 * GB).capacity == 16 * GB
    gov = Governor.from_settings(batch, PROFILE, FakeNvml(total=80 * GB))
    assert gov.capacity == 80 * GB and gov.budget == 64 * GB and gov.max_size == 32
    capped = BatchSettings(mode="auto", memory_cap_bytes=40 * GB)
    assert Governor.from_settings(capped, PROFILE, FakeNvml(total=80 * GB)).capacity == 40 * GB
    assert Governor.from_settings(batch, PROFILE, None).capacity is None


def test_resolve_capacity_prefers_the_engine_figure() -> None:
    assert resolve_capacity(80, 60) == 60
    assert resolve_capacity(80, None, 50) == 50
    assert resolve_capacity(None, None, None) is None


def test_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        governor(headroom=1.0)
    with pytest.raises(ValueError):
        governor(max_size=0)


def test_padded_engines_get_homogeneous_batches() -> None:
    # Given an engine that pads every row to the batch's longest (HF generate), with room for
    # about eight small rows or two big ones
    padded = ModelProfile("padded", weight_bytes=2 * GB, kv_bytes_per_token=80_000,
                          act_bytes_per_token=20_000.0, padded=True)
    gov = Governor(padded, capacity_bytes=4 * GB, max_size=128, initial_size=128)
    small, big = c(1_081), c(3_380)
    pending = [small, big, small, small, big, small, small, big, small, small]
    # When the oldest is small, the batch is small ones only: no row pays for a big image
    chosen = gov.plan(pending)
    assert len(chosen) >= 5 and all(pending[i] == small for i in chosen)
    # When the oldest is big, the big ones go together
    rest = pending[1:]
    chosen = gov.plan(rest)
    assert len(chosen) >= 2 and all(rest[i] == big for i in chosen)
    # An unpadded engine pays the sum, not the max: arrival order decides
    flat = Governor(PROFILE, capacity_bytes=4 * GB, max_size=128, initial_size=128)
    assert flat.plan(pending)[:2] == [0, 1]


def test_snapshot_restores_the_model_and_skips_the_slow_start() -> None:
    import json

    learned = calibrated(governor(initial_size=4))
    for _ in range(3):  # slow start grew the limit while it bound
        learned.plan([c(1000)] * 200)
        learned.on_success()
    snap = json.loads(json.dumps(learned.snapshot()))  # what Redis holds
    fresh = governor(initial_size=4)
    assert fresh.restore(snap)
    pending = [c(1000)] * 200
    assert fresh.count_limit() == learned.count_limit() > 4
    assert fresh.plan(pending) == learned.plan(pending)
    assert fresh.predict(pending[:10]) == learned.predict(pending[:10])
    assert fresh.calibrator.margin() == learned.calibrator.margin()
    state = fresh.state()
    assert state["restored_observations"] == state["observations"] == 6


def test_a_snapshot_of_too_few_batches_keeps_the_cold_limit() -> None:
    learned = governor(initial_size=4)
    learned.observe([c(1000)] * 4, int(2 * GB + 100_000 * 4000))
    learned._count.limit = 64  # as if it had grown
    fresh = governor(initial_size=4)
    assert fresh.restore(learned.snapshot())
    assert fresh.count_limit() == 4 and fresh.calibrator.observations == 1


def test_restore_rejects_malformed_snapshots_and_fixed_mode_ignores_them() -> None:
    fresh = governor()
    with pytest.raises(ValueError):
        fresh.restore({"version": 1, "calibration": {"points": [[1, -5, False]], "observations": 1},
                       "limit": 8, "slow_start": False})
    with pytest.raises(ValueError):
        fresh.restore({"version": 1, "calibration": {"points": "nope"}, "limit": 8, "slow_start": False})
    assert fresh.calibrator.observations == 0
    assert not fresh.restore({"version": 99})
    snap = calibrated(governor()).snapshot()
    assert not governor(mode="fixed").restore(snap)


def test_a_paged_engine_is_planned_against_its_kv_tokens_and_the_batches_in_flight() -> None:
    """vLLM: the room is 90 % of the KV cache (partly filled blocks), each image costs prompt + new
    tokens, and batches already running take their share; no slow start (memory is preallocated)."""
    from worker.engines.base import ImageCost
    from worker.governor.governor import Governor
    from worker.memory.costs import ModelProfile

    profile = ModelProfile("hunyuan_vl", 2 * 2**30, 98_304, 10_000.0, padded=False)
    gov = Governor(profile, capacity_bytes=24 * 2**30, headroom=0.10, max_size=128, token_capacity=100_000)
    assert gov.count_limit() == 128
    page = ImageCost(vision_tokens=800, prompt_tokens=10, output_tokens=190)  # 1,000 tokens
    assert len(gov.plan([page] * 200)) == 90  # 90 % of 100k KV tokens / 1k a page
    running = [page] * 60
    assert len(gov.plan([page] * 200, inflight=running)) == 30
    assert gov.admits(page, inflight=[page] * 89) and not gov.admits(page, inflight=[page] * 90)
    assert gov.admits(page)  # nothing in flight: the first image always goes
