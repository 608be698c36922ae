"""The security scenario: the same stack behind Redis with a password over TLS, then a grep for
every secret in everything a person or a tool can read afterwards.

1. redis-server with ``--requirepass`` and only a TLS port (a self-signed certificate made now
   with ``cryptography``); workers, producer and Flower use ``rediss://:pw@…?ssl_ca_certs=…``.
   An unauthenticated or a plaintext connection must be refused.
2. A pickle message (whose unpickling would create a file) is published to the queue: the
   workers must refuse it (JSON only) and the file must not exist.
3. A job of ordinary images and presigned S3 URLs (moto; good and missing objects): every image
   gets its record (done, or failed with a permanent type). A ref over ``refs.MAX_REF_CHARS`` is
   refused at submit (``SubmissionRefused``, nothing published) and, in a chunk published around
   the producer, fails its image with ``RefusedRef`` on the worker.
4. Size caps: a submission whose params exceed the cap is refused with ``TooLarge`` before
   anything is recorded; an oversized chunk published around the producer fails its images
   with ``TooLarge``.
5. The hostile inputs of ``bench.chaos.hostile``, one per way a stranger was seen to hurt ocrq:
   crafted messages published around the producer (a job name out of the store, bad fields, a
   URL with a password, another job's inline image), refused submits (a URL with a password, a
   10 MB manifest line), a file holding a password, files over the decode limits (memory, total
   pixels, CPU), a server that trickles its headers, the IPv6 forms of the metadata address.
   The broker's Redis runs with CONFIG renamed away for clients: nothing ocrq does needs it.
6. The grep: the Redis password, the S3 secret key and access key id, every presigned
   signature, a URL's password and a file's contents must not appear in the worker and Flower
   logs, Flower's task API and task page, anything left in Redis (job index, failed registry,
   Celery results), the result documents, the job's export and failed-registry mirror in S3, or
   the output of the ``ocrq`` commands the scenario runs (submit, status, failed, jobs). Broker
   message bodies *in flight* carry the presigned ref (the worker must fetch it; they live in
   Redis behind the password and TLS); the run reports whether they did, and that Flower shows
   them redacted.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from base64 import b64decode, b64encode
from pathlib import Path
from typing import Any

import boto3
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.chaos import hostile
from bench.chaos.stack import Workers
from bench.chaos.verify import Outcome, queue_lists, verify
from bench.services import free_port
from ocrq import keys
from ocrq.errors import TooLarge
from ocrq.messages import OCR_CHUNK_TASK
from ocrq.results import ImageRecord
from ocrq.settings import Settings
from ocrq_cli.embedded.stack import redis_binary
from producer.client import Client, SubmissionRefused


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1/localhost and its key (PEM)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ocrq-chaos")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (crt := folder / "redis.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (pem := folder / "redis.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    pem.chmod(0o600)
    return crt, pem


def start_tls_redis(folder: Path, password: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    binary = redis_binary()
    assert binary, "redis-server not found"
    crt, key = self_signed(folder / "tls")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--tls-cert-file", str(crt),
         "--tls-key-file", str(key), "--tls-ca-cert-file", str(crt), "--tls-auth-clients", "no",
         "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(folder),
         "--rename-command", "CONFIG", ""],  # nothing ocrq does needs CONFIG: clients get none
        stdout=(folder / "redis.log").open("ab"), stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, password=password, ssl=True, ssl_ca_certs=str(crt))
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} has no TLS support (install Debian's redis-server: make test-prereqs):"
                               f" {(folder / 'redis.log').read_text()[-500:]}")
        try:
            client.ping()
            return proc, port, crt
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("TLS redis-server did not start")


def message_body(raw: bytes) -> str:
    """A kombu envelope from a Redis queue list with its (base64) body decoded."""
    envelope = json.loads(raw)
    body = envelope.get("body", "")
    if envelope.get("properties", {}).get("body_encoding") == "base64":
        body = b64decode(body).decode(errors="replace")
    return f"{raw.decode(errors='replace')}\n{body}"


def dump_redis(r: redis.Redis) -> str:
    """Every key and value in the database as text."""
    out = []
    read = {"string": r.get, "hash": r.hgetall, "set": r.smembers,
            "list": lambda k: r.lrange(k, 0, -1), "zset": lambda k: r.zrange(k, 0, -1)}
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        value: Any = read[kind](key) if kind in read else None
        out.append(f"{key!r} {value!r}")
    return "\n".join(out)


class Evil:
    """Unpickling this creates ``path``: proof that a pickle message was deserialized."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def flower_get(port: int, auth: str, path: str) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": "Basic " + b64encode(auth.encode()).decode()})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def failed_record(client: Client, job: str, image_id: str) -> ImageRecord | None:
    """A failed image's record, from the failed registry's mirror in the store."""
    doc = client.store.get_json(keys.failed_object(job, image_id))
    return ImageRecord.model_validate(doc["record"]) if isinstance(doc, dict) else None


