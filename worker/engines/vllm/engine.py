"""HunyuanOCR on an in-process ``vllm.LLM`` + ocrq's vLLM plugin (0.26: native model; 0.32+: Transformers backend).

One micro-batch = one chat request per image (each with its own task and prompt), handed to the
engine together so vLLM's continuous batching interleaves them. We drive ``LLMEngine.step()``
ourselves instead of ``LLM.chat`` for two reasons: a request that loops (dense pages can) is
aborted as soon as the repetition rule fires instead of running to ``max_tokens``, and the KV
usage / queue gauges are sampled while the batch runs, not only after it drained.

Failure model: an image vLLM refuses to render or admit (processor error, prompt longer than
``max_model_len``) fails alone; an exception out of ``step()`` means the engine is gone (CUDA OOM
→ ``EngineOOM``, anything else, e.g. a dead engine core → ``EngineCrashed``). Either way the LLM is
torn down and rebuilt by the next call, so the worker process survives.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ocrq.engine_settings import VllmSettings
from ocrq.errors import EngineCrashed, EngineOOM, OcrqError, is_oom
from ocrq.results import OcrOutput
from worker.engines import hunyuan
from worker.engines.base import ImageCost, MemorySample, OcrRequest
from worker.engines.hunyuan import build_output
from worker.engines.vllm import compat, startup
from worker.engines.vllm.answers import admission_error, answer_meta, image_messages
from worker.engines.vllm.gauges import Gauges, kv_blocks, kv_tokens
from worker.engines.vllm.kv_gate import DEFAULT_OVERCOMMIT, KvGate, check_overcommit
from worker.engines.vllm.options import dtype, llm_args, render_threads, sized_llm_args
from worker.engines.vllm.render_ahead import RenderAhead, one_torch_thread
from worker.engines.vllm.stepper import EngineDead, Gen, Stepper
from worker.engines.vllm.warmup import RendererWarmup
from worker.engines.weights import weights_revision
from worker.memory.costs import ModelProfile

log = logging.getLogger(__name__)

class VllmEngine:
    """``Engine`` on an in-process ``vllm.LLM``; construct with the ``engine`` settings section.

    ``settings.extra``: ``hunyuan_version`` ("1.5"), ``vllm`` (extra ``vllm.LLM`` keyword
    arguments, e.g. ``{"kv_cache_memory_bytes": 268435456}`` on CPU), ``ignore_eos`` (tests),
    ``kv_gate`` (false: every request goes to vLLM's scheduler at once, ``worker.engines.vllm.kv_gate``),
    ``kv_gate_overcommit`` (1.15: the gate plans with that many times vLLM's KV blocks, 1 to 2; 1 never
    preempts).
    """

    name = "vllm"
    #: render one page while the engine core builds (False: the herd test's unfixed engine)
    warm_renderer = True

    def __init__(self, settings: VllmSettings) -> None:
        if settings.model_dir is None:
            raise ValueError("the vllm engine needs engine.model_dir")
        self.settings = settings
        self.model_dir = Path(settings.model_dir)
        self.version = hunyuan.version_of(settings)
        self.overcommit = check_overcommit(settings.extra.get("kv_gate_overcommit", DEFAULT_OVERCOMMIT))
        self.sampling = hunyuan.SAMPLING[self.version]
        #: bytes vLLM may claim on the GPU (utilization × total); None on CPU
        self.capacity_bytes: int | None = None
        #: seconds the last (re)build took
        self.start_seconds: float | None = None
        #: the last build's phases (seconds): vLLM's own (startup) plus ours around ``LLM()``
        self.start_phases: dict[str, float] = {}
        #: which of them ran beside ``LLM()`` rather than after it
        self.start_beside: dict[str, float] = {}
        #: tokens vLLM's KV cache holds (known once built): what admission control plans against
        self.kv_capacity_tokens: int | None = None
        #: micro-batches the engine loop may run at once: they share vLLM's continuous batching
        self.concurrent_batches = max(1, settings.concurrent_batches)
        self._tokenizer: Any = None
        self._decode_lock = threading.Lock()
        self.builds = 0
        self._llm: Any = None
        self._on_cuda = False
        self._revision: str | None = None
        self._ids = itertools.count()
        self._lock = threading.RLock()
        # HF processing is CPU work in this process: pages render while batches step, ahead of
        # their batch (``prepare``); made on first use, gone with ``close``
        self._renders: RenderAhead | None = None
        self._renders_lock = threading.Lock()
        self._stepper: Stepper | None = None
        self._gauges = Gauges()
        self._gate: KvGate | None = None
        #: work of the worker's own to run while vLLM's engine core builds (after the renderer's
        #: warm-up, in its thread; skipped if the core is ready first): the worker's first
        #: garbage collection and freeze (``worker.context``)
        self.while_building: list[Callable[[], object]] = []

    # --- identity ----------------------------------------------------------------------------

    @property
    def revision(self) -> str:
        if self._revision is None:
            self._revision = weights_revision(self.model_dir, self.version)
        return self._revision

    @property
    def memory_profile(self) -> ModelProfile:
        config = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        dtype_bytes = 2 if dtype(self.settings) in ("bfloat16", "float16") else 4
        # paged KV: a batch costs the sum of its sequences, not n × the longest
        return ModelProfile.from_hf_config(config, dtype_bytes, padded=False)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._llm is None:
                self._build()

    def close(self) -> None:
        with self._lock:
            self._teardown()
        with self._renders_lock:
            renders, self._renders = self._renders, None
        if renders is not None:
            renders.close()

    def _render_queue(self) -> RenderAhead:
        with self._renders_lock:  # not the engine's lock: a step holds that for its whole length
            if self._renders is None:
                self._renders = RenderAhead(self._render_current, threads=render_threads(self.settings),
                                            ahead=self.settings.render_ahead, init=one_torch_thread)
            return self._renders

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` (without the GPU share, sized in ``_build``)."""
        return llm_args(self.settings, self.model_dir)

    def _build(self) -> None:
        t0 = time.perf_counter()
        from vllm import LLM

        args, self.capacity_bytes, self._on_cuda = sized_llm_args(self.settings, self.model_dir)
        phase_log = Path(tempfile.mkstemp(prefix="ocrq-vllm-start-", suffix=".jsonl")[1])
        os.environ[startup.ENV] = str(phase_log)  # inherited by the engine core process
        startup.install_from_env()
        warm = RendererWarmup(self._warm_render, also=self._load_tokenizer, beside=self.while_building)
        t1 = time.perf_counter()
        try:
            with compat.renderer_built(warm.begin if self.warm_renderer else lambda *_: None):
                self._llm = llm = LLM(**args)
        except BaseException:
            warm.cancel()
            raise
        finally:
            warm.built()
            os.environ.pop(startup.ENV, None)
        self.start_seconds = time.perf_counter() - t1
        self.builds += 1
        phases = {"import": round(t1 - t0, 3), "llm": round(self.start_seconds, 3), **startup.read(phase_log)}
        phase_log.unlink(missing_ok=True)
        waited = warm.finish(lambda: self._render(llm, self._warm_request()) if self.warm_renderer else None)
        phases.update(renderer_warm=round(warm.render_s or 0.0, 3), tokenizer=round(warm.also_s or 0.0, 3),
                      after_llm=round(waited, 3))
        # what ran beside ``llm`` (import, llm and after_llm follow one another)
        self.start_beside = {"renderer_warm": phases["renderer_warm"], "tokenizer": phases["tokenizer"]} \
            if warm.overlapped else {}
        if warm.beside_s is not None:
            self.start_beside["while_building"] = round(warm.beside_s, 3)
        sized = kv_blocks(llm) if self.settings.extra.get("kv_gate", True) else None
        self._gate = None if sized is None else KvGate(*sized, overcommit=self.overcommit)
        self._stepper = Stepper(llm.llm_engine, self._lock, self.settings.repetition_stop, self._after_step,
                                gate=self._gate)
        self.kv_capacity_tokens = kv_tokens(llm)
        self.start_phases = phases
        log.info("vLLM engine %s built in %.1fs (build %d, utilization %s, KV cache %s tokens%s, renderer warmed in "
                 "%.2fs %s the build)", self.model_dir.name, self.start_seconds, self.builds,
                 args.get("gpu_memory_utilization", "-"), self.kv_capacity_tokens,
                 ", gated" if self._gate is not None else ", ungated", warm.render_s or 0.0,
                 "beside" if warm.overlapped else "after")

    @property
    def kv_gated(self) -> bool:
        """Whether requests enter vLLM through this engine's KV gate (``worker.engines.vllm.kv_gate``):
        the governor may then book more than the cache holds, the gate keeps vLLM from preempting."""
        return self._gate is not None

    def _after_step(self) -> None:
        self._gauges.read(self._llm)
        gate, stepper = self._gate, self._stepper
        if gate is not None and stepper is not None:
            gate.observe(self._gauges.preemptions, expected=stepper.mixed_priorities())

    def _load_tokenizer(self) -> None:
        if self._tokenizer is None:  # decoding only, under its lock: not one of vLLM's pooled copies
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))

    @staticmethod
    def _warm_request() -> OcrRequest:
        """The page rendered once before any render thread does: vLLM builds its HF processors
        lazily, behind ``lru_cache``s that do not hold concurrent misses back, so the render threads
        of a fresh engine each built their own processors (and tokenizer copies) for every cache key
        at once. On the H200 a worker's first job ran at 2.2 img/s, ~93 % of its GIL samples inside
        ``get_processor`` (docs/bench/gpu-vllm.md). ``worker.engines.vllm.warmup`` renders it while
        the engine core builds."""
        from PIL import Image

        return OcrRequest(key="warm-up", image=Image.new("RGB", (64, 64), "white"))

    def _warm_render(self, renderer: Any, model_config: Any) -> None:
        """The warm-up page rendered with the renderer alone, while ``LLM()`` builds."""
        request = self._warm_request()
        compat.render_chat(renderer, model_config, image_messages(request, self.version,
                                                                  {"type": "image_pil", "image_pil": request.image}))

    def _teardown(self) -> None:
        llm, self._llm, self._stepper = self._llm, None, None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None:
                core.shutdown()
        except Exception:  # a dead core may fail to shut down; we drop it either way
            log.debug("engine core shutdown failed", exc_info=True)
        del llm, core
        try:  # in-process mode keeps vLLM's process groups; a rebuild needs them gone
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:
            log.debug("vLLM cleanup failed", exc_info=True)
        gc.collect()

    # --- Engine protocol ---------------------------------------------------------------------

    def cost(self, request: OcrRequest) -> ImageCost:
        return hunyuan.cost(request, self.settings)

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        params = [self._sampling(r) for r in batch]
        gens, errors, seconds = self._run(batch, params, watch=True)
        outcomes: list[OcrOutput | OcrqError] = []
        for i, request in enumerate(batch):
            if i in errors:
                outcomes.append(errors[i])
                continue
            gen = gens[i]
            meta = answer_meta(gen.generated, gen.finish, gen.repetition, len(batch), seconds)
            with self._decode_lock:  # a Rust tokenizer is not for concurrent use; a decode is ~0.1 ms
                text = str(self._tokenizer.decode(gen.tokens, skip_special_tokens=True))
            outcomes.append(build_output(request, text, engine=self.name, revision=self.revision,
                                         settings=self.settings, meta=meta))
        return outcomes

    def prepare(self, requests: Sequence[OcrRequest]) -> None:
        """Images the engine loop queued: render them ahead of their batch, most urgent first."""
        self._render_queue().prepare(requests, [r.priority for r in requests])

    def discard(self, requests: Sequence[OcrRequest]) -> None:
        """Queued images that will not run (cancelled): forget their renders."""
        if self._renders is not None:
            self._renders.drop(requests)

    def stats(self) -> dict[str, Any]:
        """Where a worker's time goes on the CPU side (bench rows read it from the worker state)."""
        out: dict[str, Any] = {}
        renders, stepper = self._renders, self._stepper
        if renders is not None:
            out.update(rendered=renders.rendered, render_s=round(renders.render_s, 2),
                       render_wait_s=round(renders.wait_s, 2), render_queued=renders.pending())
        if stepper is not None:
            out.update(stepper.stats())
        return out

    def memory(self) -> MemorySample:
        """vLLM's own gauges: peak KV-cache usage and waiting requests since ``reset_peak``,
        cumulative preemptions. Device bytes stay None: vLLM preallocates its share at start.
        Never waits for a running batch (it samples the gauges itself): then the last read stands."""
        if self._lock.acquire(blocking=False):
            try:
                if self._llm is not None:
                    self._gauges.read(self._llm, force=True)
            finally:
                self._lock.release()
        return self._gauges.sample()

    def reset_peak(self) -> None:
        with self._lock:
            self._gauges.reset_peak()

    # --- tests and benchmarks ----------------------------------------------------------------

    def topk_logprobs(
        self, requests: Sequence[OcrRequest], k: int, steps: int
    ) -> list[list[list[tuple[int, float]]]]:
        """Per image, per decode step: the top-``k`` (token id, logprob) of the raw model output
        along the greedy path (task sampling, exactly ``steps`` tokens, no stop rules)."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=0.0, top_p=1.0, top_k=-1, max_tokens=steps, min_tokens=steps, ignore_eos=True,
                logprobs=k, repetition_penalty=float(r.params.get("repetition_penalty",
                                                                  self.sampling.repetition_penalty)),
                detokenize=False,
            )
            for r in requests
        ]
        gens, errors, _ = self._run(requests, params, watch=False)
        if errors:
            raise next(iter(errors.values()))
        return [gens[i].logprobs for i in range(len(requests))]

    # --- internals ---------------------------------------------------------------------------

    def _sampling(self, request: OcrRequest) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            repetition_penalty=float(request.params.get("repetition_penalty", s.repetition_penalty)),
            max_tokens=max(1, int(request.params.get("max_new_tokens", self.settings.max_new_tokens))),
            ignore_eos=bool(self.settings.extra.get("ignore_eos", False)),
            # the answer is decoded once at the end (``infer``): vLLM's per-step incremental
            # detokenizer would only add GIL time in this process, beside the render threads
            detokenize=False,
        )

    def _run(
        self, batch: Sequence[OcrRequest], params: list[Any], *, watch: bool
    ) -> tuple[dict[int, Gen], dict[int, OcrqError], float]:
        """Render and admit one request per image, step (with the batches already running) until
        all of them finish; per-image admission errors come back in the second dict, an engine
        failure raises (and drops the engine). Safe to call from several threads at once."""
        from vllm.sampling_params import RequestOutputKind

        with self._lock:
            if self._llm is None:
                self._build_or_raise()
            llm, stepper = self._llm, self._stepper
        assert stepper is not None  # built together with the LLM
        errors: dict[int, OcrqError] = {}
        inputs: dict[int, Any] = {}
        for i, future in enumerate(self._render_queue().take(batch)):
            try:
                by, engine_input = future.result()
                # rendered for an engine since torn down (or before the first build): again, now
                inputs[i] = engine_input if by is llm else self._render(llm, batch[i])
            except compat.client_errors() as exc:  # vLLM's refusal of this request
                errors[i] = admission_error(batch[i], exc, self.settings.max_model_len)  # this image only
        mine: dict[str, Gen] = {}
        t0 = time.perf_counter()
        try:
            if self._stepper is not stepper:
                raise EngineCrashed("the vLLM engine was rebuilt while this batch was being prepared")
            for i, engine_input in inputs.items():
                sp = params[i]
                sp.output_kind = RequestOutputKind.DELTA  # see tokens as they come (repetition)
                rid = f"ocrq-{next(self._ids)}"
                prompt = compat.prompt_length(engine_input)
                mine[rid] = Gen(index=i, k=sp.logprobs or 0, watch=watch, max_tokens=int(sp.max_tokens or 0),
                                # unknown: planned as long as the context allows (never under-planned)
                                prompt_tokens=self.settings.max_model_len if prompt is None else prompt)
                urgency = batch[i].priority if self.settings.scheduling == "priority" else 0
                stepper.add(rid, engine_input, sp, mine[rid], priority=urgency)
            stepper.run(mine)
        except OcrqError:
            raise
        except Exception as exc:  # the engine (core) failed mid-batch: drop it, rebuild next call
            cause = exc.__cause__ if isinstance(exc, EngineDead) and exc.__cause__ is not None else exc
            oom = is_oom(cause)
            with self._lock:
                if self._stepper is stepper:  # the first batch to see it tears down, once
                    log.error("vLLM engine failed (%s); it will be rebuilt", "OOM" if oom else type(cause).__name__,
                              exc_info=cause if not oom else None)
                    self._teardown()
            message = f"{type(cause).__name__}: {str(cause)[:300]}"
            raise (EngineOOM(message) if oom else EngineCrashed(message)) from exc
        for gen in mine.values():
            if gen.rejected is not None:
                errors[gen.index] = admission_error(batch[gen.index], gen.rejected, self.settings.max_model_len)
        return {g.index: g for g in mine.values() if g.rejected is None}, errors, time.perf_counter() - t0

    def _build_or_raise(self) -> None:
        try:
            self._build()
        except OcrqError:
            raise
        except Exception as exc:
            self._teardown()
            oom = is_oom(exc)
            message = f"vLLM rebuild failed: {type(exc).__name__}: {str(exc)[:300]}"
            raise (EngineOOM(message) if oom else EngineCrashed(message)) from exc

    def _render_current(self, request: OcrRequest) -> tuple[Any, Any]:
        """(the LLM it was rendered for, the rendered request); (None, None) before a build."""
        llm = self._llm
        return (llm, None) if llm is None else (llm, self._render(llm, request))

    def _render(self, llm: Any, request: OcrRequest) -> Any:
        """The chat request as vLLM's renderer makes it for ``LLM.chat`` (same template path
        as the OpenAI server), i.e. token ids plus processed multimodal inputs."""
        image = request.image if request.image.mode == "RGB" else request.image.convert("RGB")
        messages = image_messages(request, self.version, {"type": "image_pil", "image_pil": image})
        (engine_input,) = llm._preprocess_chat([messages])  # LLM.chat's own renderer (0.26 and 0.32)
        return engine_input
