"""HunyuanOCR's prompts: the instruction text per task and model version, and the way back from
a prompt to its task (an OpenAI Batch line names its task by its prompt: ``producer.openai_requests``).

Workers build their chat messages from ``prompt`` (``worker.engines.hunyuan``); producers read the
same table, so a known prompt maps to its task whatever the version it was written for.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal

from ocrq.messages import TASKS

Version = Literal["1.0", "1.5"]

# 1.0 prompts are the model card's; 1.5 keeps them except plain reading ("提取图中的文字。") and
# spotting, which 1.5 answers as JSON boxes. The 1.5 spotting wording is ours (not verified
# against the 1.5 card); it only has to ask for the JSON form the parser reads.
PROMPTS: dict[Version, dict[str, str]] = {
    "1.0": {
        "text": "Extract the text in the image.",
        "parse": (
            "Extract all information from the main body of the document image and represent it in "
            "markdown format, ignoring headers and footers. Tables should be expressed in HTML format, "
            "formulas in the document should be represented using LaTeX format, and the parsing should "
            "be organized according to the reading order."
        ),
        "spotting": (
            "Detect and recognize text in the image, and output the text coordinates in a formatted manner."
        ),
        "extract": "Extract the content of the fields: {fields} from the image and return it in JSON format.",
        "translate": (
            "First extract the text, then translate the text content into {target_lang}. If it is a "
            "document, ignore the header and footer. Formulas should be represented in LaTeX format, "
            "and tables should be represented in HTML format."
        ),
    },
    "1.5": {
        "text": "提取图中的文字。",
        "parse": (
            "提取文档图片中正文的所有信息用markdown格式表示，其中页眉、页脚部分忽略，表格用html格式表达，"
            "文档中公式用latex格式表示，按照阅读顺序组织进行解析。"
        ),
        "spotting": (
            '检测并识别图片中的文字，以JSON格式输出，每项为{"box":[xmin,ymin,xmax,ymax],"text":文字}。'
        ),
        "extract": "提取图片中的：{fields}的字段内容，并按照JSON格式返回。",
        "translate": (
            "先提取文字，再将文字内容翻译为{target_lang}。若是文档，则其中页眉、页脚忽略。"
            "公式用latex格式表示，表格用html格式表示。"
        ),
    },
}

#: the template fields of a task's prompt (what ``prompt`` fills from params)
_FIELDS = ("fields", "target_lang")


def prompt(task: str, params: Mapping[str, Any] | None = None, version: Version = "1.5") -> str:
    """The instruction text for a task; ``params["prompt"]`` overrides it verbatim."""
    params = params or {}
    if params.get("prompt"):
        return str(params["prompt"])
    if task not in PROMPTS[version]:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
    template = PROMPTS[version][task]
    if task == "extract":
        fields = params.get("fields")
        if not fields or isinstance(fields, str):
            raise ValueError("task 'extract' needs params['fields'] as a list of field names")
        return template.format(fields="[" + ", ".join(f"'{f}'" for f in fields) + "]")
    if task == "translate":
        default = "English" if version == "1.0" else "英文"
        return template.format(target_lang=str(params.get("target_lang", default)))
    return template


@cache
def _patterns() -> list[tuple[re.Pattern[str], str]]:
    """Each (version, task) template as a full-match pattern, its ``{field}`` a named group."""
    out = []
    for table in PROMPTS.values():
        for task, template in table.items():
            pattern = re.escape(template)
            for name in _FIELDS:
                pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>.+?)")
            out.append((re.compile(pattern, re.DOTALL), task))
    return out


def task_of(text: str) -> tuple[str, dict[str, Any]] | None:
    """The (task, params) whose prompt ``text`` is (either version, surrounding space ignored),
    or None for any other text. ``extract``'s field list and ``translate``'s language come back
    as params."""
    text = text.strip()
    for pattern, task in _patterns():
        m = pattern.fullmatch(text)
        if m is None:
            continue
        found = m.groupdict()
        if task == "translate":
            return task, {"target_lang": found["target_lang"]}
        if task == "extract":
            fields = _field_list(found["fields"])
            if fields is None:
                continue
            return task, {"fields": fields}
        return task, {}
    return None


def _field_list(text: str) -> list[str] | None:
    """``['a', 'b']`` (as ``prompt`` writes it) as a list of names, else None."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None
