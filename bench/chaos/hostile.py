"""The security scenario's hostile inputs (bench.chaos.security runs them beside its job): one per
way a stranger on the broker, in a URL, a file or a request was seen to hurt ocrq, each with
the outcome it must get.

Published around the producer (straight to the broker, as anyone who can reach Redis could):
    a chunk whose job name walks out of the store, and its finish task   dropped, nothing written
    a chunk of a real job with an unknown task, a bad attempt, a bad row  BadMessage per image
    a URL with a password, published as a ref                            RefusedRef, never fetched
    another job's inline image (store:inputs/{job}/{sha})                 RefusedRef
Submitted (the producer, and `ocrq submit`):
    a URL with a password                                  refused at submit, password not echoed
    a manifest with a 10 MB line                           refused by its length, echo cut
    a file holding a password (like var/flower-auth)       BadImage describing it, never quoting it
    a 144 MP 16-bit PNG over decode_memory_bytes           TooLarge, its child replaced
    a multi-frame TIFF over max_document_pixels            TooLarge
    a file that burns the decoder's CPU                    TooLarge (decode_cpu_s)
    a URL whose server trickles its headers                StorageUnavailable within http_timeout
And the worker's fetch with default limits refuses the IPv6 forms that carry the metadata address
(no traffic: refused before connecting). The secrets these put in play join the scenario's grep.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from PIL import Image

from ocrq import keys
from ocrq.errors import OcrqError, RefusedRef
from ocrq.messages import FINISH_JOB_TASK, OCR_CHUNK_TASK
from ocrq.net.fetch import fetch
from ocrq.settings import LimitSettings
from worker.decoding.decode import FAULT_SPIN

#: what the security workers run with, so each limit is reached by a small file in seconds
WORKER_ENV = {"OCRQ_LIMITS__HTTP_TIMEOUT": "3", "OCRQ_LIMITS__DECODE_MEMORY_BYTES": str(256 << 20),
              "OCRQ_LIMITS__DECODE_CPU_S": "2", "OCRQ_LIMITS__DECODE_FAULT_MARKERS": "true",
              "OCRQ_LIMITS__MAX_DOCUMENT_PIXELS": "20000000", "OCRQ_QUEUE__MAX_ATTEMPTS": "2"}
METADATA_FORMS = ("::ffff:169.254.169.254", "::169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1")


@dataclass
class Hostile:
    folder: Path
    images: Path
    #: (job, image id) → the error type its record must end with
    expect: dict[tuple[str, str], str] = field(default_factory=dict)
    #: secrets only these inputs carry: grepped with the scenario's
    secrets: dict[str, list[str]] = field(default_factory=dict)
    #: refs for the scenario's main job (each in ``expect`` under that job)
    refs: list[str] = field(default_factory=list)
    escape: Path = field(default_factory=lambda: Path(f"/tmp/ocrq-chaos-escape-{secrets.token_hex(4)}"))
    outputs: list[str] = field(default_factory=list)
    #: a URL with a password in it (published around the producer, and given to `ocrq submit`)
    userinfo: str = ""
    #: the trickling server's URL, in the main job
    slow: str = ""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None


class _Trickle(BaseHTTPRequestHandler):
    """Sends its status line and headers one byte every 0.5 s (each read well inside a timeout)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        for byte in b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nConnection: close\r\n\r\n":
            try:
                self.wfile.write(bytes([byte]))
            except OSError:
                return
            time.sleep(0.5)


def prepare(folder: Path, images: Path, main_job: str) -> Hostile:
    """Make the hostile files (inside the allowed root) and the trickling server."""
    h = Hostile(folder, images)
    bad = images / "hostile"
    bad.mkdir(parents=True, exist_ok=True)
    secret = "ops:" + secrets.token_urlsafe(18)
    (bad / "flower-auth").write_text(secret + "\n")  # what `ocrq submit var/flower-auth` read
    h.secrets["a file's contents"] = [secret]
    big = bad / "bomb-16bit.png"  # 144 MP: 288 MB as 16-bit, over the workers' 256 MiB
    Image.frombytes("I;16", (12000, 12000), bytes(12000 * 12000 * 2)).save(big, compress_level=9)
    frames = [Image.new("L", (2000, 2000), i * 9) for i in range(24)]
    buf = io.BytesIO()
    frames[0].save(buf, "TIFF", save_all=True, append_images=frames[1:], compression="tiff_deflate")
    (bad / "frames.tif").write_bytes(buf.getvalue())  # 96 MP of frames, over the workers' 20 MP
    spin = Image.new("RGB", (32, 32), "white")
    buf = io.BytesIO()
    spin.save(buf, "PNG")
    (bad / "spin.png").write_bytes(buf.getvalue() + FAULT_SPIN)
    h.server = ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    h.server.daemon_threads = True
    threading.Thread(target=h.server.serve_forever, daemon=True).start()
    slow = h.slow = f"http://127.0.0.1:{h.server.server_address[1]}/slow.png"
    for ref, error in ((str(bad / "flower-auth"), "BadImage"), (str(big), "TooLarge"),
                       (str(bad / "frames.tif"), "TooLarge"), (str(bad / "spin.png"), "TooLarge"),
                       (slow, "RetriesExhausted")):
        h.refs.append(ref)
        h.expect[(main_job, keys.image_id(main_job, ref))] = error
    return h


