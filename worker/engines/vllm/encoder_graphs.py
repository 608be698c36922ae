"""HunyuanOCR's vision tower under vLLM's encoder CUDA graphs (``engine.vision_cuda_graphs``).

vLLM 0.26 can replay a vision encoder as CUDA graphs (``compilation_config.cudagraph_mm_encoder``,
``EncoderCudaGraphManager``) for models that implement ``SupportsEncoderCudaGraph``: Qwen-VL,
InternVL, GLM-4.1V and others, not ``hunyuan_vision``. On the H200 vLLM's engine core is
CPU-bound and ~30 % of its main thread launched the tower's kernels, page by page and layer by
layer (docs/bench/gpu-vllm.md). This module gives ``HunYuanVLForConditionalGeneration`` that
protocol, so the 27 layers of a page are one graph replay.

How a page runs (vLLM's manager does the packing, budgets and capture; this is the model side):
- A graph is captured per token budget T (output tokens, as the manager counts them). It holds
  ``4 T`` patches: a page of h×w patches gives (h/2)(w/2+1)+2 output tokens, so ≥ hw/4.
- Inputs copied in before a replay: the page's pixel patches and its interpolated position
  embeddings (computed eagerly, as vLLM does, they depend on the grid), zero-padded to 4T rows,
  and ``cu_seqlens`` = [0, n₁, …, n_k, …, 4T]: each page attends to itself, and the padding rows
  form one last sequence of their own (attention never mixes them into a page; FlashAttention's
  varlen kernel and the CPU's per-sequence SDPA both see every row in some sequence).
- The graph: patch embedding (a conv over the padded rows), + positions, the 27 layers.
- After it, eagerly per page: the patch merger (``perceive``), whose shapes depend on the grid.
- ocrq asks for one page per graph (``encoder_cudagraph_max_vision_items_per_batch`` 1): a page's
  graph is chosen by its own size alone, so its result cannot depend on the other pages of the
  step (the batch invariant). A page above the largest budget runs vLLM's eager tower.

Installed by the plugin (``worker/engines/vllm/plugin.py``) in every vLLM process; inert unless
the engine's compilation config turns encoder graphs on, which ``compilation_config`` below does.

Measured on the H200 (docs/bench/gpu-vllm.md, 2026-12-04): the captured graphs give what
vLLM's eager tower gives (0.0000 in bf16), the tower's share of the engine core's main thread fell
from 35-38 % to 4 %, but img/s did not follow (1.10× and 0.97× on two machines) and the graphs cost
~18k KV tokens at 24 GiB: opt-in (``engine.vision_cuda_graphs``). The engine alone, all pages
queued at once (2026-12-04): 20.31 img/s with graphs, 20.26 without.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

_PATCHED_ATTR = "__ocrq_encoder_graphs__"
#: patches a graph holds per output token of its budget (a page's output ≥ its patches / 4)
PATCHES_PER_TOKEN = 4
#: budgets grow by this factor: a page pads by ~5 % on average (up to 10 %) in the token-wise GEMMs
BUDGET_STEP = 1.1
#: the smallest budget: a 512×512 page (HunyuanOCR's default min_pixels) gives 16·17+2 = 274
MIN_BUDGET = 256

#: pages that went through a graph in this process (the GPU test reads it in vLLM's core)
stats = {"pages": 0}


def page_tokens(h: int, w: int, merge: int = 2) -> int:
    """Output tokens of a page of h×w patches: rows of (w/2 + newline), plus begin and end."""
    return (h // merge) * (w // merge + 1) + 2


def budgets(max_pixels: int, max_model_len: int, step: float = BUDGET_STEP, smallest: int = MIN_BUDGET) -> list[int]:
    """Token budgets to capture: geometric from ``smallest`` to the square page of ``max_pixels``
    (32-pixel units, as the processor resizes), capped by the context; multiples of 8."""
    side = max(1, math.isqrt(max_pixels) // 32)
    largest = min(side * (side + 1) + 2, max_model_len)
    out: list[int] = []
    b = float(min(smallest, largest))
    while b * (1 + (step - 1) / 2) < largest:  # none within half a step of the largest
        out.append(-(-int(b) // 8) * 8)
        b *= step
    out.append(largest)
    return sorted(set(out))


def compilation_config(max_pixels: int, max_model_len: int) -> dict[str, Any]:
    """vLLM ``compilation_config`` entries turning the encoder graphs on, one page per graph."""
    return {"cudagraph_mm_encoder": True,
            "encoder_cudagraph_token_budgets": budgets(max_pixels, max_model_len),
            "encoder_cudagraph_max_vision_items_per_batch": 1}


def install() -> bool:
    """Give vLLM's native HunyuanVL model the encoder-graph protocol (idempotent). Applied where
    ``compat`` lists it: releases with the native model (0.26), whose tower and encoder-graph
    manager this mirrors."""
    from worker.engines.vllm import compat

    model = compat.hunyuan_vision().HunYuanVLForConditionalGeneration
    if getattr(model, _PATCHED_ATTR, False):
        return True
    for name, fn in _METHODS.items():
        setattr(model, name, fn)
    model.supports_encoder_cudagraph = True
    setattr(model, _PATCHED_ATTR, True)
    return True


# -- the protocol's methods, bound to HunYuanVLForConditionalGeneration --------------------------

def _grids(mm_kwargs: dict[str, Any]) -> list[list[int]]:
    grid = mm_kwargs["image_grid_thw"]
    return [[int(v) for v in g] for g in (grid.tolist() if hasattr(grid, "tolist") else grid)]


def get_encoder_cudagraph_config(self: Any) -> Any:
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphConfig

    return EncoderCudaGraphConfig(
        modalities=["image"],
        buffer_keys=["pixel_values", "pos_embeds", "cu_seqlens", "max_seqlen"],
        padding_logics={"cu_seqlens": _pad_cu_seqlens},
        out_hidden_size=self.config.vision_config.out_hidden_size,
    )


def _pad_cu_seqlens(dst: Any, src: Any) -> None:
    """The pages' boundaries, then empty sequences up to the last entry, which keeps the
    captured capacity: the padding rows' own sequence. One copy from pinned host memory: a copy
    from pageable memory waits for the GPU to finish all queued work (on the H200 a quarter of
    the engine core's main thread waited here, once per page)."""
    import torch

    n = src.shape[0]
    if n < dst.shape[0] - 1:
        src = torch.cat([src, src[-1:].expand(dst.shape[0] - 1 - n)])
    if dst.is_cuda:
        src = src.pin_memory()
    dst[:-1].copy_(src, non_blocking=dst.is_cuda)


def get_input_modality(self: Any, mm_kwargs: dict[str, Any]) -> str:
    return "image"


def get_max_frames_per_video(self: Any) -> int:
    return 1


def get_encoder_cudagraph_budget_range(self: Any, vllm_config: Any) -> tuple[int, int]:
    """For vLLM's own power-of-two budgets (when not given): a 512² page up to the largest budget."""
    largest = min(vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len)
    return min(MIN_BUDGET, largest), largest


def get_encoder_cudagraph_item_specs(self: Any, mm_kwargs: dict[str, Any]) -> list[Any]:
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderItemSpec

    m = self.visual.spatial_merge_size
    return [EncoderItemSpec(input_size=h * w, output_tokens=page_tokens(h, w, m)) for _, h, w in _grids(mm_kwargs)]


def select_encoder_cudagraph_items(self: Any, mm_kwargs: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    import torch

    grids = _grids(mm_kwargs)
    pixels = mm_kwargs["pixel_values"]
    starts = list(accumulate((h * w for _, h, w in grids), initial=0))
    parts = [pixels[starts[i]:starts[i + 1]] for i in indices]
    selected = parts[0] if len(parts) == 1 else (torch.cat(parts) if parts else pixels[:0])
    return {"pixel_values": selected, "image_grid_thw": [grids[i] for i in indices]}


def prepare_encoder_cudagraph_capture_inputs(
    self: Any, token_budget: int, max_batch_size: int, max_frames_per_batch: int, device: Any, dtype: Any,
    path: str = "default",
) -> Any:
    import torch
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphCaptureInputs

    rows = PATCHES_PER_TOKEN * token_budget
    step = rows // (max_batch_size + 1)  # any valid boundaries: the graph reads them from the buffer
    cu = [min(i * step, rows) for i in range(max_batch_size + 1)] + [rows]
    pixels, pos = _shared_inputs(self, rows, device, dtype)
    return EncoderCudaGraphCaptureInputs(values={
        "pixel_values": pixels,
        "pos_embeds": pos,
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32, device=device),
        # read once at capture (FlashAttention's grid): the longest a sequence may be
        "max_seqlen": torch.tensor(rows, dtype=torch.int32),
    })


def _shared_inputs(model: Any, rows: int, device: Any, dtype: Any) -> tuple[Any, Any]:
    """Views of the first ``rows`` of one pixel and one position buffer that every budget's graph
    shares: the graphs replay one at a time on one stream, and vLLM captures the largest budget
    first. Apart, the 30 default budgets' inputs hold 619 MB of device memory; shared, 60 MB
    (the KV cache gets the rest: on the H200 the graphs' memory cost ~18k KV tokens before this)."""
    import torch

    key = (str(device), dtype)
    held = getattr(model, "_ocrq_graph_inputs", None)
    if held is None or held[0] != key or held[1].shape[0] < rows:
        e = model.visual.embeddings
        held = (key, torch.zeros(rows, e.num_channels * e.patch_size**2, device=device, dtype=dtype),
                torch.zeros(rows, e.embed_dim, device=device, dtype=dtype))
        model._ocrq_graph_inputs = held
    return held[1][:rows], held[2][:rows]


def prepare_encoder_cudagraph_replay_buffers(
    self: Any, mm_kwargs: dict[str, Any], max_batch_size: int, max_frames_per_batch: int, path: str = "default",
) -> Any:
    import torch
    from vllm.v1.worker.encoder_cudagraph_defs import EncoderCudaGraphReplayBuffers

    grids = _grids(mm_kwargs)
    pixels = mm_kwargs["pixel_values"]
    dtype = self.visual.dtype
    pos = [_position_embedding(self.visual.embeddings, h, w, dtype) for _, h, w in grids]
    cu = torch.tensor(list(accumulate((h * w for _, h, w in grids), initial=0)), dtype=torch.int32)
    return EncoderCudaGraphReplayBuffers(values={
        "pixel_values": pixels.to(device=self.visual.device, dtype=dtype),
        "pos_embeds": pos[0] if len(pos) == 1 else torch.cat(pos),
        "cu_seqlens": cu,
        "max_seqlen": None,
    })


def _position_embedding(e: Any, h: int, w: int, dtype: Any) -> Any:
    """``HunYuanVisionPatchEmbed.forward``'s position embedding for one h×w grid, (h·w, D)."""
    import torch.nn.functional as F  # noqa: N812

    if e.patch_pos_embed is None:
        e.patch_pos_embed = (e.position_embedding.weight[1:, :]
                             .reshape(1, e.position_edge, e.position_edge, e.embed_dim).permute(0, 3, 1, 2).float())
    h0, w0 = h + 0.1, w + 0.1  # vLLM's (and DINO's) guard against rounding in the interpolation
    pos = F.interpolate(e.patch_pos_embed, scale_factor=(h0 / e.position_edge, w0 / e.position_edge),
                        mode=e.interpolate_mode, align_corners=False)
    return pos.reshape(e.embed_dim, -1).transpose(0, 1).to(dtype)


def encoder_cudagraph_forward(self: Any, inputs: dict[str, Any], path: str = "default") -> Any:
    """What the graph records: patch embedding of every row, + positions, the layers."""
    from worker.engines.vllm.vision import _block

    e = self.visual.embeddings
    x = inputs["pixel_values"]
    rows = x.size(0)
    h = e.patch_embedding(x.reshape(rows, e.num_channels, e.patch_size, e.patch_size)).reshape(1, rows, -1)
    h = h + inputs["pos_embeds"].unsqueeze(0)
    for layer in self.visual.layers:
        h = _block(layer, h, inputs["cu_seqlens"], inputs["max_seqlen"])
    return h.squeeze(0)


def postprocess_encoder_output(
    self: Any, output: Any, indices: list[int], per_item_out_tokens: list[int], dest: Any, clone: bool = False,
    batch_mm_kwargs: dict[str, Any] | None = None, local_output: Any = None,
) -> None:
    """Each page's rows through the patch merger (eager: its shapes follow the grid)."""
    assert batch_mm_kwargs is not None
    grids = _grids(batch_mm_kwargs)
    start = 0
    for i, (_, h, w) in zip(indices, grids, strict=True):
        rows = output[start:start + h * w].unsqueeze(0)
        dest[i] = self.visual.perceive(rows.contiguous(), size=(h, w)).squeeze(0)
        start += h * w
    stats["pages"] += len(indices)


def encoder_eager_forward(self: Any, mm_kwargs: dict[str, Any], path: str = "default") -> Any:
    """A page above the largest budget: vLLM's own tower, its pages' outputs end to end."""
    import torch

    return torch.cat(self.visual(mm_kwargs["pixel_values"], _grids(mm_kwargs)), dim=0)


_METHODS = {f.__name__: f for f in (
    get_encoder_cudagraph_config, get_input_modality, get_max_frames_per_video, get_encoder_cudagraph_budget_range,
    get_encoder_cudagraph_item_specs, select_encoder_cudagraph_items, prepare_encoder_cudagraph_capture_inputs,
    prepare_encoder_cudagraph_replay_buffers, encoder_cudagraph_forward, postprocess_encoder_output,
    encoder_eager_forward)}
