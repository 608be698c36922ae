"""The official ``openai`` SDK, pointed at ``ocrq serve`` with ``base_url`` and a key, runs an
unmodified batch script end to end: upload, create, poll ``request_counts``, download the output
and error files; a batch cancelled mid-way keeps what finished; a file whose every line is bad
makes a failed batch that says why; batch webhooks are signed like job ones."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
from openai import OpenAI

from tests.fixtures.images import word_images
from tests.integration.api_support import Receiver, api_factory, tokens, wait_for  # noqa: F401 - fixture
from tests.integration.conftest import worker_env

pytestmark = pytest.mark.integration


def _request(custom_id: str, image: Path) -> str:
    uri = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tencent/HunyuanOCR", "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": uri}},
                           {"type": "text", "text": "Extract the text in the image."}]}]}})


def _run_batch(client: OpenAI, body: bytes) -> object:
    """What a user's batch script does, unchanged."""
    batch_input = client.files.create(file=("requests.jsonl", body), purpose="batch")
    batch = client.batches.create(input_file_id=batch_input.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"pipeline": "nightly"})
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    return batch


def test_the_openai_sdk_runs_a_batch_script(redis_url, redis_client, start_worker, api_factory, tmp_path: Path):  # noqa: F811
    images = word_images(tmp_path / "img", 6)
    keys = tokens(tmp_path / "tenants.json", "acme")
    receiver = Receiver({"acme": keys["acme"][1]}).start()
    tenants = {"acme": {"webhook_url": receiver.url}}
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                     OCRQ_API__TENANTS_FILE=str(tmp_path / "tenants.json"), OCRQ_API__TENANTS=json.dumps(tenants),
                     OCRQ_API__WEBHOOK_ALLOW_HOSTS='["127.0.0.1"]')
    start_worker(env, name="oai")
    api = api_factory(env)
    client = OpenAI(base_url=f"{api.url}/v1", api_key=keys["acme"][0])

    # Given a batch file of 6 requests and 2 that cannot run
    paths = sorted(images)
    lines = [_request(f"req-{i}", p) for i, p in enumerate(paths)]
    lines.append(json.dumps({"custom_id": "no-image", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "m", "messages": [{"role": "user", "content": "hello"}]}}))
    lines.append("{not json")
    batch = _run_batch(client, ("\n".join(lines) + "\n").encode())

    # Then it completes with counts as OpenAI gives them, and both files download
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (8, 6, 2)
    assert batch.metadata == {"pipeline": "nightly"}
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(6)]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"][0]["message"]["content"]
               for o in out)
    assert len(err) == 2 and "no-image" in {e["custom_id"] for e in err}
    assert client.batches.list(limit=10).data[0].id == batch.id
    assert {f.id for f in client.files.list().data} >= {batch.input_file_id}
    assert client.files.retrieve(batch.output_file_id).bytes == len(client.files.content(batch.output_file_id).content)
    # its webhook: batch.completed, signed with the tenant's secret (the tenant's default URL)
    got = wait_for(lambda: receiver.delivered(), what="batch.completed")
    assert got[0]["body"]["type"] == "batch.completed" and got[0]["tenant"] == "acme"
    assert got[0]["body"]["data"]["id"] == batch.id

    # A file whose every line is bad: a failed batch, its errors line by line
    bad = _run_batch(client, b'{"custom_id": "x"}\n{"nope": 1}\n')
    assert bad.status == "failed" and bad.errors is not None and len(bad.errors.data) == 2, bad
    # An uploaded file can be deleted; another tenant never sees any of it
    assert client.files.delete(bad.input_file_id).deleted
    other = OpenAI(base_url=f"{api.url}/v1", api_key=tokens(tmp_path / "tenants.json", "globex")["globex"][0])
    time.sleep(1.1)  # (the tenants file is read again within a second)
    with pytest.raises(Exception, match="404|not found|No such"):
        other.batches.retrieve(batch.id)
    with pytest.raises(Exception, match="404|not found|No such"):
        other.files.content(batch.output_file_id)


def test_a_batch_cancelled_mid_way_keeps_what_finished(redis_url, redis_client, start_worker, api_factory,  # noqa: F811
                                                      tmp_path: Path):
    images = sorted(word_images(tmp_path / "img", 120))
    keys = tokens(tmp_path / "tenants.json", "acme")
    env = worker_env(redis_url, tmp_path / "store", [tmp_path], OCRQ_ENGINE__KIND="simulated",
                     OCRQ_ENGINE__EXTRA=json.dumps({"image_latency_s": 0.05}), OCRQ_QUEUE__CHUNK_SIZE="8",
                     OCRQ_API__TENANTS_FILE=str(tmp_path / "tenants.json"), OCRQ_API__DELIVER_WEBHOOKS="false")
    start_worker(env, name="oai2")
    client = OpenAI(base_url=f"{api_factory(env).url}/v1", api_key=keys["acme"][0])
    body = ("\n".join(_request(f"r{i}", p) for i, p in enumerate(images)) + "\n").encode()
    batch_input = client.files.create(file=("big.jsonl", body), purpose="batch")
    batch = client.batches.create(input_file_id=batch_input.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 20, what="20 done")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    final = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b,
                     what="cancelled")
    done = final.request_counts.completed
    assert 20 <= done < 120, final.request_counts
    out = client.files.content(final.output_file_id).text.splitlines()
    err = [json.loads(x) for x in client.files.content(final.error_file_id).text.splitlines()]
    assert len(out) == done
    assert len(out) + len(err) == 120 and {e["error"]["code"] for e in err} == {"batch_cancelled"}
