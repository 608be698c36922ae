"""What each engine kind honours, and the producer's refusal: a task or prompt no live engine
can honour is refused naming the engines that can; with no live worker there is no one to ask."""

from __future__ import annotations

import pytest

from ocrq.capabilities import capabilities, engines_for, refusal, unsupported
from ocrq.messages import TASKS

RAPID = capabilities("rapidocr", "cpu")
VLLM = capabilities("vllm", "gpu")


@pytest.mark.parametrize("task", ["text", "spotting"])
def test_rapidocr_runs_what_it_reads(task: str) -> None:
    assert unsupported(RAPID, task, {}) is None
    assert refusal(task, {}, [RAPID]) is None


@pytest.mark.parametrize("task", ["parse", "extract", "translate"])
def test_rapidocr_is_refused_what_it_cannot_answer_naming_the_engines_that_can(task: str) -> None:
    assert unsupported(RAPID, task, {}) == f"the rapidocr engine does not run task {task!r}"
    why = refusal(task, {"target_lang": "de"}, [RAPID, RAPID])
    assert why == (f"task {task!r} cannot run on this fleet's engines (rapidocr): it needs a worker with "
                   "engine.kind transformers | vllm | vllm-server (HunyuanOCR: docs/gpu.md)")


def test_a_custom_prompt_needs_an_engine_that_follows_prompts() -> None:
    params = {"prompt": "Describe the picture"}
    assert unsupported(RAPID, "text", params) == "the rapidocr engine does not follow a custom prompt"
    assert "a custom prompt cannot run" in (refusal("text", params, [RAPID]) or "")
    assert engines_for("text", params) == ["transformers", "vllm", "vllm-server"]


def test_one_live_engine_that_can_is_enough_and_none_live_asks_no_one() -> None:
    assert refusal("translate", {}, [RAPID, VLLM]) is None
    assert refusal("translate", {}, []) is None
    assert all(unsupported(VLLM, task, {"prompt": "x"}) is None for task in TASKS)
    assert unsupported(capabilities("vllm", "gpu"), "ocr-everything", {}) is not None
