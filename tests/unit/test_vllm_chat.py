"""The vllm-server engine's request bodies (pure: no server). The integration tier sends them to
a real server (tests/integration/test_vllm_server.py)."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from ocrq.engine_settings import VllmServerSettings
from ocrq.errors import BadRequest
from worker.engines import hunyuan
from worker.engines.base import OcrRequest
from worker.engines.vllm.chat import encode_body, request_body


def _body(transport: str, prompt: str = "Extract the text. «ünïcode» \"quoted\" \\ back") -> dict:
    image = Image.new("RGB", (40, 24), (10, 200, 30))
    image.putpixel((3, 5), (255, 0, 0))
    settings = VllmServerSettings(kind="vllm-server", image_transport=transport)  # type: ignore[arg-type]
    version = hunyuan.version_of(settings)
    return request_body(OcrRequest(key="k", image=image, params={"prompt": prompt}), model="m",
                        version=version, sampling=hunyuan.SAMPLING[version], settings=settings)


def _url(body: dict) -> str:
    parts = [p for m in body["messages"] if isinstance(m["content"], list) for p in m["content"]]
    return next(p["image_url"]["url"] for p in parts if p.get("type") == "image_url")


@pytest.mark.parametrize("transport", ["ppm", "png"])
def test_encoded_body_is_the_body_as_json(transport: str) -> None:
    body = _body(transport)
    assert json.loads(encode_body(body)) == body  # prompt escapes and UTF-8 survive the splice
    header, data = _url(body).split(",", 1)
    assert header == {"ppm": "data:image/x-portable-pixmap;base64", "png": "data:image/png;base64"}[transport]
    decoded = Image.open(io.BytesIO(base64.b64decode(data)))
    assert decoded.format == transport.upper() and decoded.getpixel((3, 5)) == (255, 0, 0)  # lossless


def test_a_url_that_would_need_escapes_is_refused() -> None:
    body = _body("ppm")
    parts = body["messages"][1]["content"]
    parts[0]["image_url"]["url"] = 'data:image/png;base64,AA"AA'
    with pytest.raises(BadRequest, match="escapes"):
        encode_body(body)


def test_the_slot_marker_in_a_prompt_is_refused() -> None:
    with pytest.raises(BadRequest, match="marker"):
        encode_body(_body("ppm", prompt="ocrq-image-url-slot"))
