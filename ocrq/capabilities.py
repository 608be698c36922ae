"""What each engine kind can honour: the tasks it runs, and whether it follows a custom prompt.

HunyuanOCR (``transformers``, ``vllm``, ``vllm-server``) runs every task of ``ocrq.messages.TASKS``
and any prompt. RapidOCR reads text: it runs ``text`` and ``spotting`` (its lines carry their
boxes) and nothing that asks for more (a parse to markdown, fields, a translation, a prompt of
one's own); returning its plain reading as ``done`` for those would be a silent wrong answer.
The simulated engine takes anything (its text is a digest of the request). Each kind's tasks are
its row in ``ocrq.engine_registry``.

Every worker publishes its engine's capabilities in its state (``ocrq.keys.worker_state``,
field ``capabilities``, with the queues it consumes). A producer refuses a submission that no
live worker of the job's queue can honour (``producer.errors.UnsupportedTask``, naming the
engines that can); an engine handed one anyway (no worker was up at submit, a message from
elsewhere) fails the image with the permanent ``ocrq.errors.UnsupportedTask``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ocrq.engine_registry import ENGINES
from ocrq.messages import TASKS


def capabilities(kind: str, device: str) -> dict[str, Any]:
    """What a worker with an engine of ``kind`` on ``device`` ("cpu" | "gpu") publishes."""
    row = ENGINES.get(kind)
    if row is None:
        return {"kind": kind, "device": device, "tasks": [], "custom_prompt": False}
    return {"kind": kind, "device": device, "tasks": list(TASKS if row.tasks is None else row.tasks),
            "custom_prompt": row.custom_prompt}


def _asks(task: str, params: Mapping[str, Any] | None) -> str:
    return "a custom prompt" if (params or {}).get("prompt") else f"task {task!r}"


def unsupported(caps: Mapping[str, Any], task: str, params: Mapping[str, Any] | None) -> str | None:
    """Why an engine with ``caps`` cannot honour ``task`` with ``params``; None when it can."""
    kind = caps.get("kind", "?")
    if task not in (caps.get("tasks") or ()):
        return f"the {kind} engine does not run task {task!r}"
    if (params or {}).get("prompt") and not caps.get("custom_prompt"):
        return f"the {kind} engine does not follow a custom prompt"
    return None


def engines_for(task: str, params: Mapping[str, Any] | None) -> list[str]:
    """The engine kinds that honour ``task`` with ``params`` (simulated left out: tests only)."""
    return [kind for kind, row in ENGINES.items() if not row.test_only
            and unsupported(capabilities(kind, "cpu"), task, params) is None]


def refusal(task: str, params: Mapping[str, Any] | None, live: Iterable[Mapping[str, Any]]) -> str | None:
    """Why no live worker (``live``: their published capabilities) can honour ``task``; None when
    one can, or when there is none to ask (the worker then records the image's failure, typed)."""
    live = list(live)
    if not live or any(unsupported(caps, task, params) is None for caps in live):
        return None
    kinds = sorted({str(caps.get("kind", "?")) for caps in live})
    can = engines_for(task, params)
    return (f"{_asks(task, params)} cannot run on this fleet's engines ({', '.join(kinds)}): "
            + (f"it needs a worker with engine.kind {' | '.join(can)} (HunyuanOCR: docs/gpu.md)" if can
               else "no engine runs it"))
