"""The KV gate (``worker.engines.vllm.kv_gate``) and the stepper that holds requests behind it,
against a fake engine that allocates KV blocks as vLLM's scheduler does (named Fake*: no vLLM)."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engines.vllm.kv_gate import DEFAULT_OVERCOMMIT, TIGHTEN_FLOOR, KvGate, Seq, check_overcommit
from worker.engines.vllm.stepper import Gen, Stepper

BLOCK = 16


def brute_peak(gate: KvGate, live: list[Seq]) -> int:
    """The same bound, step by step: every running request grows one token a step and frees its
    blocks after its last; one not started holds its largest size throughout."""
    horizon = max((s.max_tokens for s in live), default=0) + 2
    best = 0
    for k in range(horizon):
        total = 0
        for s in live:
            if s.generated <= 0:
                total += gate.largest(s)
            elif k < max(1, s.max_tokens - s.generated):
                total += s.prompt + s.generated + BLOCK + k
        best = max(best, total)
    return best


def test_the_peak_is_the_step_by_step_bound() -> None:
    rng = random.Random(7)
    gate = KvGate(10_000, BLOCK)
    for _ in range(200):
        live = [Seq(rng.randint(1, 3000), mt := rng.randint(1, 300), rng.choice([0, rng.randint(1, mt)]))
                for _ in range(rng.randint(0, 40))]
        assert gate.committed(live) == brute_peak(gate, live)


def test_staggered_requests_peak_below_their_largest_sizes() -> None:
    gate = KvGate(100_000, BLOCK)
    # 100 pages of 1,472 prompt tokens, 256 new each, spread evenly over their decode
    live = [Seq(1472, 256, 1 + (i * 255) // 100) for i in range(100)]
    largest = sum(gate.largest(s) for s in live)
    assert gate.committed(live) < 0.95 * largest
    # the same pages all at their first token: they peak together, at their last step
    together = [Seq(1472, 256, 1) for _ in range(100)]
    assert gate.committed(together) == 100 * (1472 + 1 + BLOCK + 254)


def test_a_request_not_started_counts_at_its_largest_and_the_null_block_is_not_planned() -> None:
    gate = KvGate(101, BLOCK)
    assert gate.full_tokens == gate.capacity == 100 * BLOCK
    seq = Seq(1000, 500)
    assert gate.committed([seq]) == gate.largest(seq) == 1000 + 500 + BLOCK
    assert gate.fits(0, Seq(1000, 584)) and not gate.fits(0, Seq(1000, 585))


def test_tightening_plans_with_less_but_never_below_the_floor() -> None:
    gate = KvGate(1001, BLOCK)
    gate.tighten()
    assert gate.capacity == int(1000 * BLOCK * 0.97) and gate.tightened == 1
    for _ in range(100):
        gate.tighten()
    assert gate.capacity == int(1000 * BLOCK * TIGHTEN_FLOOR)
    with pytest.raises(ValueError):
        KvGate(1, BLOCK)


def test_overcommit_plans_with_more_tokens_and_takes_preemptions_without_tightening() -> None:
    gate = KvGate(1001, BLOCK, overcommit=1.25)
    assert gate.capacity == int(1000 * BLOCK * 1.25)
    gate.observe(0, expected=False)
    gate.observe(3, expected=False)
    assert gate.capacity == int(1000 * BLOCK * 1.25) and gate.tightened == 0
    exact = KvGate(1001, BLOCK)
    exact.observe(0, expected=False)
    exact.observe(3, expected=False)
    assert exact.tightened == 1


def test_the_engine_over_commits_by_default_and_an_exact_plan_is_one_setting_away(tmp_path: Path) -> None:
    from ocrq.settings import VllmSettings
    from worker.engines.vllm.engine import VllmEngine

    assert VllmEngine(VllmSettings(model_dir=tmp_path)).overcommit == DEFAULT_OVERCOMMIT == 1.15
    exact = VllmEngine(VllmSettings(model_dir=tmp_path, extra={"kv_gate_overcommit": 1}))
    assert exact.overcommit == 1.0
    with pytest.raises(ValueError, match="kv_gate_overcommit"):
        VllmEngine(VllmSettings(model_dir=tmp_path, extra={"kv_gate_overcommit": 3}))


@pytest.mark.parametrize("bad", [0.9, 2.5, "1.2", True, None])
def test_an_overcommit_outside_1_to_2_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_gate_overcommit"):
        check_overcommit(bad)


# --- the stepper behind the gate, on a fake engine ---------------------------------------------


@dataclass
class _Req:
    rid: str
    prompt: int
    max_tokens: int
    priority: int
    generated: int = 0
    running: bool = False


@dataclass
class FakePagedEngine:
    """``LLMEngine``'s add/step/abort with vLLM's KV bookkeeping: a request is scheduled when its
    prompt's blocks are free (most urgent first), a decode step that finds no free block preempts
    the least urgent, newest running request (which starts over), and outputs reach the caller
    ``lag`` steps late, as they do from vLLM's core process."""

    blocks: int
    lag: int = 0
    max_seqs: int = 256
    requests: dict[str, _Req] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    preemptions: int = 0
    peak_running: int = 0
    running_sum: int = 0
    steps: int = 0
    pending_outputs: list[list[Any]] = field(default_factory=list)

    def add_request(self, rid: str, engine_input: Any, params: Any, priority: int = 0) -> None:
        self.requests[rid] = _Req(rid, engine_input["prompt_token_ids"], params.max_tokens, priority)
        self.order.append(rid)

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self.pending_outputs)

    def _used(self) -> int:
        return sum(-(-(r.prompt + r.generated) // BLOCK) for r in self.requests.values() if r.running)

    def step(self) -> list[Any]:
        usable = self.blocks - 1
        for r in sorted(self.requests.values(), key=lambda r: (r.priority, self.order.index(r.rid))):
            if not r.running and sum(x.running for x in self.requests.values()) < self.max_seqs \
                    and self._used() + -(-(r.prompt + r.generated) // BLOCK) <= usable:
                r.running = True  # a preempted request keeps its tokens: its KV is computed again
        outs = []
        for r in [r for r in self.requests.values() if r.running]:
            while r.running and self._used() + (1 if (r.prompt + r.generated) % BLOCK == 0 else 0) > usable:
                victim = max((x for x in self.requests.values() if x.running),
                             key=lambda x: (x.priority, self.order.index(x.rid)))
                victim.running = False
                self.preemptions += 1
            if not r.running:
                continue
            r.generated += 1
            done = r.generated >= r.max_tokens
            outs.append(SimpleNamespace(request_id=r.rid, finished=done, outputs=[SimpleNamespace(
                token_ids=[7], logprobs=None, finish_reason="length" if done else None)]))
            if done:
                del self.requests[r.rid]
        running = sum(x.running for x in self.requests.values()) + sum(o.finished for o in outs)
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.steps += 1
        self.pending_outputs.append(outs)
        return self.pending_outputs.pop(0) if len(self.pending_outputs) > self.lag else []


def _run_batches(engine: FakePagedEngine, gate: KvGate | None, batches: list[list[tuple[int, int, int]]],
                 ) -> list[dict[str, Gen]]:
    """Each batch on its own thread through one stepper, as the engine loop runs them."""
    stepper = Stepper(engine, threading.RLock(), min_repeats=10**9, gate=gate)
    mine: list[dict[str, Gen]] = []
    threads = []
    for b, batch in enumerate(batches):
        gens: dict[str, Gen] = {}
        for i, (prompt, max_tokens, priority) in enumerate(batch):
            rid = f"b{b}-{i}"
            gens[rid] = Gen(index=i, watch=False, prompt_tokens=prompt, max_tokens=max_tokens)
            stepper.add(rid, {"prompt_token_ids": prompt}, SimpleNamespace(max_tokens=max_tokens), gens[rid],
                        priority=priority)
        mine.append(gens)
        threads.append(threading.Thread(target=stepper.run, args=(gens,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return mine


def _pages(n: int, rng: random.Random, priority: int = 9) -> list[tuple[int, int, int]]:
    """The bench's mix: prompts of 1024×768 (~810 tokens), 2048×1536 (~3,140) and 600×400 (~330) pages."""
    return [(rng.choice([810, 810, 3140, 330]), 64, priority) for _ in range(n)]


@pytest.mark.parametrize("lag", [0, 2])
def test_behind_the_gate_vllm_never_preempts_and_runs_near_what_its_blocks_hold(lag: int) -> None:
    rng = random.Random(3)
    batches = [_pages(16, rng) for _ in range(12)]
    gated = FakePagedEngine(blocks=1 + 40_000 // BLOCK, lag=lag)
    results = _run_batches(gated, KvGate(gated.blocks, BLOCK), batches)
    assert gated.preemptions == 0
    assert all(g.finish == "length" and g.generated == 64 for gens in results for g in gens.values())
    # ungated, vLLM over-commits its blocks and preempts
    plain = FakePagedEngine(blocks=gated.blocks, lag=lag)
    _run_batches(plain, None, batches)
    assert plain.preemptions > 0
    # as many pages as the blocks hold at their largest size, less the ramp, the tail and the lag
    mean_largest = sum(p + 64 + BLOCK for batch in batches for p, _, _ in batch) / 192
    assert gated.running_sum / gated.steps > 0.85 * 40_000 / mean_largest


def test_an_overcommitted_gate_runs_more_pages_a_step_and_lets_vllm_preempt() -> None:
    rng = random.Random(3)
    batches = [_pages(16, rng) for _ in range(12)]
    exact = FakePagedEngine(blocks=1 + 40_000 // BLOCK)
    _run_batches(exact, KvGate(exact.blocks, BLOCK), batches)
    over = FakePagedEngine(blocks=exact.blocks)
    results = _run_batches(over, KvGate(over.blocks, BLOCK, overcommit=1.5), batches)
    assert all(g.finish == "length" and g.generated == 64 for gens in results for g in gens.values())
    assert over.running_sum / over.steps > exact.running_sum / exact.steps
    assert exact.preemptions == 0 and over.preemptions > 0


def test_an_urgent_request_passes_bulk_that_vllm_can_preempt() -> None:
    rng = random.Random(5)
    engine = FakePagedEngine(blocks=1 + 20_000 // BLOCK)
    stepper = Stepper(engine, threading.RLock(), min_repeats=10**9, gate=KvGate(engine.blocks, BLOCK))
    bulk = {f"bulk{i}": Gen(index=i, watch=False, prompt_tokens=p, max_tokens=4 if i == 0 else 64)
            for i, (p, _, _) in enumerate(_pages(40, rng))}
    for rid, g in bulk.items():
        stepper.add(rid, {"prompt_token_ids": g.prompt_tokens}, SimpleNamespace(max_tokens=g.max_tokens), g,
                    priority=9)
    stepper.run({"bulk0": bulk["bulk0"]})  # a short bulk page done: the cache is full of the others
    assert stepper.held() > 0 and stepper.live() > 0
    urgent = {"urgent": Gen(index=0, watch=False, prompt_tokens=3140, max_tokens=8)}  # more than one page frees
    stepper.add("urgent", {"prompt_token_ids": 3140}, SimpleNamespace(max_tokens=8), urgent["urgent"], priority=0)
    steps = engine.steps
    stepper.run(urgent)
    # in at once, past the bulk pages still held (those wait for the blocks the running ones free)
    assert urgent["urgent"].finish == "length" and engine.steps - steps <= 8 + 1
    assert stepper.held() > 0
    stepper.run(bulk)
    assert all(g.finish == "length" for g in bulk.values())
