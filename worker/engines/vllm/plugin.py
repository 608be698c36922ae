"""vLLM general plugin: the fixes each supported vLLM needs to run HunyuanOCR correctly.

vLLM calls ``register()`` in every one of its processes (API server, engine core, workers) through
the ``vllm.general_plugins`` entry point declared in pyproject.toml, so these fixes hold whether
the engine runs in-process or as ``vllm serve``. Which fixes a process gets follows from its vLLM
family (release line and CPU/CUDA build): the table is ``compat.FIXES``. Each fix is
independent, idempotent, logged, and deletable on its own once vLLM fixes the cause. Bug reports
with minimal repros: docs/gpu.md ("vLLM bugs and the plugin's fixes").

vLLM 0.26 (native ``hunyuan_vision`` model):

1. ``image_boundary``: the prompt replacement matches the bare image token but inserts start +
   image*n + end. A chat prompt, whose template already wraps the image in start/end, so gets two
   image-start tokens; ``get_xdrope_input_positions`` then looks up a second image grid that does
   not exist and the engine core dies on the first request (``IndexError: list index out of
   range``). We match the whole start/image/end trio, as upstream vllm-project/vllm#49691 does,
   and build the profiling dummy text the same way.
2. ``xdrope_cpu`` (CPU build only): ``XDRotaryEmbedding`` inherits the CPU rotary kernel, which
   takes 1-D positions; HunyuanOCR's are [4, tokens], so the kernel reads past its cos/sin cache
   and the process dies (SIGSEGV in ``pos_encoding.cpp``). The class's own ``forward_native``
   handles the four XD sections (CUDA has its own ``forward_cuda`` for them).
3. ``vision_groups`` (not a bug fix: an opt-in path, ``worker/engines/vllm/vision.py``): the vision
   tower on groups of pages when ``engine.vision_group_patches`` > 0; vLLM's own loop otherwise.
4. ``encoder_graphs`` (not a bug fix: a missing feature, ``worker/engines/vllm/encoder_graphs.py``):
   vLLM's ``SupportsEncoderCudaGraph`` for the HunyuanVL model, so its vision tower replays as CUDA
   graphs when the engine's compilation config asks for them (``engine.vision_cuda_graphs``).

vLLM 0.32+ (HunyuanVL through the Transformers modeling backend, ``transformers/models/hunyuan_vl``):

5. ``pil_processor`` (no torchvision, the CPU build's case): transformers resolves HunyuanVL's image
   processor to the torchvision class or the PIL one, and refuses both without torchvision (the
   PIL class is marked as needing it too), so vLLM cannot build the processor and the engine does
   not start. The PIL class works without torchvision: we register it for ``HunYuanVLConfig``.
6. ``contiguous_merger`` (CPU build): the patch merger feeds its ``mlp`` a permuted, non-contiguous
   tensor; vLLM's CPU linear layer (``onednn_mm``) requires ``stride(-1) == 1``, so the first image
   request kills the engine core (``Expected a.stride(-1) == 1``). The ``mlp`` gets its input
   contiguous.
7. ``split_fix``: the Transformers backend splits the vision output, all images of an encoder
   batch concatenated, by each image's raw patch count (grid_h·grid_w) instead of the tokens the
   encoder emits per image ((gh/2)·(gw/2+1)+2). With one image per encoder batch that is
   accidentally harmless; with several, images 2..N get other images' embeddings, and vLLM's
   encoder cache keeps serving them (only a warning is logged). We split by the token counts
   computed from ``image_grid_thw``.

``OCRQ_VLLM_DISABLE_FIXES=name,name`` leaves fixes out in every vLLM process, and
``boundary_fix.enabled`` / ``split_fix.enabled`` switch fixes 1 and 7 off in-process: each fix's
test runs once without it and shows the bug, so no fix outlives its reason unnoticed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Under "vllm." so the lines show up with vLLM's own log handler in every vLLM process.
log = logging.getLogger("vllm.ocrq_plugin")

DISABLE_FIXES_ENV = "OCRQ_VLLM_DISABLE_FIXES"
_PATCHED_ATTR = "__ocrq_patched__"

#: names of the fixes applied in this process (for logs and tests)
applied: list[str] = []


class _Switch:
    def __init__(self) -> None:
        self.enabled = True


#: fixes 1 and 7 are consulted per request, so a test can show the bug without them on a live engine
boundary_fix = _Switch()
split_fix = _Switch()


def register() -> None:
    """Entry point: apply every fix this process's vLLM needs (safe to call repeatedly)."""
    from worker.engines.vllm import compat, startup

    startup.install_from_env()  # the engine build's phases, from this process's log lines
    family = compat.family()
    disabled = {n.strip() for n in os.environ.get(DISABLE_FIXES_ENV, "").split(",") if n.strip()}
    for name in family.fixes():
        if name in applied:
            continue
        if name in disabled:
            log.warning("ocrq vLLM plugin: fix %s disabled by %s", name, DISABLE_FIXES_ENV)
            continue
        try:
            if _FIXES[name]():
                applied.append(name)
        except Exception:  # a broken fix must not take vLLM down; the tests catch the effect
            log.exception("ocrq vLLM plugin: fix %s failed", name)
    if applied:
        log.info("ocrq vLLM plugin (%s): applied %s", family, ", ".join(applied))
    if not family.known:
        log.warning("ocrq vLLM plugin: %s is not a supported vLLM (0.26, 0.32 CPU, 0.33-0.34 CUDA); no fix applied. "
                    "Run the vllm test tier and the batch-invariance test before trusting it (docs/gpu.md)", family)
    elif not family.verified:
        log.warning("ocrq vLLM plugin: %s has not run ocrq's vLLM tests; its fixes are those planned for it "
                    "(docs/gpu.md)", family)


