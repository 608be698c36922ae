"""vLLM general plugin: the fixes vLLM 0.26.0 needs to run HunyuanOCR's native model correctly.

vLLM calls ``register()`` in every one of its processes (API server, engine core, workers) through
the ``vllm.general_plugins`` entry point declared in pyproject.toml, so these fixes hold whether
the engine runs in-process or as ``vllm serve``. Each fix is independent, guarded by the vLLM
versions it was verified on, idempotent, logged, and deletable on its own once vLLM fixes the
cause. Bug reports with minimal repros: docs/gpu.md ("vLLM bugs and the plugin's fixes").

1. ``image_boundary`` (native ``hunyuan_vision``): the prompt replacement matches the bare image
   token but inserts start + image*n + end. A chat prompt, whose template already wraps the image
   in start/end, so gets two image-start tokens; ``get_xdrope_input_positions`` then looks up a
   second image grid that does not exist and the engine core dies on the first request
   (``IndexError: list index out of range``). We match the whole start/image/end trio, as
   upstream vllm-project/vllm#49691 does, and build the profiling dummy text the same way.
2. ``xdrope_cpu`` (CPU build only): ``XDRotaryEmbedding`` inherits the CPU rotary kernel, which
   takes 1-D positions; HunyuanOCR's are [4, tokens], so the kernel reads past its cos/sin cache
   and the process dies (SIGSEGV in ``pos_encoding.cpp``). The class's own ``forward_native``
   handles the four XD sections (CUDA has its own ``forward_cuda`` for them).

3. ``vision_groups`` (not a bug fix: an opt-in path, ``worker/engines/vllm_vision.py``): the vision
   tower on groups of pages when ``engine.vision_group_patches`` > 0; vLLM's own loop otherwise.
4. ``encoder_graphs`` (not a bug fix: a missing feature, ``worker/engines/vllm_encoder_graphs.py``):
   vLLM's ``SupportsEncoderCudaGraph`` for the HunyuanVL model, so its vision tower replays as CUDA
   graphs when the engine's compilation config asks for them (``engine.vision_cuda_graphs``).

``OCRQ_VLLM_DISABLE_FIXES=name,name`` leaves fixes out in every vLLM process, and
``boundary_fix.enabled`` switches fix 1 off in-process: each fix's test runs once without it and
shows the bug, so no fix outlives its reason unnoticed.
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Under "vllm." so the lines show up with vLLM's own log handler in every vLLM process.
log = logging.getLogger("vllm.ocrq_plugin")

#: vLLM releases whose native HunyuanVL prompt replacement doubles the image-start token (fix 1).
#: Verified on 0.26.0 (CPU and H200); upstream fixed it after 0.26 and dropped the native model in 0.27+.
BOUNDARY_BUG_VERSIONS = ("0.26.",)
#: vLLM CPU releases that send XD-RoPE's [4, tokens] positions to the 1-D rotary kernel (fix 2).
XDROPE_CPU_BUG_VERSIONS = ("0.26.",)
DISABLE_FIXES_ENV = "OCRQ_VLLM_DISABLE_FIXES"
_PATCHED_ATTR = "__ocrq_patched__"

#: names of the fixes applied in this process (for logs and tests)
applied: list[str] = []


class _Switch:
    enabled = True


#: fix 1 is consulted per request, so a test can show the crash without it on a live engine
boundary_fix = _Switch()


def register() -> None:
    """Entry point: apply every fix this process's vLLM needs (safe to call repeatedly)."""
    import vllm

    from worker.engines import vllm_startup

    vllm_startup.install_from_env()  # the engine build's phases, from this process's log lines

    version = str(vllm.__version__)
    disabled = {n.strip() for n in os.environ.get(DISABLE_FIXES_ENV, "").split(",") if n.strip()}
    for name, fix in (("image_boundary", _image_boundary), ("xdrope_cpu", _xdrope_cpu),
                      ("vision_groups", _vision_groups), ("encoder_graphs", _encoder_graphs)):
        if name in applied:
            continue
        if name in disabled:
            log.warning("ocrq vLLM plugin: fix %s disabled by %s", name, DISABLE_FIXES_ENV)
            continue
        try:
            if fix(version):
                applied.append(name)
        except Exception:  # a broken fix must not take vLLM down; the tests catch the effect
            log.exception("ocrq vLLM plugin: fix %s failed", name)
    if applied:
        log.info("ocrq vLLM plugin (vllm %s): applied %s", version, ", ".join(applied))
    elif not version.startswith(BOUNDARY_BUG_VERSIONS):
        log.warning("ocrq vLLM plugin: vllm %s is not the verified 0.26.x; run the vllm test tier and "
                    "the batch-invariance test before trusting it (docs/gpu.md)", version)


def _image_boundary(version: str) -> bool:
    if not version.startswith(BOUNDARY_BUG_VERSIONS):
        return False
    from vllm.model_executor.models import hunyuan_vision as hv
    from vllm.multimodal.processing import PromptReplacement

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
        return [PromptReplacement(modality=u.modality, target=trio, replacement=u.replacement)  # type: ignore[attr-defined]
                if u.modality == "image" else u for u in updates]

    def get_dummy_text(self: Any, mm_counts: Any) -> str:
        hf = self.info.get_hf_processor(typ=hv.HunYuanVLProcessor)
        return f"{hf.image_start_token}{hf.image_token}{hf.image_end_token}" * mm_counts.get("image", 0)

    setattr(_get_prompt_updates, _PATCHED_ATTR, True)
    processor_cls._get_prompt_updates = _get_prompt_updates  # type: ignore[method-assign]
    dummy_cls.get_dummy_text = get_dummy_text  # type: ignore[method-assign]
    return True


def _xdrope_cpu(version: str) -> bool:
    if not version.startswith(XDROPE_CPU_BUG_VERSIONS):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.rotary_embedding.xdrope import XDRotaryEmbedding

    XDRotaryEmbedding.forward_cpu = XDRotaryEmbedding.forward_native  # type: ignore[method-assign,assignment]
    return True


def _vision_groups(version: str) -> bool:
    from worker.engines import vllm_vision

    return vllm_vision.install(version)


def _encoder_graphs(version: str) -> bool:
    from worker.engines import vllm_encoder_graphs

    return vllm_encoder_graphs.install(version)
