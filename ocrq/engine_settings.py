"""Each engine's settings, a class per engine kind: ``engine`` in ``ocrq.settings.Settings`` is the
class its ``kind`` names in ``ocrq.engine_registry`` (a union keyed by ``kind``), so an engine
declares and receives only what it reads.

    rapidocr      RapidOcrSettings       rapid_limit_*
    simulated     SimulatedSettings      the pixel bounds and output tokens (tests)
    transformers  TransformersSettings   HunyuanSettings: model, dtype, pixel bounds, tokens
    vllm          VllmSettings           HunyuanSettings + vLLM's knobs
    vllm-server   VllmServerSettings     VllmSettings (a server ocrq launches) + endpoints

Before this split every engine took every key (one flat class). Such a key set for an engine that
does not read it (``engine.max_num_seqs`` with ``kind: rapidocr``) is still read: dropped with a
deprecation note naming it (``ocrq.engine_registry.engine_settings``), never an error. A key no
engine has is an unknown setting, as anywhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineSettings(BaseModel):
    """What every engine takes; the class of an engine kind adds its own settings."""

    # a key no setting has is an error naming the nearest one (ocrq.settings_check), not ignored
    model_config = ConfigDict(extra="forbid")

    #: a row of ``ocrq.engine_registry.ENGINES``: rapidocr, transformers, vllm, vllm-server, simulated
    kind: str = "rapidocr"
    #: engine-specific extras passed through untouched
    extra: dict[str, Any] = Field(default_factory=dict)


class RapidOcrSettings(EngineSettings):
    kind: Literal["rapidocr"] = "rapidocr"
    #: RapidOCR detection tuning: "max" caps the long side (keeps single text lines exact)
    rapid_limit_type: str = "max"
    rapid_limit_side_len: int = 960


class _Pixels(EngineSettings):
    max_new_tokens: int = 1024
    #: HunyuanOCR processor pixel bounds (multiples of 32 are used)
    min_pixels: int = 512 * 512
    max_pixels: int = 2048 * 2048


class SimulatedSettings(_Pixels):
    kind: Literal["simulated"] = "simulated"


class HunyuanSettings(_Pixels):
    """HunyuanOCR's engines (transformers, vllm, vllm-server)."""

    kind: str = "transformers"
    #: model directory (HunyuanOCR checkpoint) for transformers/vllm
    model_dir: Path | None = None
    #: "auto": bf16 on CUDA, fp32 on CPU
    dtype: str = "auto"
    device: str = "auto"
    #: stop when a short unit repeats this many times at the end of the output
    repetition_stop: int = 12
    #: prompt tokens per forward pass: vLLM's scheduler budget; the transformers engine prefills
    #: a micro-batch in chunks of rows within it (bounds the vision tower's activation peak)
    max_num_batched_tokens: int = 16384


class TransformersSettings(HunyuanSettings):
    kind: Literal["transformers"] = "transformers"


