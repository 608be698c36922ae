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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from worker.engines import hunyuan
from worker.engines.vllm import compat
from worker.engines.vllm.answers import cut_repetition

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


class EngineDead(RuntimeError):
    """The engine failed in a step another caller ran; ``__cause__`` is that failure."""


class Stepper:
    def __init__(self, engine: Any, lock: threading.RLock, min_repeats: int,
                 after_step: Callable[[], None] = lambda: None) -> None:
        self.engine = engine
        self._lock = lock
        self._min_repeats = min_repeats
        self._after_step = after_step
        self._live: dict[str, Gen] = {}
        self._inbox: list[tuple[str, Any, Any, Gen, int]] = []
        self._turn = threading.Condition()  # guards the stepping role and the inbox
        self._stepping = False
        self.failure: BaseException | None = None
        #: steps run, seconds inside ``step()`` (with vLLM's core in its own process: waiting for
        #: its next output), requests live summed over steps (their mean: how full vLLM was kept)
        self._steps = 0
        self._step_s = 0.0
        self._live_sum = 0

    def add(self, rid: str, engine_input: Any, params: Any, gen: Gen, priority: int = 0) -> None:
        """Queue one request for the next step. ``priority`` (lower first) counts only when the
        engine schedules by priority; what vLLM's validation raises lands on ``gen.rejected``."""
        with self._turn:
            self._inbox.append((rid, engine_input, params, gen, priority))

    def live(self) -> int:
        """Requests handed to vLLM and not finished."""
        return len(self._live)

    def stats(self) -> dict[str, float | int]:
        steps = self._steps
        return {"steps": steps, "step_s": round(self._step_s, 2),
                "mean_live": round(self._live_sum / steps, 1) if steps else 0}

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
        for rid, engine_input, params, gen, priority in inbox:
            try:
                self.engine.add_request(rid, engine_input, params, priority=priority)
            except compat.client_errors() as exc:  # vLLM's refusal of this request only
                gen.rejected, gen.finish = exc, "rejected"
                continue
            except BaseException as exc:  # a dead engine core: every caller's failure
                self.failure = exc
                raise
            self._live[rid] = gen
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
        self._route(outputs)
        self._after_step()

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
