"""HunyuanOCR prompts, sampling defaults, output parsers, repetition stop and costs (pure Python)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from ocrq.engine_settings import HunyuanSettings
from worker.engines import hunyuan
from worker.engines.base import OcrRequest


def test_prompts_per_task_and_version() -> None:
    assert hunyuan.prompt("text") == "提取图中的文字。"
    assert hunyuan.prompt("spotting", version="1.0").startswith("Detect and recognize text in the image")
    assert '"box"' in hunyuan.prompt("spotting", version="1.5")
    assert "['name', 'date']" in hunyuan.prompt("extract", {"fields": ["name", "date"]}, "1.0")
    assert "JSON" in hunyuan.prompt("extract", {"fields": ["a"]})
    assert "German" in hunyuan.prompt("translate", {"target_lang": "German"}, "1.0")
    assert hunyuan.prompt("parse", {"prompt": "custom"}) == "custom"
    with pytest.raises(ValueError):
        hunyuan.prompt("extract", {})
    with pytest.raises(ValueError):
        hunyuan.prompt("extract", {"fields": "name"})
    with pytest.raises(ValueError):
        hunyuan.prompt("poetry")


def test_messages_have_empty_system_then_image_and_text() -> None:
    messages = hunyuan.build_messages("parse", version="1.0")
    assert messages[0] == {"role": "system", "content": ""}
    user = messages[1]
    assert user["role"] == "user"
    assert [c["type"] for c in user["content"]] == ["image", "text"]
    assert user["content"][1]["text"] == hunyuan.prompt("parse", version="1.0")


def test_sampling_defaults_are_greedy() -> None:
    assert hunyuan.SAMPLING["1.0"].top_k == 1 and hunyuan.SAMPLING["1.0"].repetition_penalty == 1.0
    assert hunyuan.SAMPLING["1.5"].top_k == -1 and hunyuan.SAMPLING["1.5"].repetition_penalty == 1.08
    assert all(s.temperature == 0.0 for s in hunyuan.SAMPLING.values())
    assert hunyuan.version_of(HunyuanSettings(extra={"hunyuan_version": "1.0"})) == "1.0"
    with pytest.raises(ValueError):
        hunyuan.version_of(HunyuanSettings(extra={"hunyuan_version": "2"}))


def test_legacy_spotting_to_pixel_polygons() -> None:
    text = "Hello(100,200),(500,300)World(0,0),(1000,1000)"
    lines = hunyuan.parse_spotting(text, width=2000, height=1000)
    assert [ln.text for ln in lines] == ["Hello", "World"]
    assert lines[0].box == [[200.0, 200.0], [1000.0, 200.0], [1000.0, 300.0], [200.0, 300.0]]
    assert lines[1].box == [[0.0, 0.0], [2000.0, 0.0], [2000.0, 1000.0], [0.0, 1000.0]]
    tagged = hunyuan.parse_spotting("<ref>Total</ref><quad>(10,20),(30,40)</quad>", 1000, 1000)
    assert tagged[0].text == "Total" and tagged[0].box is not None and tagged[0].box[0] == [10.0, 20.0]


def test_json_spotting_with_fence_and_clamping() -> None:
    payload = [{"box": [0, 0, 500, 1000], "text": "左"},
               {"box": [[0, 0], [10, 0], [10, 10], [0, 10]], "text": "q"},
               {"box": [900, 900, 1200, 1100], "text": "edge"}, {"text": "nobox"}]
    text = "```json\n" + json.dumps(payload, ensure_ascii=False) + "\n```"
    lines = hunyuan.parse_spotting(text, width=640, height=480)
    assert [ln.text for ln in lines] == ["左", "q", "edge", "nobox"]
    assert lines[0].box == [[0.0, 0.0], [320.0, 0.0], [320.0, 480.0], [0.0, 480.0]]
    assert lines[1].box is not None and lines[1].box[2] == [6.4, 4.8]
    assert lines[2].box is not None and lines[2].box[2] == [640.0, 480.0]  # clamped to the image
    assert lines[3].box is None


def test_extraction_json_is_tolerant() -> None:
    assert hunyuan.parse_json_output('```json\n{"a": 1}\n```') == {"a": 1}
    assert hunyuan.parse_json_output('json\n{"a": "b"}') == {"a": "b"}
    assert hunyuan.parse_json_output('Here it is: {"k": [1, 2]} done') == {"k": [1, 2]}
    assert hunyuan.parse_json_output("no json here") is None


def test_repetition_detection_on_tokens_and_text() -> None:
    assert hunyuan.detect_repetition([1, 2, 3] + [7] * 30, min_repeats=12) == hunyuan.Repetition(1, 30)
    loop = [5, 6, 7, 8] * 12
    rep = hunyuan.detect_repetition([1, 2] + loop, min_repeats=12)
    assert rep is not None and rep.unit == 4 and rep.repeats == 12
    assert hunyuan.detect_repetition([5, 6, 7, 8] * 11, min_repeats=12) is None
    assert hunyuan.detect_repetition(list(range(100)), min_repeats=3) is None
    # a short dotted leader is not a loop: the span must reach min_span
    assert hunyuan.detect_repetition("Chapter 1 " + "." * 14, min_repeats=12) is None
    assert hunyuan.detect_repetition("abc" + "的" * 40, min_repeats=12) == hunyuan.Repetition(1, 40)
    assert hunyuan.detect_repetition([7] * 50, min_repeats=1) is None


def test_vision_tokens_and_cost() -> None:
    assert hunyuan.vision_tokens(1024, 768) == 794  # 24 rows × (32 + 1) + 2
    assert hunyuan.vision_tokens(2048, 1536) == 48 * 65 + 2
    assert hunyuan.vision_tokens(1024, 768, 512 * 512, 2048 * 2048) == 794
    settings = HunyuanSettings(max_new_tokens=300)
    req = OcrRequest(key="k", image=Image.new("RGB", (1024, 768)), params={"max_new_tokens": 64})
    cost = hunyuan.cost(req, settings)
    assert cost.vision_tokens == 794 and cost.output_tokens == 64
    assert 5 < cost.prompt_tokens < 30


