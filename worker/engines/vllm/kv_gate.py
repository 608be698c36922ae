"""Which queued requests may enter vLLM now without any running request ever being preempted
(pure: numbers in, numbers out; the stepper holds the requests, ``worker.engines.vllm.stepper``).

vLLM's scheduler admits a waiting request when its *prompt* fits in the free KV blocks, and
preempts (recomputes from scratch, vision tower included) the newest running request when a decode
step finds no free block. With every page queued at once it over-commits the cache: on the H100,
532 preemptions over 900 requests of the 300-page workload. Admission that reserves every page's
prompt + all its new tokens until its *batch* finishes never preempts, but kept ~78 pages in vLLM
where the cache holds ~135, and vLLM's steps are what the pages pay for (a step advances every
running request by one token, at about the same cost for 80 or 140 of them).

The gate plans per request against the blocks vLLM really has, at run time:

- a request that has produced tokens holds ``prompt + generated`` tokens now and grows by one a
  step until it has ``max_tokens`` (or stops earlier: EOS, the repetition rule), then frees all;
- a request not started yet (queued in vLLM or prefilling) is counted at its largest,
  ``prompt + max_tokens``, for as long as it has not started;
- every request gets one block more than its tokens: blocks are allocated whole (16 tokens), and
  the counts this process has seen lag vLLM's core by a step or two.

The most the running requests will ever hold together is the peak, over the coming steps, of
``Σ (now_i + k)`` over the requests still running ``k`` steps ahead: a request that finishes gives
its blocks back, so staggered requests peak below the sum of their largest sizes. A request enters
when that peak plus its own largest size fits the usable blocks (one block of vLLM's pool is its
null block). The peak is computed in O(n log n) once per step.

``overcommit`` > 1 plans with that many times the usable blocks: more pages run a step (vLLM's step
costs about the same for 110 or 130 pages) and vLLM preempts what does not fit, as it does alone;
the gate then takes preemptions as the price asked for and does not tighten. The default, 1.15, is
what matched vLLM's engine alone on the same 1,000 pages (docs/bench/gpu-vllm.md); 1 never preempts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DEFAULT_OVERCOMMIT", "KvGate", "Seq", "check_overcommit"]

log = logging.getLogger(__name__)

#: share of the usable blocks the gate keeps after vLLM preempted a request it planned for (a
#: release that allocates differently than the gate assumes); the floor keeps the engine useful
TIGHTEN = 0.97
TIGHTEN_FLOOR = 0.5
#: the most ``overcommit`` may be: beyond it vLLM would recompute more than it runs
MAX_OVERCOMMIT = 2.0
#: ``engine.extra.kv_gate_overcommit`` when unset. The exact plan (1) kept ~110 pages in vLLM and ran
#: at 0.866x its engine alone (one H100, 2026-12-07); on one H200 the same day 1.15 kept ~130 at 139
#: preemptions per 1,000 pages and matched the engine alone (18.81 against 18.76 img/s), whose own
#: scheduler preempted 930 times
DEFAULT_OVERCOMMIT = 1.15


@dataclass(frozen=True)
class Seq:
    """One request as the gate sees it."""

    prompt: int
    max_tokens: int
    #: new tokens seen so far; 0: not started (queued or prefilling)
    generated: int = 0


class KvGate:
    """Not thread-safe: the stepper calls it from the one thread that steps."""

    def __init__(self, num_blocks: int, block_size: int, overcommit: float = 1.0) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a KV cache of {num_blocks} blocks of {block_size} tokens cannot be gated")
        check_overcommit(overcommit)
        self.block_size = block_size
        self.overcommit = overcommit
        #: tokens the gate plans with: vLLM's blocks less its null block, times ``overcommit``
        self.full_tokens = int((num_blocks - 1) * block_size * overcommit)
        self.capacity = self.full_tokens
        #: times ``tighten`` cut the capacity
        self.tightened = 0
        self._preemptions: int | None = None

    def largest(self, seq: Seq) -> int:
        """Tokens ``seq`` holds at most (its prompt, all its new tokens, a block of slack)."""
        return seq.prompt + seq.max_tokens + self.block_size

    def committed(self, live: Iterable[Seq]) -> int:
        """The most tokens the requests in ``live`` will hold at once from now until they finish."""
        waiting = 0
        running: list[tuple[int, int]] = []  # (steps until it finishes, tokens it holds now)
        for seq in live:
            if seq.generated <= 0:
                waiting += self.largest(seq)
                continue
            left = max(1, seq.max_tokens - seq.generated)
            running.append((left, seq.prompt + seq.generated + self.block_size))
        return waiting + _peak(running)

    def fits(self, committed: int, seq: Seq) -> bool:
        """Whether ``seq`` may enter beside requests that will hold ``committed`` tokens at most."""
        return committed + self.largest(seq) <= self.capacity

    def tighten(self) -> None:
        """vLLM preempted a request the gate let in: plan with fewer tokens from now on."""
        self.capacity = max(int(self.full_tokens * TIGHTEN_FLOOR), int(self.capacity * TIGHTEN))
        self.tightened += 1

    def observe(self, preemptions: int | None, expected: bool) -> None:
        """vLLM's cumulative preemption counter after a step. New preemptions among requests of
        one urgency (not ``expected``: vLLM making room for a more urgent one) mean the gate
        planned more than vLLM holds: it tightens."""
        if preemptions is None:
            return
        seen, self._preemptions = self._preemptions, preemptions
        if seen is not None and preemptions > seen and not expected and self.overcommit <= 1.0:
            self.tighten()
            log.warning("vLLM preempted %d request(s) the KV gate let in; it now plans with %d of %d tokens",
                        preemptions - seen, self.capacity, self.full_tokens)


def check_overcommit(value: object) -> float:
    """``engine.extra.kv_gate_overcommit`` as a number from 1 to ``MAX_OVERCOMMIT``, or a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value <= MAX_OVERCOMMIT:
        raise ValueError(f"engine.extra.kv_gate_overcommit must be a number from 1 to {MAX_OVERCOMMIT}, "
                         f"not {value!r}")
    return float(value)


def _peak(running: list[tuple[int, int]]) -> int:
    """max over k ≥ 0 of Σ (now_i + k) over the requests with ``left_i > k``: between two requests'
    last steps the sum only grows, so the peak is at some request's last step (k = left_i − 1)."""
    if not running:
        return 0
    running.sort()
    n = len(running)
    # suffix sums of the tokens held now, over the requests sorted by steps left
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + running[i][1]
    best = 0
    first = 0  # first index of the current run of equal steps left
    for i, (left, _) in enumerate(running):
        if i > 0 and left != running[i - 1][0]:
            first = i
        if i + 1 < n and running[i + 1][0] == left:
            continue  # evaluate once per distinct value, at the end of its run
        k = left - 1
        best = max(best, suffix[first] + k * (n - first))
    return best