def run_security(root: Path, images: Path, s3_port: int, n: int) -> tuple[Outcome, list[str]]:  # noqa: C901
    notes: list[str] = []
    problems: list[str] = []
    password = "redis-pw-" + secrets.token_hex(12)
    access_key, secret_key = "AKIACHAOS" + secrets.token_hex(6).upper(), "s3-secret-" + secrets.token_hex(16)
    folder = root / "security"
    folder.mkdir(parents=True, exist_ok=True)
    server, port, crt = start_tls_redis(folder, password)
    url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={crt}"
    endpoint = f"http://127.0.0.1:{s3_port}"
    for what, kwargs in (("without a password", {"ssl": True, "ssl_ca_certs": str(crt)}),
                         ("in plaintext", {"password": password})):
        try:
            redis.Redis(port=port, socket_timeout=3, **kwargs).ping()  # type: ignore[arg-type]
            problems.append(f"Redis answered a client {what}")
        except redis.RedisError:
            pass
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=access_key,
                      aws_secret_access_key=secret_key)
    s3.create_bucket(Bucket="chaos-src")
    local = sorted(images.iterdir())[:n]
    signed = []
    for p in local[:10]:
        s3.put_object(Bucket="chaos-src", Key=f"scans/{p.name}", Body=p.read_bytes())
        signed.append(s3.generate_presigned_url("get_object", Params={"Bucket": "chaos-src", "Key": f"scans/{p.name}"},
                                                ExpiresIn=3600))
    missing = [s3.generate_presigned_url("get_object", Params={"Bucket": "chaos-src", "Key": f"gone/{i}.png"},
                                         ExpiresIn=3600) for i in range(3)]
    signatures = [u.rpartition("X-Amz-Signature=")[2].partition("&")[0] for u in signed + missing]
    secrets_to_find = {"redis password": [password], "S3 secret key": [secret_key], "S3 access key id": [access_key],
                       "presigned signature": signatures}
    h = hostile.prepare(folder, images, "sec-main")
    refs = [str(p) for p in local[10:]] + signed + missing + h.refs
    long_ref = str(images / ("x" * 9000))

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OCRQ_REDIS__URL": url, "OCRQ_STORE__KIND": "s3",
           "OCRQ_STORE__BUCKET": "chaos", "OCRQ_STORE__ENDPOINT_URL": endpoint,
           "OCRQ_STORE__ACCESS_KEY_ID": access_key, "OCRQ_STORE__SECRET_ACCESS_KEY": secret_key,
           "OCRQ_LIMITS__ALLOWED_ROOTS": json.dumps([str(images)]), "OCRQ_LIMITS__HTTP_ALLOW_PRIVATE": "true",
           "OCRQ_ENGINE__KIND": "simulated", "OCRQ_BATCH__MODE": "auto", "OCRQ_QUEUE__CHUNK_SIZE": "16",
           "OCRQ_LOG_LEVEL": "INFO", "OCRQ_METRICS_PORT": "0", "OCRQ_QUEUE__BACKOFF_BASE": "0.2",
           **hostile.WORKER_ENV}
    env.pop("OCRQ_CONFIG", None)
    settings = Settings(redis={"url": url}, limits={"allowed_roots": [images], "http_allow_private": True},
                        store={"kind": "s3", "bucket": "chaos", "endpoint_url": endpoint, "access_key_id": access_key,
                               "secret_access_key": secret_key}, queue={"chunk_size": 16})
    client = Client(settings)
    r = client.redis
    logs = folder / "logs"
    workers = Workers(env, logs, url, n=2)
    flower_port, flower_auth = free_port(), "ops:" + secrets.token_hex(8)
    flower = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "ocrq.broker.celery_app", "flower",
         f"--port={flower_port}", "--address=127.0.0.1", f"--basic_auth={flower_auth}"],
        env=env, stdout=(folder / "flower.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # 4. caps, producer side: refused before anything is recorded
        try:
            client.submit([refs[0]], job="sec-params", params={"blob": "x" * settings.queue.max_message_bytes})
            problems.append("an oversized submission was accepted")
        except TooLarge as exc:
            notes.append(f"oversized params refused: {str(exc)[:60]}…")
        if client.index.counts("sec-params")["total"]:
            problems.append("the refused submission left records")
        try:  # an over-long ref: the whole submission is refused, nothing published
            client.submit([*refs[:2], long_ref], job="sec-long")
            problems.append("a submission with an over-long ref was accepted")
        except SubmissionRefused as exc:
            notes.append(f"over-long ref refused at submit: {str(exc)[:70]}…")
        if client.index.counts("sec-long")["total"]:
            problems.append("the refused submission with an over-long ref left records")
        # messages published before the workers start: what the broker's bodies carry in flight
        job = client.submit(refs, job="sec-main")
        bodies = "\n".join(message_body(x) for k in queue_lists(r, settings.queue.name)
                           for x in r.lrange(k, 0, -1))
        carried = sum(s in bodies for s in signatures)
        notes.append(f"in-flight broker bodies carry {carried}/{len(signatures)} presigned refs (Redis, TLS+password)")
        # 2. a pickle message, then an oversized chunk from outside the producer
        marker = folder / "pickle-was-loaded"
        client.app.send_task(OCR_CHUNK_TASK, args=[Evil(marker)], serializer="pickle", task_id="sec-pickle")
        big_items = [{"id": keys.image_id("sec-big", str(p)), "ref": str(p)} for p in local[10:12]]
        client.app.send_task(OCR_CHUNK_TASK, task_id="sec-big", args=[{
            "job": "sec-big", "task": "text", "items": big_items,
            "params": {"blob": "y" * (settings.queue.max_message_bytes + 1)}}])
        long_id = keys.image_id("sec-long-chunk", long_ref)
        client.app.send_task(OCR_CHUNK_TASK, task_id="sec-long-chunk", args=[{
            "job": "sec-long-chunk", "task": "text", "items": [{"id": long_id, "ref": long_ref}]}])
        hostile.publish_around_the_producer(h, client.app, client.store, str(local[10]))
        hostile.submit_refused(h, env)
        try:
            r.execute_command("CONFIG", "GET", "maxmemory")
            problems.append("the broker's Redis answered CONFIG")
        except redis.ResponseError:
            notes.append("the broker's Redis has no CONFIG for clients; the run needs none")
        workers.start_all()
        job.wait(timeout=300, poll=0.5)
        time.sleep(3.0)  # last events reach Flower, last acks land
        ids = {keys.image_id("sec-main", ref) for ref in refs}
        outcome = verify(r, client.index, client.store, job.name, ids, settings.queue.name)
        # (a failed image's record is its store document: Redis keeps a one-letter marker)
        long_rec = failed_record(client, "sec-long-chunk", long_id)
        if long_rec is None or long_rec.error is None or long_rec.error.type != "RefusedRef":
            problems.append(f"over-long ref: {long_rec}")
        big = [failed_record(client, "sec-big", it["id"]) for it in big_items]
        if not all(b is not None and b.error is not None and b.error.type == "TooLarge" for b in big):
            problems.append(f"oversized chunk not failed TooLarge: {big}")
        else:
            notes.append("oversized chunk: its 2 images failed TooLarge")
        if marker.exists():
            problems.append("a pickle message was deserialized")
        hostile.check_fetch_refuses_ipv6_forms(h)
        listed = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="chaos")
                  for o in page.get("Contents", [])]
        hostile.check_outcomes(h, lambda j, i: failed_record(client, j, i), listed)
        hostile.cli_outputs(h, env, job.name)
        worker_logs = "\n".join(p.read_text(errors="replace") for p in logs.glob("*.log"))
        if "ContentDisallowed" not in worker_logs and "untrusted content" not in worker_logs:
            problems.append("no worker logged refusing the pickle message")
        else:
            notes.append("pickle message refused (ContentDisallowed), not loaded")
        # 5. the grep
        places = {"worker logs": worker_logs, "Flower log": (folder / "flower.log").read_text(errors="replace"),
                  "Redis after the run": dump_redis(r)}
        try:
            api = flower_get(flower_port, flower_auth, "/api/tasks?limit=1000")
            tasks = json.loads(api)
            places["Flower /api/tasks"] = api
            some = next((t for t, v in tasks.items() if "FAILED" in str(v.get("result"))), next(iter(tasks), ""))
            places["Flower task page"] = flower_get(flower_port, flower_auth, f"/task/{some}")
            if not any("REDACTED" in str(v.get("args")) for v in tasks.values()):
                problems.append("Flower shows no redacted task args (did the chunk tasks reach it?)")
        except OSError as exc:
            problems.append(f"Flower unreachable: {exc}")
        try:  # the job's export (results/{job}/export/) is read too
            job.wait_export(timeout=60)
        except TimeoutError:
            problems.append("no export of the finished job")
        stored = [*client.store.list(keys.results_prefix("sec-main")),
                  *client.store.list(f"{keys.FAILED_OBJECTS}sec-main/")]
        raw = client.store.get_many(stored, raw=True)
        places["result documents, export and failed mirror in S3"] = "\n".join(
            bytes(v).decode(errors="replace") for v in raw.values())
        places["ocrq commands' output"] = "\n".join(h.outputs)
        secrets_to_find.update(h.secrets)
        problems += h.problems
        notes += h.notes
        leaks = [f"{what} in {where}" for where, text in places.items() for what, values in secrets_to_find.items()
                 if any(v and v in text for v in values)]
        problems += [f"leak: {x}" for x in leaks]
        notes.append(f"grep of {len(places)} places for {sum(map(len, secrets_to_find.values()))} secrets:"
                     f" {len(leaks)} leaks")
        outcome.problems += problems
        return outcome, notes
    finally:
        hostile.close(h)
        workers.stop_all()
        flower.terminate()
        flower.wait(10)
        client.close()
        server.terminate()
        server.wait(10)