def publish_around_the_producer(h: Hostile, app: Any, store: Any, good: str) -> None:
    """Chunks and finish tasks straight to the broker (``good``: an image file any job may read)."""
    bad_job = "../../../../../../../../.." + str(h.escape)
    app.send_task(OCR_CHUNK_TASK, args=[{"job": bad_job, "task": "text",
                                         "items": [{"id": keys.image_id(bad_job, good), "ref": good}]}])
    app.send_task(FINISH_JOB_TASK, args=[bad_job])
    items = [{"id": keys.image_id("sec-crafted", f"{good}?{n}"), "ref": good} for n in range(3)]
    items[0]["attempt"], items[1]["row"], items[2]["task"] = "many", ["not", "a", "row"], "__import__('os')"
    app.send_task(OCR_CHUNK_TASK, args=[{"job": "sec-crafted", "task": "text", "items": items}])
    for it in items:
        h.expect[("sec-crafted", it["id"])] = "BadMessage"
    password = "url-pw-" + secrets.token_hex(6)
    h.secrets["a URL's password"] = [password]
    userinfo = f"http://alice:{password}@127.0.0.1:9/a.png"
    h.userinfo = userinfo
    inline = _inline_of_another_job(store)
    crafted = [{"id": keys.image_id("sec-refs", r), "ref": r} for r in (userinfo, inline)]
    app.send_task(OCR_CHUNK_TASK, args=[{"job": "sec-refs", "task": "text", "items": crafted}])
    for it in crafted:
        h.expect[("sec-refs", it["id"])] = "RefusedRef"


def _inline_of_another_job(store: Any) -> str:
    """An inline image job sec-owner wrote (as `submit --openai-batch` does), named by another."""
    buf = io.BytesIO()
    Image.new("L", (8, 8), 200).save(buf, "PNG")
    data = buf.getvalue()
    key = keys.inline_input("sec-owner", hashlib.sha256(data).hexdigest())
    store.put_many([(key, data)])
    return f"store:{key}"


def submit_refused(h: Hostile, env: dict[str, str]) -> None:
    """`ocrq submit` of what must be refused before anything is published; outputs kept for the grep."""
    userinfo = h.userinfo
    manifest = h.images / "hostile" / "long.jsonl"
    manifest.write_text(json.dumps({"ref": "x" * (10 << 20)}) + "\n")
    for args, says in ((["submit", userinfo, "--job", "sec-cli-userinfo"], "user name or password"),
                       (["submit", str(manifest), "--job", "sec-cli-long"], "not read")):
        done = _cli(args, env)
        h.outputs.append(done.stdout + done.stderr)
        text = " ".join((done.stdout + done.stderr).split())
        if done.returncode != 2 or says not in text:
            h.problems.append(f"`ocrq {args[0]} …` of a refused input exited {done.returncode}: {text[-300:]}")
        elif len(done.stdout + done.stderr) > 20_000:
            h.problems.append(f"`ocrq submit` echoed {len(done.stdout + done.stderr):,} characters of a refused input")
    h.notes.append("`ocrq submit` refused a URL with a password and a 10 MB manifest line (exit 2)")


def check_fetch_refuses_ipv6_forms(h: Hostile) -> None:
    refused = 0
    for address in METADATA_FORMS:
        try:
            fetch(f"http://[{address}]/latest/meta-data/", LimitSettings())
        except RefusedRef as exc:
            refused += "non-public" in str(exc)
        except OcrqError as exc:
            h.problems.append(f"[{address}]: {type(exc).__name__} (not refused before connecting): {exc}")
    if refused != len(METADATA_FORMS):
        h.problems.append(f"only {refused}/{len(METADATA_FORMS)} IPv6 forms of 169.254.169.254 refused")
    h.notes.append(f"{refused} IPv6 forms of the metadata address refused before connecting")


def check_outcomes(h: Hostile, record_of: Any, store_keys: list[str]) -> None:
    """Every hostile image ended as expected; nothing left the store's root or the file system."""
    wrong = []
    for (job, image_id), want in h.expect.items():
        rec = record_of(job, image_id)
        got = rec.error.type if rec is not None and rec.error is not None else (rec.status.value if rec else None)
        if got != want:
            why = rec.error.message[:120] if rec is not None and rec.error is not None else ""
            wrong.append(f"{job}/{image_id[:8]}: {got} (want {want}; {why})")
    slow = record_of(next(iter(h.expect))[0], keys.image_id(next(iter(h.expect))[0], h.slow))
    if slow is None or slow.error is None or "within http_timeout" not in slow.error.message:
        wrong.append(f"the trickling URL: {slow.error if slow else None} (want one deadline: 'within http_timeout')")
    h.problems += [f"hostile input: {w}" for w in wrong]
    if h.escape.exists():
        h.problems.append(f"a crafted job name wrote {h.escape}")
    if any(".." in k.split("/") for k in store_keys):
        h.problems.append("a store key with '..' was written")
    h.notes.append(f"{len(h.expect) - len(wrong)}/{len(h.expect)} hostile inputs ended as they must"
                   " (BadMessage, RefusedRef, BadImage, TooLarge ×3, a trickling URL within http_timeout)")


def cli_outputs(h: Hostile, env: dict[str, str], job: str) -> None:
    for args in (["status", job], ["failed", "--job", job], ["jobs"], ["failed", "--job", "sec-crafted"]):
        done = _cli(args, env)
        h.outputs.append(done.stdout + done.stderr)
        if done.returncode not in (0, 3):
            h.problems.append(f"`ocrq {' '.join(args)}` exited {done.returncode}: {done.stderr[-200:]}")


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ocrq_cli", *args], env=env, text=True, capture_output=True,
                          timeout=180)


def close(h: Hostile) -> None:
    if h.server is not None:
        h.server.shutdown()
        h.server.server_close()
