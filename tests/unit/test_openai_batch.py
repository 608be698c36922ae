"""OpenAI Batch lines in (producer.openai_requests, producer.inline_images) and out
(ocrq.output.openai_responses): parsing, the task a prompt selects, size caps, and the shapes checked
with the real libraries (openai's ChatCompletion; vLLM's batch models in the vllm tier)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from ocrq import keys
from ocrq.errors import MissingObject, RefusedRef, TooLarge
from ocrq.jobs.feed import Submission, shard_bytes, shard_lines, shard_specs
from ocrq.messages import Chunk, Item
from ocrq.net.fetch import fetch
from ocrq.output.openai_responses import final_lines, rejected_line, result_line
from ocrq.prompts import prompt
from ocrq.refs import parse
from ocrq.results import ErrorInfo, ImageRecord, ImageResult, ImageStatus, OcrLine, OcrOutput
from ocrq.settings import LimitSettings
from ocrq.store.sqlite_store import SqliteStore
from producer.inline_images import InlineImages, decode_data_uri
from producer.intake import IntakePlan
from producer.openai_requests import InvalidLine, custom_id_of, parse_line

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openai-batch.jsonl"
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


def line(content: Any, **body: Any) -> str:
    doc = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}}
    return json.dumps(doc)


def image(url: str = PNG) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(("text", "task", "params"), [
    (prompt("text"), "text", {}),
    (prompt("text", version="1.0"), "text", {}),
    (prompt("parse"), "parse", {}),
    (prompt("spotting", version="1.0"), "spotting", {}),
    ("  " + prompt("spotting") + "\n", "spotting", {}),
    (prompt("extract", {"fields": ["name", "total"]}), "extract", {"fields": ["name", "total"]}),
    (prompt("translate", {"target_lang": "German"}, "1.0"), "translate", {"target_lang": "German"}),
    ("What is the total amount?", "text", {"prompt": "What is the total amount?"}),
])
def test_a_prompt_selects_its_task_and_any_other_text_is_a_custom_prompt(text, task, params):
    req = parse_line(line([image(), {"type": "text", "text": text}]))
    assert (req.custom_id, req.image, req.task, req.params) == ("c1", PNG, task, params)


def test_sampling_fields_map_where_they_mean_the_same():
    assert parse_line(line([image()], max_tokens=256, temperature=0.7)).params == {"max_new_tokens": 256}
    assert parse_line(line([image()], max_completion_tokens=64)).params == {"max_new_tokens": 64}
    # no text at all: plain reading; system turns are not HunyuanOCR's prompt
    doc = json.loads(line([image()]))
    doc["body"]["messages"].insert(0, {"role": "system", "content": "You are helpful."})
    assert parse_line(json.dumps(doc)).task == "text" and parse_line(json.dumps(doc)).params == {}
    # image_url as a bare string (accepted by some clients)
    assert parse_line(line([{"type": "image_url", "image_url": "https://example.com/a.png"}])).image == (
        "https://example.com/a.png")


@pytest.mark.parametrize(("raw", "why"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}), "custom_id"),
    (line([image()]).replace("/v1/chat/completions", "/v1/embeddings"), "url must be"),
    (line([image()]).replace('"POST"', '"GET"'), "method must be POST"),
    (line([image()], stream=True), "stream"),
    (line([image()], n=2), "n must be 1"),
    (line("just text"), "no image_url"),
    (line([image(), image()]), "2 images"),
    (line([image(), {"type": "input_audio", "input_audio": {}}]), "unsupported content part"),
    (line([image()], max_tokens=0), "max_tokens"),
    (line([image()], max_tokens="many"), "max_tokens"),
    (line([{"type": "image_url", "image_url": {"url": ""}}]), "image_url.url"),
])
def test_a_line_that_cannot_run_says_why(raw, why):
    with pytest.raises(InvalidLine, match=why):
        parse_line(raw)
    assert custom_id_of(raw) in ("", "c1")


def test_a_data_uri_is_capped_before_it_is_decoded(monkeypatch):
    data = b"x" * 300
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_uri(uri, 300) == data
    assert decode_data_uri("data:,a%20b", 10) == b"a b"

    def never(*_: Any, **__: Any) -> bytes:
        raise AssertionError("decoded an oversized data: URI")

    monkeypatch.setattr("producer.inline_images.base64.b64decode", never)
    with pytest.raises(TooLarge, match="limits.max_bytes"):
        decode_data_uri("data:image/png;base64," + "A" * 10_000, 1_000)
    monkeypatch.undo()
    with pytest.raises(TooLarge):  # just over: caught once decoded
        decode_data_uri("data:image/png;base64," + base64.b64encode(b"x" * 301).decode(), 300)
    for bad in ("data:image/png;base64", "data:image/png;base64,!!!!", "data:image/png;base64,"):
        with pytest.raises(InvalidLine):
            decode_data_uri(bad, 1000)


def test_an_inline_image_is_written_once_and_read_back_through_its_store_ref(tmp_path):
    store = SqliteStore(tmp_path / "store")
    inline = InlineImages(store, max_bytes=1000, job="acme~invoices")
    ref = inline.ref(PNG)
    digest = ref.rsplit("/", 1)[1]
    assert store.get_many([keys.inline_input("acme~invoices", digest)]) == {}  # written in groups: flush first
    inline.flush()
    assert ref == f"store:{keys.inline_input('acme~invoices', digest)}" and inline.ref(PNG) == ref
    limits = LimitSettings()
    assert "store" in limits.allowed_schemes
    assert fetch(ref, limits, store=store, job="acme~invoices") == base64.b64decode(PNG.split(",", 1)[1])
    with pytest.raises(TooLarge):
        fetch(ref, LimitSettings(max_bytes=8), store=store, job="acme~invoices")
    with pytest.raises(MissingObject):
        fetch("store:inputs/j/" + "0" * 64, limits, store=store, job="j")
    # a store: ref names an inline input and nothing else of the store
    for bad in ("store:results/j/index.json", "store:inputs/../cache/x", "store:inputs/ABC",
                "store:inputs/" + "0" * 64, "store:inputs/../../x/" + "0" * 64, "store:inputs/j/../k/" + "0" * 64):
        with pytest.raises(RefusedRef):
            parse(bad, limits)
    with pytest.raises(RefusedRef, match="not allowed"):
        parse(ref, LimitSettings(allowed_schemes=["file"]))


def test_an_inline_image_is_readable_only_by_the_job_that_wrote_it(tmp_path):
    """Another job (another tenant's) that names the ref, knowing the hash, is refused: the image
    is never read for it."""
    store = SqliteStore(tmp_path / "store")
    inline = InlineImages(store, max_bytes=1000, job="acme~invoices")
    ref = inline.ref(PNG)
    inline.flush()
    for other in ("rival~invoices", "invoices", "acme~other", None):
        with pytest.raises(RefusedRef, match="another job"):
            fetch(ref, LimitSettings(), store=store, job=other)


def test_each_image_carries_its_own_task_through_its_shard_and_message(tmp_path):
    store = SqliteStore(tmp_path / "store")
    plan = IntakePlan.new()
    plan.accept("/a.png", {"custom_id": "a"}, {"task": "spotting", "params": {"max_new_tokens": 9}})
    plan.accept("/b.png", None)
    assert list(plan.entries()) == [("/a.png", {"custom_id": "a"}), ("/b.png", None)]
    assert [spec for *_, spec in plan.items()] == [{"task": "spotting", "params": {"max_new_tokens": 9}}, None]
    sub = Submission("s", 1, 1, "text", {}, "ocrq", None)
    lines = [("i1", "/a.png", {"custom_id": "a"}, {"task": "spotting", "params": {}}), ("i2", "/b.png", None, None)]
    store.put_many([(keys.refs_shard("j", "s", 0), shard_bytes(lines))])
    assert shard_lines(store, "j", sub, 0) == [("i1", "/a.png", {"custom_id": "a"}), ("i2", "/b.png", None)]
    specs = [spec for _, spec in shard_specs(store, "j", sub, 0)]
    assert specs == [{"task": "spotting", "params": {}}, None]
    items = [Item(id="i1", ref="/a.png", **specs[0]), Item(id="i2", ref="/b.png")]
    chunk = Chunk(job="j", task="parse", params={"x": 1}, items=items)
    message = chunk.to_message()
    assert "task" not in message["items"][1] and message["items"][0]["task"] == "spotting"
    again = Chunk.model_validate(message)
    assert [again.spec(it) for it in again.items] == [("spotting", {}), ("parse", {"x": 1})]


def _done(meta: dict[str, Any] | None = None) -> ImageResult:
    record = ImageRecord(id="abc", job="j", ref="store:inputs/x", status=ImageStatus.done, pages=1,
                         row={"custom_id": "req-1"}, updated=1_800_000_000.5)
    box = [[0.0, 0.0], [9.0, 0.0], [9.0, 9.0], [0.0, 9.0]]
    out = OcrOutput(text="hello", lines=[OcrLine(text="hello", box=box, confidence=0.9)], engine="vllm",
                    model="tencent/HunyuanOCR", width=9, height=9, meta=meta or {})
    return ImageResult(record=record, outputs=[out])


def _failed() -> ImageResult:
    record = ImageRecord(id="def", job="j", ref="/x.png", status=ImageStatus.failed, row={"custom_id": "req-2"},
                         error=ErrorInfo(type="BadImage", message="not an image"))
    return ImageResult(record=record)


def envelopes() -> list[tuple[bool, dict[str, Any]]]:
    """One of each line ocrq writes: done (engine tokens and not), failed, rejected."""
    return [result_line(_done({"generated_tokens": 12, "vision_tokens": 300, "stop_reason": "length"})),
            result_line(_done()), result_line(_failed()),
            (True, rejected_line("req-3", 7, "f" * 16, InvalidLine("no image_url part")))]


def test_output_lines_are_openai_chat_completions():
    from openai.types.chat import ChatCompletion

    (err0, with_tokens), (_, without), (err2, failed), (_, rejected) = envelopes()
    assert (err0, err2) == (False, True)
    body = ChatCompletion.model_validate(with_tokens["response"]["body"])
    assert body.choices[0].message.content == "hello" and body.model == "tencent/HunyuanOCR"
    assert body.choices[0].finish_reason == "length"
    assert body.usage is not None and (body.usage.completion_tokens, body.usage.prompt_tokens) == (12, 300)
    assert with_tokens["custom_id"] == "req-1" and with_tokens["error"] is None
    assert with_tokens["response"]["body"]["ocrq"]["lines"][0]["box"][2] == [9.0, 9.0]
    assert ChatCompletion.model_validate(without["response"]["body"]).usage.total_tokens == 0  # type: ignore[union-attr]
    assert failed["response"] == {"status_code": 400, "request_id": "req_def", "body": None}
    assert failed["error"] == {"code": "BadImage", "message": "not an image"}
    assert rejected["error"]["line"] == 7 and rejected["error"]["code"] == "InvalidLine"
    # only images that came from a batch line and are final are written
    queued = ImageResult(record=ImageRecord(id="q", job="j", ref="/q", status=ImageStatus.queued,
                                            row={"custom_id": "q"}))
    plain = ImageResult(record=ImageRecord(id="p", job="j", ref="/p", status=ImageStatus.done))
    assert [i for i, _, _ in final_lines([_done(), queued, plain, _failed()])] == ["abc", "def"]


def test_the_example_file_parses():
    lines = [raw for raw in EXAMPLE.read_text().splitlines() if raw.strip()]
    assert lines and all(parse_line(raw).custom_id for raw in lines)


@pytest.mark.vllm
def test_vllm_run_batch_accepts_the_inputs_and_reads_the_outputs():
    pytest.importorskip("vllm")
    from worker.engines.vllm.compat import batch_models

    run_batch = batch_models()  # where this vLLM keeps them (it moved after 0.26)
    inputs = [raw for raw in EXAMPLE.read_text().splitlines() if raw.strip()]
    inputs += [line([image(), {"type": "text", "text": prompt("spotting")}], max_tokens=128)]
    for raw in inputs:  # what vllm run-batch accepts, ocrq accepts
        run_batch.BatchRequestInput.model_validate_json(raw)
        parse_line(raw)
    for _, envelope in envelopes():
        out = run_batch.BatchRequestOutput.model_validate(envelope)
        assert out.custom_id == envelope["custom_id"]
        if envelope["error"] is None:
            assert out.response is not None and out.response.body is not None


def test_error_lines_of_a_file_fixed_and_submitted_again_are_not_repeated(tmp_path):
    from ocrq.output.openai_responses import rejected
    from ocrq.results import json_line
    from producer.openai_requests import DuplicateCustomId

    store = SqliteStore(tmp_path / "store")
    bad = InvalidLine("no image_url part")
    first = [rejected_line("a", 1, "v1", bad), rejected_line("b", 3, "v1", DuplicateCustomId("repeats line 2")),
             rejected_line("", 4, "v1", InvalidLine("not JSON")), rejected_line("c", 5, "v1", bad)]
    second = [rejected_line("c", 5, "v2", bad)]  # the same bad line, in the file's next version
    for digest, lines in (("v1", first), ("v2", second)):
        store.put_many([(keys.openai_rejected("j", digest), b"".join(json_line(x) + b"\n" for x in lines))])
    # "a" was fixed and ran; "b" ran from the line it repeats
    kept = [(x["custom_id"], x["error"]["code"]) for x in rejected(store, "j", ran={"a", "b"})]
    assert kept == [("b", "DuplicateCustomId"), ("", "InvalidLine"), ("c", "InvalidLine")]


def test_an_input_file_is_read_from_a_path_or_a_url(tmp_path):
    import functools
    import http.server
    import threading
    from types import SimpleNamespace

    from ocrq.settings import Settings
    from producer.openai_batch import read_lines

    (tmp_path / "batch.jsonl").write_bytes(EXAMPLE.read_bytes())
    fake_client = SimpleNamespace(settings=Settings(limits={"http_allow_private": True}), s3=None)
    lines, base = read_lines(fake_client, str(tmp_path / "batch.jsonl"))  # type: ignore[arg-type]
    assert b"".join(lines) == EXAMPLE.read_bytes() and base == tmp_path.resolve()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/batch.jsonl"
        lines, base = read_lines(fake_client, url)  # type: ignore[arg-type]
        assert b"".join(lines) == EXAMPLE.read_bytes() and base is None
    finally:
        server.shutdown()
    with pytest.raises(RefusedRef, match="no such file"):
        read_lines(fake_client, str(tmp_path / "missing.jsonl"))  # type: ignore[arg-type]