class VllmSettings(HunyuanSettings):
    kind: Literal["vllm", "vllm-server"] = "vllm"
    #: vLLM knobs (in-process engine)
    max_model_len: int = 8192
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.85
    #: vllm: where vLLM keeps its torch.compile artifacts (``VLLM_CACHE_ROOT``; the environment's
    #: own value wins). On a persistent path a restart loads them instead of compiling again.
    #: None: ``{var_dir}/vllm-cache``
    compile_cache_dir: Path | None = None
    #: vllm: most device bytes the engine may claim (e.g. a 24 GiB card's budget on a larger GPU):
    #: the utilization becomes min(gpu_memory_utilization, cap / total). The worker fills it from
    #: ``batch.memory_cap_bytes`` when unset, so one cap bounds engine and governor alike
    memory_cap_bytes: int | None = None
    enforce_eager: bool = False
    #: vllm: micro-batches the engine loop keeps in flight at once. They share vLLM's continuous
    #: batching (the next batch's prefill runs while the last one decodes); 1 drains each batch
    #: before the next starts (docs/bench/gpu-vllm.md measures both)
    concurrent_batches: int = Field(default=8, ge=1, le=32)
    #: vllm: threads rendering requests (chat template + HF image processor, CPU work that
    #: overlaps the GPU's steps); a batch's pages render in parallel, across batches too; a
    #: server ocrq launches gets as many (``--renderer-num-workers``). None: half the host's
    #: cores, 2 to 8 (a page renders in ~0.1 s on one core; an H200 prefills ~30 pages a second)
    render_threads: int | None = Field(default=None, ge=1, le=32)
    #: vllm: images rendered before their batch is planned, most urgent first (0: a batch renders
    #: its pages when it starts, holding its slot meanwhile). Bounds host memory: a rendered
    #: 2048×1536 page holds ~38 MB of pixel patches (128 of them: ~4.8 GB). Enough to render the
    #: next wave of batches while the current one decodes
    render_ahead: int = Field(default=128, ge=0, le=1024)
    #: vllm: the order of vLLM's waiting queue. "priority": a chunk's priority (0 = most urgent)
    #: reaches vLLM's scheduler, so a small urgent job's requests are scheduled before the bulk
    #: ones already waiting there; "fcfs": arrival order, as vLLM ships
    scheduling: Literal["priority", "fcfs"] = "priority"
    #: vllm, vllm-server launched by ocrq: PyTorch's CUDA allocator settings for vLLM's processes
    #: (``PYTORCH_CUDA_ALLOC_CONF`` when not set already). Expandable segments keep the vision
    #: tower's activations of mixed page sizes from fragmenting the cache past vLLM's profiled
    #: peak (docs/gpu.md, "Memory profiles"); "" leaves PyTorch's default
    cuda_alloc_conf: str = "expandable_segments:True"
    #: vllm, vllm-server launched by ocrq: run the vision tower on groups of pages of at most this
    #: many patches, every layer once per group (0: vLLM's loop, each layer on each page). Fewer
    #: kernel launches where vLLM's engine core is CPU-bound; activations bounded by one such
    #: page; bf16 rounding may then depend on the group. On the H200: 2-11 % more img/s
    #: (worker/engines/vllm/vision.py, docs/gpu.md; 16384 fits a 2048×1536 page)
    vision_group_patches: int = Field(default=0, ge=0)
    #: vllm, vllm-server launched by ocrq (CUDA, not with enforce_eager): replay the vision tower
    #: as CUDA graphs, one page per graph, captured per token budget at engine build (vLLM's encoder
    #: graphs, given to HunyuanVL by worker/engines/vllm/encoder_graphs.py). A page's graph follows
    #: from its own size, so its result does not depend on the other pages of a step
    vision_cuda_graphs: bool = False
    #: vllm, ``ocrq up --gpus``: workers (each its own engine) per GPU, each with 1/N of the GPU's
    #: budget (utilization and memory caps divided). vLLM's engine core runs on one CPU thread and
    #: leaves the GPU idle while it launches kernels; a second engine can fill those gaps only under
    #: NVIDIA MPS. H200, 24 GiB, one machine: 15.49 img/s for two under MPS against 15.27 for one
    #: (another machine: 14.80 for two without MPS). No gain measured: default 1 (docs/bench/gpu-vllm.md)
    engines_per_gpu: int = Field(default=1, ge=1, le=8)


class VllmServerSettings(VllmSettings):
    """The ``vllm-server`` engine: its endpoints, and vLLM's knobs for a server ocrq launches."""

    kind: Literal["vllm-server"] = "vllm-server"
    #: vllm-server launched by ocrq: API processes in front of its one engine core
    #: (``--api-server-count``). Each parses, renders and streams its own requests; one alone
    #: bounds the server at its GIL. Each holds ~3.7 GB of host memory (H200 rows, top's RES).
    #: None: one per 4 cores of the host, 1 to 4
    api_servers: int | None = Field(default=None, ge=1, le=16)
    #: vllm-server: how the worker sends a page. "ppm": its decoded pixels as they are (a
    #: 2048×1536 page encodes in ~4 ms); "png": lossless compressed, several times smaller for
    #: clean documents but ~0.4 s of CPU to encode a noisy scan (for a server across a slow link)
    image_transport: Literal["ppm", "png"] = "ppm"
    #: vllm-server: one or more OpenAI-compatible endpoints
    endpoints: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000/v1"])
    served_model: str | None = None
    request_timeout: float = 120.0
