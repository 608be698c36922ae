"""The ``ocrq`` command line. Each command builds the process's settings once and passes them on.

    ocrq up [--allow DIR] [--gpus all|0,1] | down  embedded stack (Redis, a worker or one per GPU, Flower)
    ocrq flower                                 Flower on the ocrq app, behind basic auth
    ocrq submit REF... --job J [--wait --out F] submit images, optionally wait and write JSONL
    ocrq status J | results J [--out F] | jobs  follow jobs
    ocrq export J [--wait] [--format openai-batch --out DIR]  (re)write a job's export + _SUCCESS
    ocrq submit --openai-batch FILE --job J [--wait --out DIR]  an OpenAI Batch file, one image per line
    ocrq failed [--job J --error T --since 2h] | failed show ID | failed purge   the failed registry
    ocrq cancel J [--wait]                      what has not started never runs; the export keeps what finished
    ocrq reprocess [--job J] [--error T] [--dry-run]   re-run failed (and a named job's cancelled) images
    ocrq serve [--port 8080] | token create --tenant T   the HTTP API and its tenants' tokens
    ocrq worker [--queues Q,...]                run a worker in the foreground (ocrq[worker])
    ocrq metrics [--port 9808]                  Prometheus exporter (reads Redis)
    ocrq model make-random --size tiny|full --out DIR   random-weight HunyuanOCR checkpoint
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.markup import escape

from ocrq_cli import fleet, jobs, serve, submit
from ocrq_cli.common import console
from ocrq_cli.failed import failed_app
from ocrq_cli.model import model_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OCR task-queue fleet.")
# the order here is the order of `ocrq --help`
for command in (fleet.up, fleet.flower, fleet.down, submit.submit, jobs.status, jobs.export, jobs.results,
                jobs.jobs, jobs.cancel, jobs.reprocess, serve.serve, fleet.governor, fleet.worker, fleet.metrics):
    app.command()(command)
app.add_typer(serve.token_app, name="token")
app.add_typer(model_app, name="model")
app.add_typer(failed_app, name="failed")


@app.callback()
def _main(config: Path | None = typer.Option(None, "--config", "-c", envvar="OCRQ_CONFIG",
                                             help="YAML settings profile (configs/*.yaml)")) -> None:
    if config is not None:
        os.environ["OCRQ_CONFIG"] = str(config)


def main() -> None:
    import redis

    try:
        app()
    except redis.ConnectionError as exc:
        console.print(f"[red]cannot reach Redis[/]: {escape(str(exc))}\n"
                      "start the embedded stack with `ocrq up`, or point OCRQ_REDIS__URL at your Redis")
        sys.exit(2)


if __name__ == "__main__":
    main()
