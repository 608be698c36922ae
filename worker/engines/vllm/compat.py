"""What differs between the vLLM releases ocrq supports, in one place.

ocrq runs HunyuanOCR on two generations of vLLM:

- **0.26** (the pin; the newest CUDA wheel for torch 2.11): a *native* HunyuanVL model,
  ``vllm/model_executor/models/hunyuan_vision.py``. The plugin fixes its prompt replacement
  (``image_boundary``) and, on the CPU build, its rotary kernel (``xdrope_cpu``); the opt-in tower
  paths (``vision_groups``, ``encoder_graphs``) patch that native tower.
- **0.32 to 0.34** (0.32 the newest CPU release, 0.33 and 0.34 CUDA ones; vLLM PR #53615 moved
  HunyuanVL to the Transformers modeling backend): config, processor and model come from
  ``transformers/models/hunyuan_vl``. The plugin registers transformers' PIL image processor where
  torchvision is absent (``pil_processor``), gives the patch merger's ``mlp`` a contiguous input for
  the CPU build's oneDNN matmul (``contiguous_merger``) and splits the vision output per image by the
  tokens the encoder emits (``split_fix``).

A *family* is a release line and a device kind; ``FIXES`` says which plugin fixes apply to each.
A family missing from the table gets no fix and a warning. The names that moved between releases
(the native model module, the serve command's pieces, the client error type) are imported
here only: ``tests/unit/test_vllm_compat.py`` holds every other module to that.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: the plugin fixes each family (release line, device kind) needs
FIXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("0.26", "cpu"): ("image_boundary", "xdrope_cpu"),
    ("0.26", "cuda"): ("image_boundary",),
    ("0.32", "cpu"): ("pil_processor", "contiguous_merger", "split_fix"),
    # not run (no GPU with torch 2.14 at hand); its wheel has 0.32's split code, and the other two
    # fixes are CPU-build conditions (no torchvision, oneDNN)
    ("0.33", "cuda"): ("split_fix",),
    # not run either (torch 2.14, no CPU build); read from its wheel: the Transformers backend
    # still splits by raw patch counts (``num_image_patches`` = grid h·w), so ``split_fix``
    ("0.34", "cuda"): ("split_fix",),
}
#: families the vllm tier (CPU) or the GPU tests (H200) ran on with the fixes above
VERIFIED = frozenset({("0.26", "cpu"), ("0.26", "cuda"), ("0.32", "cpu")})
#: releases that serve HunyuanVL with vLLM's native model (the opt-in tower paths patch it)
NATIVE_RELEASES = ("0.26",)
#: opt-in paths over the native model's vision tower (not bug fixes)
NATIVE_PATHS = ("vision_groups", "encoder_graphs")


@dataclass(frozen=True)
class Family:
    """The installed vLLM: its version, release line ("0.26") and device kind ("cpu", "cuda")."""

    version: str
    device: str

    @property
    def release(self) -> str:
        return ".".join(self.version.split(".")[:2])

    @property
    def key(self) -> tuple[str, str]:
        return (self.release, self.device)

    @property
    def native_model(self) -> bool:
        """HunyuanVL through vLLM's own model file, not the Transformers backend."""
        return self.release in NATIVE_RELEASES

    @property
    def known(self) -> bool:
        return self.key in FIXES

    @property
    def verified(self) -> bool:
        return self.key in VERIFIED

    def fixes(self) -> tuple[str, ...]:
        """The plugin entries this family gets: its fixes, then the native tower paths."""
        return FIXES.get(self.key, ()) + (NATIVE_PATHS if self.native_model else ())

    def __str__(self) -> str:
        return f"vllm {self.version} ({self.device})"


def family_of(version: str, cpu: bool) -> Family:
    return Family(version=str(version).split("+")[0], device="cpu" if cpu else "cuda")


@functools.cache
def family() -> Family:
    """This process's vLLM (imports vllm)."""
    import vllm
    from vllm.platforms import current_platform

    return family_of(str(vllm.__version__), bool(current_platform.is_cpu()))


# --- names that moved --------------------------------------------------------------------------


def hunyuan_vision() -> ModuleType:
    """vLLM's native HunyuanVL model module (0.26; gone once the Transformers backend serves it)."""
    if not family().native_model:
        raise RuntimeError(f"{family()} has no native HunyuanVL model (Transformers backend)")
    import importlib

    return importlib.import_module("vllm.model_executor.models.hunyuan_vision")


def transformers_backend() -> type[Any]:
    """vLLM's Transformers-backend class for multimodal models (0.32+ serves HunyuanVL with it)."""
    from vllm.model_executor.models.transformers.multimodal import MultiModalMixin

    return MultiModalMixin