def _image_boundary() -> bool:
    from vllm.multimodal.processing import PromptReplacement

    from worker.engines.vllm import compat

    hv = compat.hunyuan_vision()
    processor_cls, dummy_cls = hv.HunYuanVLMultiModalProcessor, hv.HunYuanVLDummyInputsBuilder
    if getattr(processor_cls._get_prompt_updates, _PATCHED_ATTR, False):
        return True
    original_updates = processor_cls._get_prompt_updates

    def _get_prompt_updates(self: Any, mm_items: Any, hf_processor_mm_kwargs: Any, out_mm_kwargs: Any) -> Any:
        updates = original_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        if not boundary_fix.enabled:
            return updates
        hf = self.info.get_hf_processor(**hf_processor_mm_kwargs)
        trio = [hf.image_start_token_id, hf.image_token_id, hf.image_end_token_id]
        # the same replacement (start + image*n + end), now in place of the wrapped placeholder
        return [PromptReplacement(modality=u.modality, target=trio, replacement=u.replacement)
                if u.modality == "image" else u for u in updates]

    def get_dummy_text(self: Any, mm_counts: Any) -> str:
        hf = self.info.get_hf_processor(typ=hv.HunYuanVLProcessor)
        return f"{hf.image_start_token}{hf.image_token}{hf.image_end_token}" * mm_counts.get("image", 0)

    setattr(_get_prompt_updates, _PATCHED_ATTR, True)
    processor_cls._get_prompt_updates = _get_prompt_updates
    dummy_cls.get_dummy_text = get_dummy_text
    return True


def _xdrope_cpu() -> bool:
    from vllm.model_executor.layers.rotary_embedding.xdrope import XDRotaryEmbedding

    setattr(XDRotaryEmbedding, "forward_cpu", XDRotaryEmbedding.forward_native)  # noqa: B010 (a method assigned)
    return True


def _pil_processor() -> bool:
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return False  # transformers hands out its own processor
    from transformers import HunYuanVLConfig
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING
    from transformers.models.hunyuan_vl.image_processing_pil_hunyuan_vl import HunYuanVLImageProcessorPil

    # the mapping itself: ``AutoImageProcessor.register`` merges in the unimportable torchvision entry
    mapping: Any = IMAGE_PROCESSOR_MAPPING  # transformers 5.19's form: {backend: class}
    mapping.register(HunYuanVLConfig, {"pil": HunYuanVLImageProcessorPil}, exist_ok=True)
    return True


def _contiguous_merger() -> bool:
    from transformers.models.hunyuan_vl import modeling_hunyuan_vl as hf

    merger = hf.HunYuanVLVisionPatchMerger
    if getattr(merger.forward, _PATCHED_ATTR, False):
        return True
    original = merger.forward

    def forward(self: Any, hidden_states: Any, size: Any) -> Any:
        # vLLM swaps the model's linear layers for its own after construction: hook the one in place
        if not getattr(self.mlp, _PATCHED_ATTR, False):
            self.mlp.register_forward_pre_hook(
                lambda module, args: tuple(a.contiguous() if hasattr(a, "contiguous") else a for a in args))
            setattr(self.mlp, _PATCHED_ATTR, True)
        return original(self, hidden_states, size)

    setattr(forward, _PATCHED_ATTR, True)
    setattr(merger, "forward", forward)  # noqa: B010 (mypy: a method assigned)
    return True


def _split_fix() -> bool:
    from worker.engines.vllm import compat

    mixin = compat.transformers_backend()
    if getattr(mixin._process_vision_input, _PATCHED_ATTR, False):
        return True
    original = mixin._process_vision_input

    def _process_vision_input(self: Any, modality: str, pixel_values: Any, num_patches: Any, **kwargs: Any) -> Any:
        grid = kwargs.get("image_grid_thw")
        if split_fix.enabled and modality == "image" and grid is not None and _is_hunyuan_vl(self):
            import torch

            merge = int(getattr(self.config.vision_config, "spatial_merge_size", 2))
            rows = grid.tolist() if hasattr(grid, "tolist") else [list(map(int, g)) for g in grid]
            num_patches = torch.tensor([(int(h) // merge) * (int(w) // merge + 1) + 2 for _, h, w in rows])
        return original(self, modality, pixel_values, num_patches, **kwargs)

    setattr(_process_vision_input, _PATCHED_ATTR, True)
    mixin._process_vision_input = _process_vision_input
    return True


def _is_hunyuan_vl(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "hunyuan_vl"


def _vision_groups() -> bool:
    from worker.engines.vllm import vision

    return vision.install()


def _encoder_graphs() -> bool:
    from worker.engines.vllm import encoder_graphs

    return encoder_graphs.install()


_FIXES = {
    "image_boundary": _image_boundary, "xdrope_cpu": _xdrope_cpu, "vision_groups": _vision_groups,
    "encoder_graphs": _encoder_graphs, "pil_processor": _pil_processor, "contiguous_merger": _contiguous_merger,
    "split_fix": _split_fix,
}
