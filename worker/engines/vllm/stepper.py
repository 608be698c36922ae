"""Drives one in-process vLLM ``LLMEngine`` for several micro-batches at once.

Each batch's caller (an engine-loop thread) puts its requests in the inbox, then the callers take
turns at the one stepping role until their own requests finish. Whoever steps first adds what the
inbox holds, so a batch enters vLLM at the next step, never waiting for a lock another thread keeps
re-taking (a plain lock around ``step()`` starved the adders: CPython's locks are not fair). A step
advances every running request, whoever's it is, so batches share vLLM's continuous batching: the
next batch's prefill runs while the previous one decodes. Engine calls (``add_request``, ``step``,
``abort_request``) run under the engine's lock; outputs are routed to their requests here and the
waiting callers woken after every step. A step that raises leaves the engine dead for every
caller: each one sees the same exception.

With a KV gate (``worker.engines.vllm.kv_gate``) a request waits here, most urgent first, until vLLM
can hold it to its last token beside the requests it runs: vLLM then never preempts, and it holds as
many requests as its blocks allow, where admission by whole batches kept it at about half. A
request more urgent than one vLLM runs goes in at once: vLLM's priority scheduler makes its room
(preempting the less urgent one), as it did before the gate.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from worker.engines import hunyuan
from worker.engines.vllm import compat
from worker.engines.vllm.answers import cut_repetition
from worker.engines.vllm.kv_gate import KvGate, Seq

#: new tokens between two checks of a request's tail for a loop
REPETITION_CHECK_EVERY = 8


@dataclass
class Gen:
    """One request's progress."""

    index: int
    #: logprobs asked for (the sampled token comes on top when it is not among them)
    k: int = 0
    #: stop the request early when its tail loops (off for exact-length test runs)
    watch: bool = True
    tokens: list[int] = field(default_factory=list)
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    repetition: hunyuan.Repetition | None = None
    #: tokens the engine produced (``tokens`` may have been cut back to one copy of a loop)
    generated: int = 0
    checked: int = 0
    #: what vLLM's ``add_request`` raised for this request (validation: it never ran)
    rejected: BaseException | None = None
    #: prompt tokens (image tokens included) and the most new tokens: what the KV gate plans with
    prompt_tokens: int = 0
    max_tokens: int = 0
    priority: int = 0


class EngineDead(RuntimeError):
    """The engine failed in a step another caller ran; ``__cause__`` is that failure."""


