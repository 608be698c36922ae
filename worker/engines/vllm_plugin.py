"""vLLM general plugin: makes vLLM's Transformers backend run HunyuanOCR correctly.

vLLM calls ``register()`` in every one of its processes (API server, engine core, workers) through
the ``vllm.general_plugins`` entry point declared in pyproject.toml, so these fixes hold whether
the engine runs in-process or as ``vllm.entrypoints.openai.api_server``. Each fix is guarded,
idempotent, logged once, and deletable on its own when vLLM/transformers fix the cause:

1. ``pil_processor``: without torchvision, transformers refuses to hand out HunyuanVL's image
   processor; the PIL one works and is registered for ``HunYuanVLConfig``.
2. ``contiguous_merger``: vLLM's CPU matmul (``onednn_mm``) requires a contiguous input, but the
   HunyuanVL patch merger feeds its ``mlp`` a permuted view (``Expected a.stride(-1) == 1``).
3. ``split_fix``: the Transformers backend splits the concatenated vision output per image by raw
   patch count (grid_h*grid_w) instead of the tokens the HunyuanVL encoder emits per image
   ((gh/2)*(gw/2+1)+2), so in a batch of several images, images 2..N get other images'
   embeddings (only a warning is logged). We hand it the real per-image token counts.

Set ``OCRQ_VLLM_DISABLE_SPLIT_FIX=1`` to leave fix 3 out in every vLLM process (e.g. a server),
or flip ``split_fix.enabled`` in-process: the batch-invariance tests use both to prove the bug is
still there without the fix, so the invariance check keeps its teeth.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

# Under "vllm." so the lines show up with vLLM's own log handler in every vLLM process.
log = logging.getLogger("vllm.ocrq_plugin")

#: vLLM releases whose Transformers backend splits HunyuanVL embeddings by patch count (fix 3).
#: Checked against vllm 0.32.0 (vllm/model_executor/models/transformers/multimodal.py,
#: ``MultiModalMixin._process_vision_input``). Add a version only after the invariance test
#: (tests/integration/test_vllm_engine.py) fails on it without the fix.
SPLIT_BUG_VERSIONS = ("0.32.",)
#: vLLM releases whose CPU matmul rejects the merger's non-contiguous input (fix 2).
CONTIGUOUS_BUG_VERSIONS = ("0.32.",)
DISABLE_SPLIT_FIX_ENV = "OCRQ_VLLM_DISABLE_SPLIT_FIX"
_PATCHED_ATTR = "__ocrq_patched__"

#: names of the fixes applied in this process (for logs and tests)
applied: list[str] = []


class _Switch:
    enabled = True


#: fix 3 is consulted per call, so tests can compare both paths on one engine
split_fix = _Switch()


def register() -> None:
    """Entry point: apply every fix this process's vLLM needs (safe to call repeatedly)."""
    import vllm

    version = str(vllm.__version__)
    for name, fix in (
        ("pil_processor", _register_pil_processor),
        ("contiguous_merger", lambda: _contiguous_merger(version)),
        ("split_fix", lambda: _split_fix(version)),
    ):
        if name in applied:
            continue
        try:
            if fix():
                applied.append(name)
        except Exception:  # a broken fix must not take vLLM down; the tests catch the effect
            log.exception("ocrq vLLM plugin: fix %s failed", name)
    if applied:
        log.info("ocrq vLLM plugin (vllm %s): applied %s", version, ", ".join(applied))


def _register_pil_processor() -> bool:
    from transformers.utils import is_torchvision_available

    from worker.engines.hunyuan import ensure_pil_processor

    if is_torchvision_available():
        return False
    ensure_pil_processor()
    return True


def _contiguous_merger(version: str) -> bool:
    if not version.startswith(CONTIGUOUS_BUG_VERSIONS):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # CUDA GEMMs take strided inputs
        return False
    from transformers.models.hunyuan_vl import modeling_hunyuan_vl as hf

    merger = hf.HunYuanVLVisionPatchMerger
    if getattr(merger.forward, _PATCHED_ATTR, False):
        return True
    original = merger.forward

    def _contiguous_input(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0].contiguous(), *args[1:])

    def forward(self: Any, hidden_states: Any, size: tuple[int, int]) -> Any:
        # vLLM swaps ``self.mlp`` for its own linear after __init__, so hook it lazily here.
        if not getattr(self.mlp, "_ocrq_contiguous", False):
            self.mlp.register_forward_pre_hook(_contiguous_input)
            self.mlp._ocrq_contiguous = True
        return original(self, hidden_states, size)

    setattr(forward, _PATCHED_ATTR, True)
    merger.forward = forward  # type: ignore[method-assign]
    return True


def _split_fix(version: str) -> bool:
    if os.environ.get(DISABLE_SPLIT_FIX_ENV, "") not in ("", "0"):
        log.warning("ocrq vLLM plugin: %s set, HunyuanVL embedding split NOT fixed", DISABLE_SPLIT_FIX_ENV)
        split_fix.enabled = False
    if not version.startswith(SPLIT_BUG_VERSIONS):
        log.warning(
            "ocrq vLLM plugin: vllm %s is not a version checked for the HunyuanVL embedding-split bug "
            "(known bad: %s); if it serves HunYuanVL through the Transformers backend, run the "
            "batch-invariance test before trusting batched results (docs/gpu.md)",
            version, ", ".join(v + "x" for v in SPLIT_BUG_VERSIONS),
        )
        return False
    from vllm.model_executor.models.transformers.multimodal import MultiModalMixin

    if getattr(MultiModalMixin._process_image_input, _PATCHED_ATTR, False):
        return True
    original: Callable[..., Any] = MultiModalMixin._process_image_input

    def _process_image_input(self: Any, **kwargs: Any) -> Any:
        if split_fix.enabled and getattr(self.config, "model_type", None) == "hunyuan_vl":
            tokens = hunyuan_tokens_per_image(kwargs.get("image_grid_thw"), self.config)
            if tokens is not None and "num_image_patches" in kwargs:
                kwargs["num_image_patches"] = tokens
        return original(self, **kwargs)

    setattr(_process_image_input, _PATCHED_ATTR, True)
    MultiModalMixin._process_image_input = _process_image_input  # type: ignore[method-assign]
    return split_fix.enabled


def hunyuan_tokens_per_image(grid_thw: Any, config: Any) -> Any:
    """Embedding rows the HunyuanVL encoder emits per image, as a 1-D tensor (None if unknown).

    The patch merger pools ``merge``x``merge`` patches, appends one newline column per row and
    wraps the image in begin/end embeddings: (gh/m)*(gw/m + 1) + 2 for a grid (t, gh, gw).
    """
    import torch

    if grid_thw is None:
        return None
    grid = torch.stack(list(grid_thw)) if isinstance(grid_thw, list | tuple) else grid_thw
    grid = grid.reshape(-1, 3).to("cpu", torch.long)
    merge = int(getattr(config.vision_config, "spatial_merge_size", 2))
    rows, cols = grid[:, 1] // merge, grid[:, 2] // merge
    return grid[:, 0] * rows * (cols + 1) + 2
