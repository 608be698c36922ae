"""Greedy decoding for HunYuanVL over a preallocated KV cache, optionally replayed as one CUDA graph.

Why: HF ``generate`` runs the model's modules from Python at every decode step (17–21 ms per
step measured on an H200, at batch 1 and 64). Here one step (embed → 24 layers → lm_head →
repetition penalty → argmax → bookkeeping) reads and writes only fixed-address tensors, with
positions and the write slot held on the device, so the whole step is captured once per batch
shape and replayed.

A replayed step is then bound by its kernel count (~2-3 µs each on an H200), so the step is
written lean: 631 kernels per step, not the 1,595 of the HF modules (H200 profile,
``bench/profile_engine.py``). One GEMM for q/k/v and one for gate/up (``fuse_projections`` makes
the HF parameters views into one buffer, so the prefill's HF modules and this step share the
weights and memory does not grow); RoPE and the q/k RMSNorm on q and k together; torch's fused
RMSNorm; one additive mask per step (0 visible, −inf not) rather than a bool mask each layer
converts.

The arithmetic is HF's: RoPE in fp32 with cos/sin rounded to the model dtype, RMSNorm statistics
in fp32 rounded before the weight, GQA attention over the valid slots. In fp32 on the CPU it
equals the HF forward; in bf16 on CUDA the fused norm may round one ulp apart. During decode
every XD-RoPE axis carries the same text position, so the rotation is plain 1D RoPE with the
checkpoint's ``inv_freq``.

Rows never see each other: padding is masked per row, positions are per row, and finished rows
keep computing (their extra tokens are dropped by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F


def fuse_projections(model: Any) -> None:
    """Give every decoder layer one q/k/v weight and one gate/up weight: the HF parameters become
    views into the fused buffers (same values, same memory). Also the q/k norm weight per head
    (q's for each q head, then k's for each KV head) the step applies to q and k at once.
    Made once per model (idempotent), not per batch."""
    for layer in model.model.language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(attn, "ocrq_qkv"):
            continue
        heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
        attn.ocrq_qk_norm = torch.cat([attn.query_layernorm.weight.data.expand(heads, -1),
                                       attn.key_layernorm.weight.data.expand(kv, -1)])
        for owner, names, fused in ((attn, ("q_proj", "k_proj", "v_proj"), "ocrq_qkv"),
                                    (mlp, ("gate_proj", "up_proj"), "ocrq_gate_up")):
            mods = [getattr(owner, n) for n in names]
            weight = torch.cat([m.weight.data for m in mods])
            bias = torch.cat([m.bias.data for m in mods]) if mods[0].bias is not None else None
            at = 0
            for m in mods:
                n = m.weight.shape[0]
                m.weight.data = weight[at:at + n]
                if bias is not None:
                    m.bias.data = bias[at:at + n]
                at += n
            setattr(owner, fused, (weight, bias))


@dataclass
class _Layer:
    """One decoder layer's tensors as the lean step uses them."""

    ln_in: torch.Tensor
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    qk_norm: torch.Tensor  # (heads + kv_heads, head_dim): the q norm's weight per q head, then k's
    o_proj: Any
    ln_post: torch.Tensor
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    act: Any
    down: Any


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: statistics in fp32, normalised value rounded to the input dtype, then × weight,
    in one fused kernel (torch's rms_norm computes a bf16 input in fp32 and rounds once). Bit for
    bit HF's on the CPU; on CUDA its reduction order differs, so a value may round one bf16 ulp
    apart (tests/gpu). Each row is reduced on its own, whatever the batch."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


class StaticDecoder:
    """Decode state for one micro-batch: ``batch`` rows, a prompt of ``prompt_len`` (left-padded)
    slots and up to ``max_new`` generated tokens."""

    def __init__(
        self,
        model: Any,
        batch: int,
        prompt_len: int,
        max_new: int,
        *,
        repetition_penalty: float = 1.0,
        topk: int = 0,
    ) -> None:
        lm = model.model.language_model
        cfg = lm.config
        self.model, self.lm = model, lm
        fuse_projections(model)
        self.layers = [self._lean(layer) for layer in lm.layers[: cfg.num_hidden_layers]]
        self.eps = float(cfg.rms_norm_eps)
        self.batch, self.prompt_len, self.max_new = batch, prompt_len, max_new
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.penalty, self.topk = float(repetition_penalty), int(topk)
        weight = lm.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        # rounded up: fewer distinct graph shapes, aligned rows for the attention kernels
        self.slots = -(-(prompt_len + max_new) // 64) * 64
        self.inv_freq = lm.rotary_emb.inv_freq.to(self.device, torch.float32)
        self.attention_scaling = float(getattr(lm.rotary_emb, "attention_scaling", 1.0))
        dev = self.device
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.mask = torch.full((batch, self.slots), float("-inf"), dtype=self.dtype, device=dev)
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self.step_idx = torch.zeros((), dtype=torch.long, device=dev)
        self.out = torch.zeros(batch, max_new, dtype=torch.long, device=dev)
        vocab = model.lm_head.weight.shape[0]
        self.seen = torch.zeros(batch, vocab if self.penalty != 1.0 else 1, dtype=torch.bool, device=dev)
        self.top_ids = torch.zeros(batch, max_new, max(self.topk, 1), dtype=torch.long, device=dev)
        self.top_lp = torch.zeros(batch, max_new, max(self.topk, 1), dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    # ----------------------------------------------------------------------------------------
    # state from the prefill
    # ----------------------------------------------------------------------------------------

    def load_rows(self, cache: Any, rows: slice, start: int, attention_mask: torch.Tensor) -> None:
        """Copy one prefill chunk's KV (HF DynamicCache of rows ``rows``, prompt slots ``start`` ..
        ``prompt_len``, left-padded) into the static cache, freeing each dynamic layer as it goes.
        Chunks may come in any order; ``finish_prefill`` follows the last one."""
        if not self.k_cache:
            # zeroed: padding slots and unwritten decode slots are masked, but 0 · NaN is not 0
            shape = (self.batch, self.kv_heads, self.slots, self.head_dim)
            for _ in self.layers:
                self.k_cache.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
                self.v_cache.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
        keep = attention_mask.bool()[:, None, :, None]
        for i, layer in enumerate(cache.layers[: len(self.layers)]):
            self.k_cache[i][rows, :, start: self.prompt_len] = torch.where(keep, layer.keys, 0)
            self.v_cache[i][rows, :, start: self.prompt_len] = torch.where(keep, layer.values, 0)
            layer.keys, layer.values = None, None

    def finish_prefill(self, attention_mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """After every row's chunk is loaded: the prompt slots' mask and the next positions."""
        self.mask.fill_(float("-inf"))
        self.mask[:, : self.prompt_len].masked_fill_(attention_mask.bool(), 0.0)
        self.pos.copy_(next_pos)
        self.step_idx.zero_()

    def seed_seen(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Repetition penalty history: the row's own prompt tokens (never the padding)."""
        if self.penalty == 1.0:
            return
        valid = attention_mask.bool()
        self.seen.zero_()
        self.seen.scatter_(1, torch.where(valid, input_ids, input_ids.new_zeros(())), True)
        # every padding slot scattered id 0: keep it only where a real token is 0
        self.seen[:, 0] = ((input_ids == 0) & valid).any(dim=1)

    # ----------------------------------------------------------------------------------------
    # one token
    # ----------------------------------------------------------------------------------------

    def select(self, logits: torch.Tensor) -> None:
        """Pick the next token from fp32 logits (B, V) and record it at ``step_idx``."""
        if self.topk:
            lp = torch.log_softmax(logits, dim=-1)
            vals, ids = lp.topk(self.topk, dim=-1)
            self.top_lp.index_copy_(1, self.step_idx.view(1), vals[:, None, :])
            self.top_ids.index_copy_(1, self.step_idx.view(1), ids[:, None, :])
        if self.penalty != 1.0:
            # HF RepetitionPenaltyLogitsProcessor: divide positive logits, multiply negative ones
            penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
            logits = torch.where(self.seen, penalised, logits)
        nxt = logits.argmax(dim=-1)
        if self.penalty != 1.0:
            self.seen.scatter_(1, nxt[:, None], True)
        self.out.index_copy_(1, self.step_idx.view(1), nxt[:, None])
        self.tok.copy_(nxt)

    def _lean(self, layer: Any) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(layer.input_layernorm.weight, attn.ocrq_qkv, attn.ocrq_qk_norm, attn.o_proj,
                      layer.post_attention_layernorm.weight, mlp.ocrq_gate_up, mlp.act_fn, mlp.down_proj)

    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin for this step's positions, (B, 1, head_dim) fp32, rounded to the
        model dtype first as HF's rotary embedding does. ``rotate_half(x) · sin`` equals
        ``roll(x, hd/2) · signed_sin`` exactly (a sign flip is exact), one kernel fewer than a cat."""
        freqs = self.pos[:, None, None].float() * self.inv_freq  # (B, 1, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype).float()
        sin = (emb.sin() * self.attention_scaling).to(self.dtype).float()
        half = self.head_dim // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def step(self) -> None:
        """Feed ``tok`` at ``pos``; write its KV to slot ``prompt_len + step_idx``; select the next."""
        bsz, slot = self.batch, (self.step_idx + self.prompt_len).view(1)
        heads, kv, hd, eps = self.heads, self.kv_heads, self.head_dim, self.eps
        self.mask.index_fill_(1, slot, 0.0)
        mask = self.mask[:, None, None, :]
        cos, sin = self._rope()
        x = self.lm.embed_tokens(self.tok)  # (B, hidden)
        for i, ly in enumerate(self.layers):
            qkv = F.linear(_norm(x, ly.ln_in, eps), *ly.qkv).view(bsz, heads + 2 * kv, hd)
            qk = qkv[:, : heads + kv].float()  # RoPE in fp32, q and k heads together
            qk = (qk * cos + qk.roll(hd // 2, dims=-1) * sin).to(self.dtype)
            qk = _norm(qk, ly.qk_norm, eps)  # per head: the q norm's weight, then the k norm's
            self.k_cache[i].index_copy_(2, slot, qk[:, heads:, None, :])
            self.v_cache[i].index_copy_(2, slot, qkv[:, heads + kv:, None, :])
            # GQA with one query: fold the heads of a KV group into the query axis (head h uses
            # KV head h // groups, as HF's repeat_kv) so no repeated K/V copy is ever made
            a = F.scaled_dot_product_attention(
                qk[:, :heads].reshape(bsz, kv, heads // kv, hd),
                self.k_cache[i], self.v_cache[i], attn_mask=mask, scale=self.scaling,
            )
            x = x + ly.o_proj(a.reshape(bsz, heads * hd))
            gate, up = F.linear(_norm(x, ly.ln_post, eps), *ly.gate_up).chunk(2, dim=-1)
            x = x + ly.down(ly.act(gate) * up)
        logits = self.model.lm_head(_norm(x, self.lm.norm.weight, eps)).float()
        self.pos.add_(1)
        self.step_idx.add_(1)
        self.select(logits)

    # ----------------------------------------------------------------------------------------
    # CUDA graph
    # ----------------------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture ``step`` as a CUDA graph (after ``finish_prefill``). The warm-up step runs for real,
        so the small per-row state is snapshot and restored around it; the KV slot it writes is
        rewritten before it is ever read."""
        saved = [t.clone() for t in (self.mask, self.tok, self.pos, self.step_idx, self.seen)]
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip((self.mask, self.tok, self.pos, self.step_idx, self.seen), saved, strict=True):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        for t, s in zip((self.mask, self.tok, self.pos, self.step_idx, self.seen), saved, strict=True):
            t.copy_(s)

    def advance(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()

    def release(self) -> None:
        self.graph = None
        self.k_cache.clear()
        self.v_cache.clear()
