"""The commands that run the fleet: the embedded stack (``up``, ``down``, ``flower``), one worker
in the foreground, the metrics exporter, and what the workers' governors learned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.markup import escape

from ocrq_cli.common import (
    command_settings,
    console,
    make_client,
)


def up(wait: float = typer.Option(300, help="seconds to wait for the workers to be ready"),
       allow: list[Path] = typer.Option([], "--allow", help="a directory the workers may read local files "
                                        "from (repeatable; default: limits.allowed_roots, else here)"),
       gpus: str | None = typer.Option(None, help="one worker per GPU: all, or NVML indices/UUIDs like 0,1 "
                                                  "(with a GPU profile, e.g. --config configs/gpu-vllm.yaml)"),
       ha: bool = typer.Option(False, "--ha", help="a local HA Redis: 3 redis-server + 3 Sentinels "
                               "(with redis.url naming them: --config configs/ha.yaml)"),
       ) -> None:
    """Start the embedded stack in the background (state under ./var/)."""
    import os
    import socket

    from ocrq_cli.embedded.gpus import list_gpus, plan_gpu_workers, select_gpus, sharing_note
    from ocrq_cli.embedded.stack import Stack, StackConflict

    settings = command_settings()
    workers = None
    if gpus is not None:
        try:
            workers = plan_gpu_workers(settings, select_gpus(gpus, list_gpus()), socket.gethostname())
        except ValueError as exc:
            console.print(f"[red]{escape(str(exc))}[/]")
            raise typer.Exit(code=2) from exc
        note = sharing_note(settings, os.environ)
        if note:
            console.print(f"[yellow]{escape(note)}[/]")
    try:
        status = Stack(settings, allow=allow).up(wait=wait, workers=workers, ha=ha)
    except StackConflict as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(code=2) from exc
    except RuntimeError as exc:  # a service that did not start: its log says why
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(code=1) from exc
    for name, what in status.items():
        console.print(f"[green]{name:7}[/] {what}", highlight=False)


def flower(address: str = typer.Option("0.0.0.0", help="address Flower binds")) -> None:
    """Run Flower in the foreground on the ocrq app, behind basic auth (OCRQ_FLOWER_BASIC_AUTH,
    else a password generated into the var dir), as `ocrq up` and the compose stack do."""
    from ocrq_cli.embedded.stack import Stack, flower_argv

    settings = command_settings()
    auth, where = Stack(settings).flower_auth()
    console.print(f"flower on port {settings.flower_port}, basic auth from {where}")
    argv, env = flower_argv(settings, auth, address=address)
    os.execve(argv[0], argv, {**os.environ, **env})


def down() -> None:
    """Stop what `ocrq up` started (here: the stack whose state is under ./var/)."""
    from ocrq.broker.redis_conn import redacted
    from ocrq_cli.embedded.stack import Stack

    stack = Stack(command_settings())
    stopped = stack.down()
    for name, what in stopped.items():
        console.print(f"{name:7} {what}")
    if all(what == "not running" for what in stopped.values()):
        others = stack.others()
        if others:  # the user is in the wrong directory: say where the running stack is
            console.print(f"[red]nothing was started from {stack.var}; the stack on "
                          f"{redacted(stack.settings.redis.url)} runs from {', '.join(others)}: run `ocrq down` "
                          f"in {', '.join(str(Path(o).parent) for o in others)}[/]")
            raise typer.Exit(code=1)
        console.print(f"no stack was running from {stack.var}")


def governor(reset: bool = typer.Option(False, "--reset", help="delete the snapshots: next starts are cold")) -> None:
    """What workers' VRAM governors learned (one JSON line per snapshot in Redis), or --reset;
    with none, what each live worker batches by."""
    from ocrq import keys

    client = make_client(command_settings())
    found = sorted(client.redis.scan_iter(keys.governor_profile("*")))
    if reset:
        removed = client.redis.delete(*found) if found else 0
        console.print(f"deleted {removed} governor snapshots")
        return
    for key in found:
        raw = client.redis.get(key)
        if raw is None:  # expired since the scan
            continue
        snap = json.loads(raw)
        cal = snap.get("calibration", {})
        print(json.dumps({"key": key.decode(), "observations": cal.get("observations"),
                          "points": len(cal.get("points", [])), "count_limit": snap.get("limit"),
                          "slow_start": snap.get("slow_start"), "ttl_s": client.redis.ttl(key)}))
    if found:
        return
    console.print("no governor snapshots: the VRAM governor learns on GPU workers with batch.mode auto "
                  "(configs/gpu-*.yaml), and keeps what it learned here for their restarts")
    states = client.worker_states()
    for state in states:
        caps = state.get("capabilities") or {}
        console.print(f"  {escape(str(state.get('process', {}).get('host', '?')))} pid "
                      f"{state.get('process', {}).get('pid', '?')}: engine {caps.get('kind', '?')} on "
                      f"{caps.get('device', '?')}, batch.mode {state.get('mode', '?')}, batches of up to "
                      f"{state.get('count_limit', '?')} images", highlight=False)
    if not states:
        console.print("  no worker is running (`ocrq up`, or `ocrq worker` on each host)")


def worker(queues: str | None = typer.Option(None, help="comma-separated queues (default: settings.queue.name)"),
           concurrency: int | None = typer.Option(None),
           name: str | None = typer.Option(None, "--name", "-n", help="Celery node name, e.g. gpu0@%h")) -> None:
    """Run one worker in the foreground (one per GPU)."""
    from worker.main import run_worker

    run_worker(command_settings(), queues=queues.split(",") if queues else None, concurrency=concurrency,
               hostname=name)


def metrics(port: int = typer.Option(9808), host: str = typer.Option("127.0.0.1"),
            queues: str | None = typer.Option(None, help="comma-separated queues (default: the configured one)"),
            ) -> None:
    """Serve Prometheus metrics (queue depth, unacked, failed, jobs, workers' governor state)."""
    from ocrq.broker import redis_conn
    from ocrq.metrics.redis_series import serve

    settings = command_settings()
    auth = settings.metrics_basic_auth
    serve(redis_conn.client(settings.redis), queues.split(",") if queues else [settings.queue.name],
          host, port, settings.redis, auth.get_secret_value() if auth else None)
