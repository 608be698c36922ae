"""A fresh vLLM engine's render threads, counted (run as a subprocess by the `vllm` tier: vLLM's
processor caches are process-wide, so only a new process shows a fresh engine).

    python -m tests.integration.vllm_render_herd MODEL_DIR OUT.json [--unfixed]

Builds a ``VllmEngine`` with 8 render threads, renders 24 pages of mixed sizes on them at once and
writes how many HF processors were constructed and how many times vLLM's tokenizer was deep-copied
during those renders (after the build). ``--unfixed`` leaves out the engine's renderer warm-up and
its tokenizer-pool size, the way vLLM 0.26 runs by default: then every render thread builds its own
processors and tokenizer copies at once (CPU: 19-24 processors and 66-97 copies for these 24 renders, two runs).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any


def main(model_dir: str, out: str, unfixed: bool) -> None:
    from transformers.processing_utils import ProcessorMixin
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from tests.integration.vllm_support import engine_settings, make_images
    from worker.engines.base import OcrRequest
    from worker.engines.vllm.engine import VllmEngine

    counts = {"processors": 0, "tokenizer_copies": 0}
    real_from_pretrained = ProcessorMixin.from_pretrained.__func__  # type: ignore[attr-defined]

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        counts["processors"] += 1
        return real_from_pretrained(cls, *args, **kwargs)

    real_deepcopy = copy.deepcopy

    def deepcopy(x: Any, memo: Any = None, _nil: Any = None) -> Any:
        if isinstance(x, TokenizersBackend):
            counts["tokenizer_copies"] += 1
        return real_deepcopy(x, memo)

    ProcessorMixin.from_pretrained = classmethod(from_pretrained)  # type: ignore[method-assign,assignment]
    copy.deepcopy = deepcopy  # vLLM's pool copies with copy.deepcopy
    if unfixed:
        VllmEngine.warm_renderer = False
        real_args = VllmEngine.engine_args

        def engine_args(self: Any) -> dict[str, Any]:
            args = real_args(self)
            args.pop("renderer_num_workers")
            return args

        VllmEngine.engine_args = engine_args  # type: ignore[method-assign]
    engine = VllmEngine(engine_settings(Path(model_dir), "vllm", render_threads=8,
                                        extra={"vllm": {"kv_cache_memory_bytes": 256 << 20}}))
    engine.start()
    counts.update(dict.fromkeys(counts, 0))  # what the build did is not the question
    images = make_images(0) + make_images(1) + make_images(2) + make_images(3)
    requests = [OcrRequest(key=f"p{i}", image=im) for i, im in enumerate(images)]
    engine.prepare(requests)
    futures = engine._render_queue().take(requests)
    failed = [f.exception() for f in futures if f.exception() is not None]
    engine.close()
    Path(out).write_text(json.dumps({**counts, "renders": len(requests), "failed": [str(e) for e in failed]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--unfixed" in sys.argv[3:])