def client_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for one request it will not take (validation, a prompt over
    ``max_model_len``, a processor error): that request fails alone, the engine lives on. 0.26's
    ``VLLMValidationError`` is a ``ValueError``; from 0.32 the request errors derive from
    ``VLLMClientError``, no longer a ``ValueError``."""
    import vllm.exceptions

    base: tuple[type[BaseException], ...] = (ValueError, TypeError, KeyError, OSError)
    client = getattr(vllm.exceptions, "VLLMClientError", None)  # 0.32+
    return base if client is None else (*base, client)


def serve_parts() -> tuple[Any, Any, Any]:
    """(cli_env_setup, make_arg_parser, validate_parsed_serve_args) of vLLM's serve command. The
    environment setup: ``vllm.entrypoints.serve.utils.api_utils`` up to 0.32,
    ``vllm.entrypoints.common.startup`` in 0.33; the parser: ``vllm.entrypoints.openai.cli_args``
    (0.26), ``vllm.entrypoints.launchers.cli_args`` (0.32), ``vllm.entrypoints.common.cli_args`` (0.33)."""
    setup = _first_module("vllm.entrypoints.common.startup", "vllm.entrypoints.serve.utils.api_utils",
                          having="cli_env_setup")
    cli_args = _first_module("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                             "vllm.entrypoints.openai.cli_args", having="make_arg_parser")
    return setup.cli_env_setup, cli_args.make_arg_parser, cli_args.validate_parsed_serve_args


def batch_models() -> ModuleType:
    """The module with vLLM's Batch file models (``BatchRequestInput``, ``BatchRequestOutput``):
    ``vllm.entrypoints.openai.run_batch`` (0.26), ``vllm.entrypoints.launchers.run_batch`` (0.32)."""
    return _first_module("vllm.entrypoints.launchers.run_batch", "vllm.entrypoints.openai.run_batch",
                         having="BatchRequestInput")


def _first_module(*names: str, having: str) -> ModuleType:
    import importlib

    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, having):
            return module
    raise ImportError(f"none of {', '.join(names)} has {having}: a vLLM this module does not know")


def keep_log_handler(handler: Any) -> None:
    """Keep ``handler`` on the ``vllm`` logger for good. From 0.32 vLLM configures its logging
    when an engine is built (``vllm.logger._configure_vllm_root_logger``, which replaces the
    logger's handlers), after the plugins ran; 0.26 configures it on import, before them."""
    import logging
    import sys

    logging.getLogger("vllm").addHandler(handler)
    module = sys.modules.get("vllm.logger")  # not imported: nothing has configured vLLM's logging yet
    configure = getattr(module, "_configure_vllm_root_logger", None)
    if configure is None:
        return
    kept: list[Any] | None = getattr(configure, "__ocrq_kept__", None)
    if kept is None:
        original, kept = configure, []

        def configure_and_keep(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            for h in kept:
                logging.getLogger("vllm").addHandler(h)  # a no-op for one already there
            return result

        configure_and_keep.__ocrq_kept__ = kept  # type: ignore[attr-defined]
        setattr(module, "_configure_vllm_root_logger", configure_and_keep)  # noqa: B010 (module may be None to mypy)
    kept.append(handler)


def engine_dead_error() -> type[BaseException]:
    """The exception a dead engine core raises into ``LLMEngine.step()``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def prompt_length(engine_input: Any) -> int | None:
    """Prompt tokens of a rendered request (``LLM._preprocess_chat``'s output: a dict with the
    expanded ``prompt_token_ids``, image tokens included, in 0.26 to 0.34); None if unknown."""
    ids = engine_input.get("prompt_token_ids") if isinstance(engine_input, Mapping) else \
        getattr(engine_input, "prompt_token_ids", None)
    return len(ids) if ids is not None else None


@contextmanager
def renderer_built(callback: Callable[[Any, Any], None]) -> Iterator[bool]:
    """While inside, ``callback(renderer, model_config)`` runs as soon as an ``LLMEngine`` has made
    its renderer, before it starts its engine core (``LLMEngine.__init__`` calls
    ``vllm.v1.engine.llm_engine.renderer_from_config``, 0.26 to 0.34). Yields whether the hook is
    in place (False: a release without that name; nothing is called)."""
    import importlib

    module = importlib.import_module("vllm.v1.engine.llm_engine")
    original = getattr(module, "renderer_from_config", None)
    if original is None:
        yield False
        return

    def renderer_from_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        renderer = original(config, *args, **kwargs)
        try:
            callback(renderer, config.model_config)
        except Exception:  # the hook is an optimisation: the build goes on without it
            log.warning("renderer hook failed", exc_info=True)
        return renderer

    setattr(module, "renderer_from_config", renderer_from_config)  # noqa: B010
    try:
        yield True
    finally:
        setattr(module, "renderer_from_config", original)  # noqa: B010


def render_chat(renderer: Any, model_config: Any, messages: list[Any]) -> Any:
    """One chat request rendered as ``LLM._preprocess_chat`` renders it, given only the renderer
    (before the ``LLM`` exists): the mixin reads ``renderer``, ``model_config`` and (0.32+)
    ``chat_template`` off its instance, which a stand-in provides."""
    from types import SimpleNamespace

    from vllm import LLM

    stand_in = SimpleNamespace(renderer=renderer, model_config=model_config, chat_template=None)
    (engine_input,) = LLM._preprocess_chat(stand_in, [messages])  # type: ignore[arg-type]
    return engine_input
