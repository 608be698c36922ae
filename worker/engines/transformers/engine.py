"""HunyuanOCR through transformers: batched greedy OCR on one device (bf16 CUDA, fp32 CPU).

One micro-batch = one left-padded prompt per image (each image has its own task and prompt),
a prefill (vision tower + text) in chunks of rows of at most ``engine.max_num_batched_tokens``
prompt tokens (so the activation peak does not grow with the batch; the KV cache is what does),
then greedy decoding over the whole batch. Decoding modes
(``settings.extra["decode"]``):

- ``"hf"``: the HF model forward per step over a DynamicCache (the reference path);
- ``"static"``: ``StaticDecoder`` step over a preallocated KV cache, no graph (CPU-friendly);
- ``"graph"``: the same step captured once per batch as a CUDA graph and replayed;
- ``"auto"`` (default): ``graph`` on CUDA, ``hf`` on CPU.

Batch invariance: every row gets its own multimodal RoPE positions (transformers numbers images
across the whole batch, which would make an image's positions depend on its row), padding is
masked and excluded from the repetition-penalty history, and stop rules are evaluated per row.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.engine_settings import TransformersSettings
from ocrq.errors import BadRequest, EngineCrashed, EngineOOM, OcrqError, classify
from ocrq.results import OcrOutput
from worker.engines import hunyuan
from worker.engines.base import ImageCost, MemorySample, OcrRequest
from worker.engines.weights import weights_revision

#: PyTorch CUDA allocator settings the engine asks for unless the environment sets its own
ALLOC_CONF = "expandable_segments:True"

#: how many decode steps run between host-side checks of the stop rules (no sync in between)
CHECK_EVERY = 16


@dataclass
class _Row:
    tokens: list[int]
    stop_reason: str
    generated: int
    repetition: hunyuan.Repetition | None = None


class TransformersEngine:
    name = "transformers"

    def __init__(self, settings: TransformersSettings) -> None:
        if settings.model_dir is None:
            raise ValueError("the transformers engine needs engine.model_dir")
        self.settings = settings
        self.model_dir = Path(settings.model_dir)
        self.version = hunyuan.version_of(settings)
        self.sampling = hunyuan.SAMPLING[self.version]
        self.ignore_eos = bool(settings.extra.get("ignore_eos", False))
        self.model: Any = None
        self.processor: Any = None
        self.device: Any = None
        self.decode_mode = str(settings.extra.get("decode", "auto"))
        self._eos: set[int] = set()
        self._revision: str | None = None
        self._weight_bytes: int | None = None

    # ------------------------------------------------------------------------------------------
    # Engine protocol
    # ------------------------------------------------------------------------------------------

    @property
    def revision(self) -> str:
        if self._revision is None:
            self._revision = weights_revision(self.model_dir, self.version)
        return self._revision

    def start(self) -> None:
        import torch
        from transformers import HunYuanVLForConditionalGeneration

        s = self.settings
        want = s.device if s.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(want)
        if self.device.type == "cuda":
            # batches of changing shapes fragment the caching allocator's fixed segments: memory
            # reserved but unusable, which the governor (planning on allocated bytes) cannot
            # see. Growable segments keep reserved ≈ allocated. Read when CUDA first allocates,
            # so an operator's own setting (or an earlier CUDA user in the process) wins.
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
        if s.dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            dtype = getattr(torch, s.dtype)
        self.processor = hunyuan.load_processor(self.model_dir, s.min_pixels, s.max_pixels)
        model = HunYuanVLForConditionalGeneration.from_pretrained(
            str(self.model_dir), dtype=dtype, attn_implementation="sdpa"
        )
        self.model = model.to(self.device).eval()
        from worker.engines.transformers.static_decode import fuse_projections

        fuse_projections(self.model)  # before the weights are measured; memory-neutral
        if self.device.type == "cuda":
            self._weight_bytes = torch.cuda.memory_allocated(self.device)
        eos = self.model.generation_config.eos_token_id
        self._eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.decode_mode == "auto":
            self.decode_mode = "graph" if self.device.type == "cuda" else "hf"
        if self.decode_mode == "graph" and self.device.type != "cuda":
            self.decode_mode = "static"  # graphs need CUDA; the same step runs eagerly
        if self.decode_mode not in ("hf", "static", "graph"):
            raise ValueError(f"extra.decode must be auto|hf|static|graph, not {self.decode_mode!r}")
        _ = self.revision

    @property
    def memory_profile(self) -> Any:
        """``worker.memory.costs.ModelProfile`` for the governor: weights as loaded (measured on CUDA),
        KV bytes/token from the config, ``padded`` (a batch's prompts are padded to the longest
        and its KV cache holds prompt + max_new_tokens slots for every row)."""
        from worker.memory.costs import ModelProfile

        cfg = json.loads((self.model_dir / "config.json").read_text(encoding="utf-8"))
        dtype_bytes = 4 if self.device is not None and self.device.type == "cpu" else 2
        return ModelProfile.from_hf_config(cfg, dtype_bytes, weight_bytes=self._weight_bytes, padded=True)

    def cost(self, request: OcrRequest) -> ImageCost:
        return hunyuan.cost(request, self.settings)

    def infer(self, batch: Sequence[OcrRequest]) -> list[OcrOutput | OcrqError]:
        outcomes: list[OcrOutput | OcrqError | None] = [None] * len(batch)
        ready: list[tuple[int, str]] = []
        for i, req in enumerate(batch):
            try:
                ready.append((i, self._prompt_text(req)))
            except (ValueError, KeyError, TypeError) as exc:
                outcomes[i] = BadRequest(f"{req.key}: {exc}")
        if ready:
            reqs = [batch[i] for i, _ in ready]
            rows, info = self._guarded(lambda: self._generate(reqs, [t for _, t in ready]))
            for (i, _), req, row in zip(ready, reqs, rows, strict=True):
                outcomes[i] = self._output(req, row, info)
        return [o if o is not None else EngineCrashed("no outcome") for o in outcomes]

    def memory(self) -> MemorySample:
        import torch

        if self.device is None or self.device.type != "cuda":
            return MemorySample()
        return MemorySample(
            allocated=torch.cuda.memory_allocated(self.device),
            reserved=torch.cuda.memory_reserved(self.device),
            peak=torch.cuda.max_memory_allocated(self.device),
        )

    def reset_peak(self) -> None:
        import torch

        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def close(self) -> None:
        self.model = None
        self.processor = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover
            pass

    # ------------------------------------------------------------------------------------------
    # tests and benchmarks
    # ------------------------------------------------------------------------------------------

    def topk_logprobs(
        self, requests: Sequence[OcrRequest], k: int, steps: int, decode: str | None = None
    ) -> list[list[list[tuple[int, float]]]]:
        """Per image, per decode step: the top-``k`` (token id, logprob) of the raw model output,
        decoding greedily for exactly ``steps`` tokens (no stop rules)."""
        texts = [self._prompt_text(r) for r in requests]
        (rows, info) = self._guarded(
            lambda: self._generate(requests, texts, topk=k, max_new=steps, stops=False, decode=decode)
        )
        ids, lps = info["topk"]
        return [[list(zip(ids[b][t], lps[b][t], strict=True)) for t in range(steps)]
                for b in range(len(rows))]

    # ------------------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------------------

    def _guarded(self, fn: Any) -> Any:
        """Run a batch; CUDA OOM becomes EngineOOM after the cache is emptied, anything else
        that is not already an OcrqError becomes EngineCrashed (never mistaken for OOM)."""
        import torch

        if self.model is None:
            raise EngineCrashed("engine not started")
        oom: str | None = None
        try:
            return fn()
        except torch.cuda.OutOfMemoryError as exc:
            oom = str(exc).splitlines()[0][:300]
        except OcrqError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped onto the error tree
            raise classify(exc) from exc
        # outside the except block: the traceback (and the tensors its frames hold) is gone
        gc.collect()
        torch.cuda.empty_cache()
        raise EngineOOM(oom)

    def _prompt_text(self, req: OcrRequest) -> str:
        messages = hunyuan.build_messages(req.task, req.params, self.version)
        return str(self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    def _max_new(self, req: OcrRequest) -> int:
        return max(1, int(req.params.get("max_new_tokens", self.settings.max_new_tokens)))

    def _encode(self, reqs: Sequence[OcrRequest], texts: list[str]) -> Any:
        import torch

        from worker.engines.transformers.inputs import encode_batch

        images = [r.image.convert("RGB") if r.image.mode != "RGB" else r.image for r in reqs]
        if self.settings.extra.get("preprocess", "device") == "processor":
            enc = dict(self.processor(text=texts, images=images, padding=True, padding_side="left",
                                      return_tensors="pt").to(self.device))
        else:  # same tensors, normalised on the device (see inputs.py)
            enc = encode_batch(self.processor, texts, images, self.device)
        # per-row multimodal positions: image index 0 in every row, as when the image runs alone
        core = self.model.model
        pos = [
            core.get_rope_index(
                enc["input_ids"][b:b + 1], mm_token_type_ids=enc["mm_token_type_ids"][b:b + 1],
                image_grid_thw=enc["image_grid_thw"][b:b + 1], attention_mask=enc["attention_mask"][b:b + 1],
            )[0]
            for b in range(len(reqs))
        ]
        enc["position_ids"] = torch.cat(pos, dim=1)
        enc["pixel_values"] = enc["pixel_values"].to(self.model.dtype)
        return enc

    def _generate(
        self, reqs: Sequence[OcrRequest], texts: list[str], *, topk: int = 0, max_new: int | None = None,
        stops: bool = True, decode: str | None = None,
    ) -> tuple[list[_Row], dict[str, Any]]:
        import torch

        from worker.engines.transformers.prefill import join_caches, prefill
        from worker.engines.transformers.static_decode import StaticDecoder

        mode = decode or self.decode_mode
        if mode == "graph" and self.device.type != "cuda":
            mode = "static"
        limits = [max_new or self._max_new(r) for r in reqs]
        steps = max(limits)
        penalty = float(reqs[0].params.get("repetition_penalty", self.sampling.repetition_penalty))
        t0 = time.perf_counter()
        with torch.inference_mode():
            enc = self._encode(reqs, texts)
            ids, mask, pos = enc["input_ids"], enc["attention_mask"], enc["position_ids"]
            bsz, plen = ids.shape
            dec = StaticDecoder(self.model, bsz, plen, steps, repetition_penalty=penalty, topk=topk)
            dec.seed_seen(ids, mask)
            logits, parts = prefill(self.model, enc, self.settings.max_num_batched_tokens,
                                    None if mode == "hf" else dec)
            next_pos = pos.amax(dim=(0, 2)) + 1
            dec.select(logits)
            del logits, enc
            cache: Any = None
            if mode == "hf":
                cache = join_caches(self.model, parts, plen)
            else:
                dec.finish_prefill(mask, next_pos)
                if mode == "graph":
                    dec.capture()
            self._sync()
            t1 = time.perf_counter()
            rows: list[_Row | None] = [None] * bsz
            hf_mask, hf_pos, done_steps = mask, next_pos.clone(), 1
            for step in range(1, steps):
                if mode == "hf":
                    hf_mask = torch.cat([hf_mask, hf_mask.new_ones(bsz, 1)], dim=1)
                    o = self.model(input_ids=dec.tok[:, None], attention_mask=hf_mask,
                                   position_ids=hf_pos.view(1, bsz, 1).expand(4, bsz, 1),
                                   past_key_values=cache, use_cache=True)
                    hf_pos += 1
                    dec.step_idx += 1
                    dec.select(o.logits[:, -1].float())
                else:
                    dec.advance()
                done_steps = step + 1
                if stops and done_steps % CHECK_EVERY == 0:
                    self._settle(rows, dec.out[:, :done_steps].tolist(), limits, final=False)
                    if all(r is not None for r in rows):
                        break
            tokens = dec.out[:, :done_steps].tolist()
            self._settle(rows, tokens, limits, final=True, stops=stops)
            info: dict[str, Any] = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1,
                                    "steps": done_steps, "batch": bsz, "prompt_len": plen, "decode": mode,
                                    "prompt_tokens": mask.sum(dim=1).tolist()}
            if topk:
                info["topk"] = (dec.top_ids[:, :done_steps].tolist(), dec.top_lp[:, :done_steps].tolist())
            dec.release()
        return [r for r in rows if r is not None], info

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _settle(
        self, rows: list[_Row | None], tokens: list[list[int]], limits: list[int], *, final: bool,
        stops: bool = True,
    ) -> None:
        """Decide, per unfinished row, whether it has stopped: EOS, its own token limit, or a loop
        (``repetition_stop`` repeats of a short unit; the kept text ends with one copy of it)."""
        min_repeats = self.settings.repetition_stop
        for b, toks in enumerate(tokens):
            if rows[b] is not None:
                continue
            toks = toks[: limits[b]]
            if stops and not self.ignore_eos:
                cut = next((i for i, t in enumerate(toks) if t in self._eos), None)
                if cut is not None:
                    rows[b] = _Row(toks[:cut], "eos", cut + 1)
                    continue
            rep = hunyuan.detect_repetition(toks, min_repeats) if stops else None
            if rep is not None:
                need = max(min_repeats, -(-24 // rep.unit))
                start = len(toks) - rep.span  # the loop began here; it fired after `need` units
                rows[b] = _Row(toks[: start + rep.unit], "repetition", start + rep.unit * need, rep)
            elif len(toks) >= limits[b] or final:
                rows[b] = _Row(toks, "length", len(toks))

    def _output(self, req: OcrRequest, row: _Row, info: dict[str, Any]) -> OcrOutput:
        text = str(self.processor.tokenizer.decode(row.tokens, skip_special_tokens=True))
        meta: dict[str, Any] = {
            "generated_tokens": row.generated, "stop_reason": row.stop_reason,
            "repetition": {"unit": row.repetition.unit, "repeats": row.repetition.repeats}
            if row.repetition else None,
            "batch_size": info["batch"], "decode": info["decode"],
            "prefill_s": round(info["prefill_s"], 4), "decode_s": round(info["decode_s"], 4),
        }
        return hunyuan.build_output(req, text, engine=self.name, revision=self.revision,
                                    settings=self.settings, meta=meta)