class Stepper:
    def __init__(self, engine: Any, lock: threading.RLock, min_repeats: int,
                 after_step: Callable[[], None] = lambda: None, gate: KvGate | None = None) -> None:
        self.engine = engine
        self._lock = lock
        self._min_repeats = min_repeats
        self._after_step = after_step
        self.gate = gate
        self._live: dict[str, Gen] = {}
        self._inbox: list[tuple[str, Any, Any, Gen, int]] = []
        #: requests the gate holds back: (priority, arrival, entry), most urgent first
        self._held: list[tuple[int, int, tuple[str, Any, Any, Gen, int]]] = []
        self._arrival = itertools.count()
        self._turn = threading.Condition()  # guards the stepping role and the inbox
        self._stepping = False
        self.failure: BaseException | None = None
        #: steps run, seconds inside ``step()`` (with vLLM's core in its own process: waiting for
        #: its next output), requests live summed over steps (their mean: how full vLLM was kept)
        self._steps = 0
        self._step_s = 0.0
        self._live_sum = 0
        #: steps that ended with requests held back by the gate, and those requests summed over steps
        self._held_steps = 0
        self._held_sum = 0

    def add(self, rid: str, engine_input: Any, params: Any, gen: Gen, priority: int = 0) -> None:
        """Queue one request for the next step. ``priority`` (lower first) counts only when the
        engine schedules by priority; what vLLM's validation raises lands on ``gen.rejected``."""
        gen.priority = priority
        with self._turn:
            self._inbox.append((rid, engine_input, params, gen, priority))

    def live(self) -> int:
        """Requests handed to vLLM and not finished."""
        return len(self._live)

    def held(self) -> int:
        """Requests the gate holds back (queued here, not yet in vLLM)."""
        return len(self._held)

    def mixed_priorities(self) -> bool:
        """Requests of different urgency run at once: vLLM may preempt the less urgent ones for the
        more urgent (by design, not a gate error)."""
        return len({g.priority for g in self._live.values()}) > 1

    def stats(self) -> dict[str, float | int]:
        steps = self._steps
        out: dict[str, float | int] = {
            "steps": steps, "step_s": round(self._step_s, 2),
            "mean_live": round(self._live_sum / steps, 1) if steps else 0}
        if self.gate is not None:
            out.update(gate_tokens=self.gate.capacity, gate_overcommit=self.gate.overcommit,
                       gate_tightened=self.gate.tightened,
                       held=len(self._held), mean_held=round(self._held_sum / steps, 1) if steps else 0,
                       held_steps=self._held_steps)
        return out

    def run(self, mine: dict[str, Gen]) -> None:
        """Step until every request in ``mine`` has finished (any caller's step counts)."""
        while True:
            with self._turn:
                while True:
                    if self.failure is not None:
                        raise EngineDead("vLLM engine failed in another batch's step") from self.failure
                    if all(g.finish is not None for g in mine.values()):
                        return
                    if not self._stepping:
                        self._stepping = True
                        inbox, self._inbox = self._inbox, []
                        break
                    self._turn.wait()
            try:
                with self._lock:
                    self._step(inbox, mine)
            finally:
                with self._turn:
                    self._stepping = False
                    self._turn.notify_all()

    def _step(self, inbox: list[tuple[str, Any, Any, Gen, int]], mine: dict[str, Gen]) -> None:
        for entry in inbox:
            heapq.heappush(self._held, (entry[4], next(self._arrival), entry))
        self._admit()
        if all(g.finish is not None for g in mine.values()):
            return
        if not self.engine.has_unfinished_requests():
            lost = [rid for rid, g in mine.items() if g.finish is None]
            raise EngineDead(f"vLLM has no unfinished requests but {len(lost)} never finished")
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except BaseException as exc:
            self.failure = exc
            raise
        self._steps += 1
        self._step_s += time.perf_counter() - t0
        self._live_sum += len(self._live)
        if self._held:
            self._held_steps += 1
            self._held_sum += len(self._held)
        self._route(outputs)
        self._after_step()

    def _admit(self) -> None:
        """Hand vLLM the held requests the gate lets in, most urgent first (all of them without a
        gate). A request is planned beside the running requests at least as urgent as it: vLLM's
        priority scheduler preempts less urgent ones to make it room. With nothing running the
        first one always goes (a request larger than the cache is vLLM's to refuse)."""
        gate = self.gate
        committed: dict[int, int] = {}  # by priority: what the requests at least that urgent hold at most
        while self._held:
            priority, _, entry = self._held[0]
            gen = entry[3]
            seq = Seq(gen.prompt_tokens, gen.max_tokens)
            if gate is not None and self._live:
                if priority not in committed:
                    committed[priority] = gate.committed(
                        Seq(g.prompt_tokens, g.max_tokens, g.generated) for g in self._live.values()
                        if g.priority <= priority)
                if not gate.fits(committed[priority], seq):
                    return
            heapq.heappop(self._held)
            if self._add(*entry) and gate is not None:
                for p in committed:
                    if p >= priority:
                        committed[p] += gate.largest(seq)

    def _add(self, rid: str, engine_input: Any, params: Any, gen: Gen, priority: int) -> bool:
        try:
            self.engine.add_request(rid, engine_input, params, priority=priority)
        except compat.client_errors() as exc:  # vLLM's refusal of this request only
            gen.rejected, gen.finish = exc, "rejected"
            return False
        except BaseException as exc:  # a dead engine core: every caller's failure
            self.failure = exc
            raise
        self._live[rid] = gen
        return True

    def _route(self, outputs: Iterable[Any]) -> None:
        for out in outputs:
            gen = self._live.get(out.request_id)
            if gen is None or gen.finish is not None:
                continue
            completion = out.outputs[0]
            gen.tokens.extend(completion.token_ids)
            gen.generated = len(gen.tokens)
            for step in completion.logprobs or []:
                ranked = sorted(step.items(), key=lambda kv: kv[1].rank or 0)
                gen.logprobs.append([(int(t), float(lp.logprob)) for t, lp in ranked][: gen.k])
            if out.finished:
                gen.finish = completion.finish_reason or "stop"
                self._settle(out.request_id, gen)
            elif gen.watch and len(gen.tokens) - gen.checked >= REPETITION_CHECK_EVERY:
                gen.checked = len(gen.tokens)
                kept, rep = cut_repetition(gen.tokens, self._min_repeats)
                if rep is not None:
                    self.engine.abort_request([out.request_id])
                    gen.tokens, gen.repetition, gen.finish = kept, rep, "repetition"
                    self._live.pop(out.request_id, None)

    def _settle(self, rid: str, gen: Gen) -> None:
        self._live.pop(rid, None)
        if gen.watch and gen.repetition is None:  # a loop that hit a length/EOS limit before a check
            gen.tokens, gen.repetition = cut_repetition(gen.tokens, self._min_repeats)
