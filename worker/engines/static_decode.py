"""Greedy decoding for HunYuanVL over a preallocated KV cache, optionally replayed as one CUDA graph.

Why: HF ``generate`` launches ~600 small kernels per decode step from Python (~65 ms/step on an
H200 at any batch). Here one step (embed → 24 layers → lm_head → repetition penalty → argmax →
bookkeeping) reads and writes only fixed-address tensors, with positions and the write slot held
on the device, so the whole step is captured once per batch shape and replayed.

The step reuses the model's own modules (projections, norms, MLPs, lm_head) and reproduces the
HF attention math: RoPE in fp32 with cos/sin rounded to the model dtype, then q/k RMSNorm, GQA
attention over the valid slots. During decode every XD-RoPE axis carries the same text position,
so the rotation is plain 1D RoPE with the checkpoint's ``inv_freq``.

Rows never see each other: padding is excluded by a per-row validity mask, positions are per row,
and finished rows keep computing (their extra tokens are dropped by the caller).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def _rms(module: Any, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module(x)
    return out


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
        self.layers = list(lm.layers[: cfg.num_hidden_layers])
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
        self.valid = torch.zeros(batch, self.slots, dtype=torch.bool, device=dev)
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
        """After every row's chunk is loaded: validity of the prompt slots and the next positions."""
        self.valid.zero_()
        self.valid[:, : self.prompt_len] = attention_mask.bool()
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

    def _rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = self.pos[:, None, None].float() * self.inv_freq  # (B, 1, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        return cos[:, None].float(), sin[:, None].float()  # (B, 1, 1, hd), fp32 as HF applies it

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        xf = x.float()
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def step(self) -> None:
        """Feed ``tok`` at ``pos``; write its KV to slot ``prompt_len + step_idx``; select the next."""
        bsz, slot = self.batch, (self.step_idx + self.prompt_len).view(1)
        self.valid.index_fill_(1, slot, True)
        mask = self.valid[:, None, None, :]
        cos, sin = self._rope()
        x = self.lm.embed_tokens(self.tok)[:, None, :]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms(layer.input_layernorm, x)
            q = attn.q_proj(h).view(bsz, 1, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(bsz, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(bsz, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            q = _rms(attn.query_layernorm, self._rotate(q, cos, sin))
            k = _rms(attn.key_layernorm, self._rotate(k, cos, sin))
            self.k_cache[i].index_copy_(2, slot, k)
            self.v_cache[i].index_copy_(2, slot, v)
            # GQA with one query: fold the heads of a KV group into the query axis (head h uses
            # KV head h // groups, as HF's repeat_kv) so no repeated K/V copy is ever made
            a = F.scaled_dot_product_attention(
                q.reshape(bsz, self.kv_heads, self.heads // self.kv_heads, self.head_dim),
                self.k_cache[i], self.v_cache[i], attn_mask=mask, scale=self.scaling,
            )
            x = x + attn.o_proj(a.reshape(bsz, 1, self.heads * self.head_dim))
            x = x + layer.mlp(_rms(layer.post_attention_layernorm, x))
        hidden = _rms(self.lm.norm, x)
        logits = self.model.lm_head(hidden[:, 0]).float()
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
        saved = [t.clone() for t in (self.valid, self.tok, self.pos, self.step_idx, self.seen)]
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, s in zip((self.valid, self.tok, self.pos, self.step_idx, self.seen), saved, strict=True):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self.graph = graph
        for t, s in zip((self.valid, self.tok, self.pos, self.step_idx, self.seen), saved, strict=True):
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
