"""The VRAM governor: which pending images make the next micro-batch.

Pure logic: it sees token costs and memory numbers (bytes) and returns decisions. NVML, torch and
vLLM stay behind adapters (``worker.memory.nvml``, the engines), so every decision is testable on a CPU.

Memory model, in the units the engine reports as its batch peak (``MemorySample.peak``)::

    peak ≈ (base + slope · tokens) · boost

``tokens`` is the batch's token count (Σ per image, or n · max for engines that pad the batch to
its longest sequence). ``base``/``slope`` start from the model profile (weights; KV + activation
bytes per token) and are refitted on recent batches (``Calibrator``); ``boost`` > 1 after an OOM
and decays back. A batch is admitted when ``predict · (1 + margin) + overhead ≤ budget``, with
``budget = capacity · (1 − headroom)`` and a margin that shrinks as the fit gets good.

On top of the cost model an AIMD count limit (``worker.governor.count_limit``) guards against a model
that is wrong; paged engines' KV gauges (``worker.governor.paged_kv``) shrink it or hold its growth.

What it learned (calibration points, count limit) survives restarts: ``snapshot``/``restore``,
kept in Redis by the worker (``worker.context``), so only a worker's first start on a model,
engine settings and device pays the slow start.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from worker.governor.calibration import Calibrator
from worker.governor.count_limit import CountLimit
from worker.governor.packing import batch_tokens, pack
from worker.governor.paged_kv import KV_BOOK, KV_FILL, KvPressure
from worker.memory.costs import ImageCost, ModelProfile, resolve_capacity

if TYPE_CHECKING:
    from ocrq.settings import BatchSettings
    from worker.memory.nvml import MemoryProbe

log = logging.getLogger(__name__)

__all__ = ["Governor", "ModelProfile", "batch_tokens"]

Mode = Literal["fixed", "auto"]

#: OOM: the coefficient is multiplied by this (capped), and decays back on each good batch
_OOM_BOOST = 1.2
_MAX_BOOST = 4.0
_BOOST_DECAY = 0.7


class Governor:
    """Plans micro-batches by predicted peak memory and learns from measured peaks and OOMs.

    Thread-safe: the engine loop plans and observes; metrics/intake threads read ``state`` and
    ``desired_backlog``. ``capacity_bytes=None`` (no device figure, e.g. a CPU engine) plans by
    count only. ``mode="fixed"`` takes ``size`` images in arrival order (the AIMD limit still
    shrinks it after OOMs so the worker stays alive).
    """

    def __init__(
        self,
        profile: ModelProfile,
        *,
        capacity_bytes: int | None,
        headroom: float = 0.10,
        max_size: int = 128,
        mode: Mode = "auto",
        size: int = 4,
        memory_cap_bytes: int | None = None,
        initial_size: int = 8,
        max_skips: int = 4,
        grow_after: int = 2,
        calibrator: Calibrator | None = None,
        token_capacity: int | None = None,
        kv_gated: bool = False,
    ) -> None:
        _check_sizes(headroom, max_size, size)
        self.profile = profile
        self.mode: Mode = mode
        self.capacity = resolve_capacity(capacity_bytes, None, memory_cap_bytes)
        self.headroom = headroom
        self.budget = None if self.capacity is None else int(self.capacity * (1.0 - headroom))
        #: paged engines (vLLM): tokens its KV cache holds. Admission then plans against those
        #: (prompt + max new tokens of every image in flight), not against a byte peak: vLLM
        #: preallocated its memory, and a sequence that outgrows the cache is preempted, not OOM
        self.token_capacity = token_capacity
        #: the paged engine admits requests to its KV cache itself, request by request, so that it
        #: never preempts (vLLM's KV gate): admission then books more tokens than the cache holds
        #: (``KV_BOOK``), and the queue that forms in front of the gate keeps the cache full
        self.kv_gated = kv_gated and token_capacity is not None
        self.token_book = KV_BOOK if self.kv_gated else KV_FILL
        #: batches the engine runs at once (set by the engine loop): they share the count limit, so
        #: a paged engine is refilled in small steps as batches finish instead of in one big one
        self.slots = 1
        self.max_size = max_size
        self.size = size
        self.max_skips = max_skips
        self.calibrator = calibrator or Calibrator(
            base_prior=float(profile.weight_bytes), slope_prior=profile.bytes_per_token
        )
        self._hard = size if mode == "fixed" else max_size
        # paged (token_capacity): memory is preallocated and admission counts every token in
        # flight, no need to discover the batch size from below (vLLM's budget bounds activations)
        from_below = mode == "auto" and token_capacity is None
        initial = min(max_size, max(1, initial_size)) if from_below else self._hard
        self._count = CountLimit(self._hard, initial, slow_start=from_below, grow_after=grow_after)
        self._kv = KvPressure()
        self._boost = 1.0
        self._oom_count = 0
        self._last_n = 0
        self._last_planned_peak: int | None = None
        self._last_predicted: int | None = None
        self._last_measured: int | None = None
        self._max_measured = 0
        self._image_tokens: float | None = None
        self._restored = 0
        self._lock = threading.RLock()

    @classmethod
    def from_settings(
        cls,
        settings: BatchSettings,
        profile: ModelProfile,
        probe: MemoryProbe | None = None,
        *,
        capacity_bytes: int | None = None,
        engine_capacity: int | None = None,
        token_capacity: int | None = None,
        kv_gated: bool = False,
    ) -> Governor:
        """A governor for a model profile. Capacity: the argument, else what the engine may use
        (``engine_capacity``, vLLM: its gpu_memory_utilization share), else the probe's device
        total; ``settings.memory_cap_bytes`` caps it. Reading these off an engine is the wiring's
        job (``worker.context.governor_for``): the governor sees numbers only."""
        if capacity_bytes is None:
            device = probe.read() if probe is not None else None
            capacity_bytes = resolve_capacity(device.total if device is not None else None, engine_capacity)
        return cls(
            profile,
            capacity_bytes=capacity_bytes,
            headroom=settings.headroom,
            max_size=settings.max_size,
            mode=settings.mode,
            size=settings.size,
            memory_cap_bytes=settings.memory_cap_bytes,
            token_capacity=token_capacity,
            kv_gated=kv_gated,
        )

    # ---- prediction -------------------------------------------------------------------------

    def predict(self, costs: Sequence[ImageCost]) -> int:
        """Predicted engine-reported peak of this batch, bytes (no margin, no overhead)."""
        with self._lock:
            return int(self._predict_tokens(batch_tokens(costs, self.profile.padded)))

    def _predict_tokens(self, tokens: float) -> float:
        return self.calibrator.predict(tokens) * self._boost

    def _token_room(self, free_bytes: int | None) -> float | None:
        """Most batch tokens the budget admits now (None: no budget, count only)."""
        if self.token_capacity is not None:
            # every admitted image holds its prompt and all its new tokens: the KV cache itself is
            # the budget (headroom is for byte budgets; vLLM keeps its activations outside the KV)
            return self.token_capacity * self.token_book / self._boost
        if self.budget is None or self.capacity is None:
            return None
        budget = float(self.budget)
        if free_bytes is not None:
            # free is read between batches, while this process holds its weights and context
            resident = self.profile.weight_bytes + self.profile.overhead_bytes
            budget = min(budget, free_bytes + resident - self.capacity * self.headroom)
        allowed = (budget - self.profile.overhead_bytes) / (1.0 + self.calibrator.margin()) / self._boost
        return self.calibrator.tokens_within(allowed)

    def fits(self, costs: Sequence[ImageCost], *, free_bytes: int | None = None) -> bool:
        """Whether the model expects this batch within budget (True without a budget)."""
        with self._lock:
            room = self._token_room(free_bytes)
            return room is None or batch_tokens(costs, self.profile.padded) <= room

    def count_limit(self) -> int:
        """Most images the next batch may hold (hard cap and the AIMD limit)."""
        with self._lock:
            return self._count.value()

    # ---- planning ---------------------------------------------------------------------------

    def plan(
        self,
        pending: Sequence[ImageCost],
        *,
        free_bytes: int | None = None,
        skips: Sequence[int] | None = None,
        inflight: Sequence[ImageCost] = (),
    ) -> list[int]:
        """Indices (ascending) of the pending images, oldest first, to run next.

        Packing by cost may pass over a big image to fill with small ones, never forever: an
        image skipped ``max_skips`` times goes first, otherwise the oldest does (the first one
        always goes, even alone over budget: the engine loop then downscales or fails it).
        ``free_bytes`` (device free bytes now, plus what the process holds unused) lowers the
        budget when other processes use the device; ``inflight`` (batches still running on an
        engine that runs several at once) takes its tokens out of the room.
        """
        with self._lock:
            n = len(pending)
            if n == 0:
                return []
            cap_n = self._batch_cap()
            self._note_mix(pending)
            chosen = self._select(pending, free_bytes, skips, inflight)
            self._count.planned(len(chosen), cap_n, n)
            self._last_n = len(chosen)
            picked = [pending[i] for i in chosen]
            self._last_planned_peak = int(
                self._predict_tokens(batch_tokens(picked, self.profile.padded))
            )
            return chosen

    def full(self, pending: Sequence[ImageCost], *, free_bytes: int | None = None,
             inflight: Sequence[ImageCost] = (), more_coming: bool = False) -> bool:
        """Whether the next batch is as big as it can get (it would leave images behind, or
        holds the count limit): no point lingering for more.

        ``more_coming``: images are on their way (announced, still decoding). A padded engine's
        plan leaves pages of another size behind long before its memory is full (the packer
        keeps a batch homogeneous), so only the count limit makes it final then: pages like the
        chosen ones may still join (docs/bench/gpu-worker.md, 2026-12-03)."""
        with self._lock:
            chosen = self._select(pending, free_bytes, None, inflight)
            if len(chosen) >= self._batch_cap():
                return True
            if more_coming and self.profile.padded:
                return False
            return len(chosen) < len(pending)

    def admits(self, first: ImageCost, *, inflight: Sequence[ImageCost] = ()) -> bool:
        """Whether ``first`` fits next to the batches in flight (always, with none in flight)."""
        with self._lock:
            if not inflight:
                return True
            room = None if self.mode == "fixed" else self._token_room(None)
            if room is None:
                return True
            return batch_tokens(inflight, self.profile.padded) + first.total_tokens <= room

    def _select(
        self, pending: Sequence[ImageCost], free_bytes: int | None, skips: Sequence[int] | None,
        inflight: Sequence[ImageCost] = (),
    ) -> list[int]:
        n = len(pending)
        cap_n = self._batch_cap()
        room = None if self.mode == "fixed" else self._token_room(free_bytes)
        if room is not None and inflight:
            room -= batch_tokens(inflight, self.profile.padded)
        if room is None:
            return list(range(min(n, cap_n)))
        return pack(pending, room, cap_n, padded=self.profile.padded, skips=skips,
                    max_skips=self.max_skips, lookahead=1 + 4 * self._hard)

    def _batch_cap(self) -> int:
        slots = max(1, self.slots)
        if self.kv_gated:
            # the count limit caps each batch; the booked room, shared by the slots, bounds them all:
            # batches of about room / slots keep the gate's queue refilled in small steps
            return max(1, min(self._count.value(), math.ceil(self._fit_n() / slots)))
        return max(1, math.ceil(self._count.value() / slots))

    def _note_mix(self, pending: Sequence[ImageCost]) -> None:
        """Running mean tokens per image of the workload: how many images the budget admits, to
        size the backlog. Not the longest image, even for a padded engine: the packer groups
        pages of a size, so a mixed window holds batches of small pages far larger than room /
        longest (the H200 worker held 3 chunks and ran ≤ 64 where in-process batches reached 127)."""
        tokens = [c.total_tokens for c in pending]
        per_image = sum(tokens) / len(tokens)
        old = self._image_tokens
        self._image_tokens = per_image if old is None else 0.8 * old + 0.2 * per_image

    # ---- feedback ---------------------------------------------------------------------------

    def observe(self, costs: Sequence[ImageCost], measured_peak_bytes: int) -> None:
        """A batch ran; its engine-reported peak calibrates the model."""
        if not costs or measured_peak_bytes <= 0:
            return
        with self._lock:
            tokens = batch_tokens(costs, self.profile.padded)
            predicted = self._predict_tokens(tokens)
            self._last_predicted = int(predicted)
            self._last_measured = measured_peak_bytes
            self._max_measured = max(self._max_measured, measured_peak_bytes)
            self.calibrator.add(tokens, float(measured_peak_bytes), predicted=predicted)
            self._boost = 1.0 + (self._boost - 1.0) * _BOOST_DECAY

    def on_oom(self, costs: Sequence[ImageCost]) -> None:
        """A batch ran out of device memory: halve the count limit, bump the coefficient.

        A lone image that does not fit says nothing about how many images fit, so it only
        teaches the cost model (the engine loop downscales or fails that image)."""
        with self._lock:
            self._oom_count += 1
            self._count.on_oom(len(costs))
            tokens = batch_tokens(costs, self.profile.padded)
            if self.capacity is not None and tokens > 0:
                # censored observation: the true peak exceeded what the device could give, news
                # only when the model thought it fitted. Raised by at most a quarter: a transient
                # OOM (a neighbour's spike) must not teach that one small image fills the device
                floor = float(self.capacity - self.profile.overhead_bytes)
                expected = self.calibrator.predict(tokens)
                if expected < floor:
                    self.calibrator.add_lower_bound(tokens, min(floor, expected * 1.25))
            if len(costs) > 1:
                self._boost = min(_MAX_BOOST, self._boost * _OOM_BOOST)

    def on_success(self) -> None:
        """A planned batch ran without OOM: grow the count limit while it is what binds."""
        with self._lock:
            self._count.on_success()

    def on_pressure(
        self, kv_usage: float | None, waiting: int | None = None, preemptions: int | None = None,
        in_flight: int | None = None,
    ) -> None:
        """Paged-KV signals (vLLM). ``preemptions`` is the engine's cumulative counter (a drop
        means it restarted). New preemptions or a nearly full KV cache shrink the limit like a
        soft OOM, to ¾ of the images that were in flight (``in_flight``, every batch sharing
        the engine; the last batch alone when unknown); a busy cache or a waiting queue holds
        growth; low usage lets it grow."""
        with self._lock:
            signal = self._kv.read(kv_usage, waiting, preemptions)
            if signal == "shrink" and self.kv_gated:
                # a full cache is what the gate aims at, and a preemption is the gate's to answer
                # (it plans with less) or vLLM making room for a more urgent request
                signal = "hold"
            if signal == "shrink":
                # batches in flight share the limit: ¾ of one batch would starve all the others
                self._count.shrink(in_flight if in_flight else self._last_n)
            elif signal == "hold":
                self._count.hold()

    # ---- persistence ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The learned memory model and count limit, JSON-able. A worker saves it in Redis so its
        next start on the same model, settings and device skips the slow start."""
        with self._lock:
            return {"version": 1, "calibration": self.calibrator.snapshot(), **self._count.snapshot()}

    def restore(self, snap: Mapping[str, Any]) -> bool:
        """Continue from a ``snapshot``. The count limit is trusted only when the snapshot holds
        at least the calibrator's warm-up of measured batches; OOM history (boost) is not carried
        over. Returns whether anything was restored; malformed data raises ValueError."""
        with self._lock:
            if self.mode != "auto" or snap.get("version") != 1:
                return False
            self.calibrator.restore(snap["calibration"])
            if self.calibrator.observations >= self.calibrator.warmup:
                self._count.restore(snap)
            self._restored = self.calibrator.observations
            return True

    # ---- read-outs --------------------------------------------------------------------------

    def typical_batch(self) -> int:
        """Images a batch of the current workload mix holds (limit and budget)."""
        with self._lock:
            return min(self._count.value(), self._fit_n())

    def desired_backlog(self) -> int:
        """Images a worker should hold locally: two batches of what it may run next, so the
        engine never waits for intake while the broker keeps the rest for other workers.

        "What it may run next" looks past the count limit while memory admits more: the AIMD
        limit only grows when more images than it are waiting, so a backlog of two limits would
        pin it where it stands (at the chunk size, in practice). Up to twice the limit, within
        what the budget admits, lets it double. (The engine loop adds the batch in flight.)"""
        with self._lock:
            return 2 * min(2 * self._count.value(), self._fit_n())

    def _fit_n(self) -> int:
        """Images of the current mix the memory budget admits in one batch (the hard cap when
        there is no budget or no mix seen yet)."""
        room = None if self.mode == "fixed" else self._token_room(None)
        if room is None or not self._image_tokens:
            return self._hard
        if self.kv_gated:  # the room, not one batch's cap, bounds the images in flight
            return max(1, int(room // self._image_tokens))
        return max(1, min(self._hard, int(room // self._image_tokens)))

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "mode": self.mode,
                "capacity_bytes": self.capacity,
                "budget_bytes": self.budget,
                "headroom": self.headroom,
                "count_limit": self._count.value(),
                "slow_start": self._count.slow_start,
                "batch_size": self._last_n,
                "planned_peak_bytes": self._last_planned_peak,
                "predicted_peak_bytes": self._last_predicted,
                "measured_peak_bytes": self._last_measured,
                "max_measured_peak_bytes": self._max_measured,
                "oom_count": self._oom_count,
                "pressure_count": self._kv.count,
                "kv_gated": self.kv_gated,
                "token_book": self.token_book,
                "boost": round(self._boost, 4),
                "base_bytes": int(self.calibrator.base),
                "bytes_per_token": round(self.calibrator.slope, 1),
                "margin": round(self.calibrator.margin(), 4),
                "calibration_error": self.calibrator.error(),
                "observations": self.calibrator.observations,
                "rejected_peaks": self.calibrator.rejected,
                "restored_observations": self._restored,
            }


def _check_sizes(headroom: float, max_size: int, size: int) -> None:
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if max_size < 1 or size < 1:
        raise ValueError("max_size and size must be >= 1")
