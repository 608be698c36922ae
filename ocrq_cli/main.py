"""The ``ocrq`` command line. Each command builds the process's settings once and passes them on.

    ocrq up [--allow DIR] [--gpus all|0,1] | down  embedded stack (Redis, a worker or one per GPU, Flower)
    ocrq flower                                 Flower on the ocrq app, behind basic auth
    ocrq submit REF... --job J [--wait --out F] submit images, optionally wait and write JSONL
    ocrq status J | results J [--out F] | jobs  follow jobs
    ocrq export J [--wait] [--format openai-batch --out DIR]  (re)write a job's export + _SUCCESS
    ocrq submit --openai-batch FILE --job J [--wait --out DIR]  an OpenAI Batch file, one image per line
    ocrq failed [--job J --error T --since 2h] | failed show ID | failed purge   the failed registry
    ocrq cancel J [--wait]                      what has not started never runs; the export keeps what finished
    ocrq reprocess [--job J] [--error T] [--dry-run] [--wait]   re-run failed (and a named job's cancelled) images
    ocrq serve [--port 8080] | token create --tenant T   the HTTP API and its tenants' tokens
    ocrq worker [--queues Q,...]                run a worker in the foreground (ocrq[worker])
    ocrq metrics [--port 9808]                  Prometheus exporter (reads Redis)
    ocrq model make-random --size tiny|full --out DIR   random-weight HunyuanOCR checkpoint

What went wrong ends here, in ``main``, once: a client error (``producer.errors``) exits with its
code after one line naming it; bad settings (``ocrq.settings_check``) exit 2; ``--debug`` adds
the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import typer
from rich.markup import escape

from ocrq_cli import fleet, jobs, serve, submit
from ocrq_cli.common import STATE, console
from ocrq_cli.failed import failed_app
from ocrq_cli.model import model_app
from producer.errors import (
    EXIT_ERROR,
    EXIT_NOT_REPLICATED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SOME_FAILED,
    EXIT_TIMEOUT,
)

EXIT_CODES = f"""Exit codes of every command that waits (submit --wait, reprocess --wait, export --wait,
submit --openai-batch --wait):

\b
  {EXIT_OK}  every image done
  {EXIT_ERROR}  no such job (or an unexpected error)
  {EXIT_REFUSED}  refused, nothing published: a ref, a task no engine runs, bad settings, Redis unreachable
  {EXIT_SOME_FAILED}  some images failed: the first ten are named, with why (`ocrq failed --job J`)
  {EXIT_TIMEOUT}  timed out waiting (--timeout): the job goes on
  {EXIT_NOT_REPLICATED}  not confirmed on the replicas (a Sentinel broker failed over): run it again
"""

app = typer.Typer(add_completion=False, no_args_is_help=True, help="OCR task-queue fleet.\n\n" + EXIT_CODES)
# the order here is the order of `ocrq --help`
for command in (fleet.up, fleet.flower, fleet.down, submit.submit, jobs.status, jobs.export, jobs.results,
                jobs.jobs, jobs.cancel, jobs.reprocess, serve.serve, fleet.governor, fleet.worker, fleet.metrics):
    app.command()(command)
app.add_typer(serve.token_app, name="token")
app.add_typer(model_app, name="model")
app.add_typer(failed_app, name="failed")


@app.callback()
def _main(config: Path | None = typer.Option(None, "--config", "-c", envvar="OCRQ_CONFIG",
                                             help="YAML settings profile (configs/*.yaml)"),
          debug: bool = typer.Option(False, "--debug", help="show the traceback of an error")) -> None:
    STATE["debug"] = debug
    if config is not None:
        os.environ["OCRQ_CONFIG"] = str(config)


#: what to do next, by error
_HINTS = {"UnknownJob": "`ocrq jobs` lists the known ones",
          "NotReplicated": "not confirmed on the replicas: the same command again completes it"}


def report(exc: BaseException) -> int:
    """Say what went wrong in a line (or one per bad setting) and give the exit code; anything
    not in ocrq's trees is re-raised (a bug: its traceback is the report)."""
    import redis
    from kombu.exceptions import OperationalError

    from ocrq.errors import OcrqError
    from ocrq.settings import SettingsError
    from producer.errors import ClientError, unreachable

    # Redis went away mid-command, or the broker would not take a publish (kombu's error)
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError | OperationalError):
        exc = unreachable(STATE["redis_url"] or "redis.url", exc)
    if isinstance(exc, ClientError):
        hint = _HINTS.get(type(exc).__name__)
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}" + (f" ({hint})" if hint else ""))
        return exc.exit_code
    if isinstance(exc, SettingsError):
        for line in str(exc).splitlines():
            console.print(f"[red]settings[/]: {escape(line)}", highlight=False)
        return EXIT_REFUSED
    if isinstance(exc, OcrqError):  # a producer-side check that refused the input (TooLarge, ...)
        console.print(f"[red]{type(exc).__name__}[/]: {escape(str(exc))}")
        return EXIT_REFUSED
    raise exc


def main() -> None:
    try:
        app()
    except Exception as exc:
        code = report(exc)
        if STATE["debug"]:
            traceback.print_exception(exc)
        sys.exit(code)


if __name__ == "__main__":
    main()
