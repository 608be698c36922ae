"""``ocrq serve`` (the HTTP API and the jobs page) and ``ocrq token`` (tenants' bearer tokens)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ocrq_cli.common import command_settings, console

token_app = typer.Typer(no_args_is_help=True, help="Bearer tokens of the HTTP API's tenants (stored hashed).")


def serve(host: str | None = typer.Option(None, help="address to bind (default: api.host, 127.0.0.1)"),
          port: int | None = typer.Option(None, help="port (default: api.port, 8080)"),
          workers: int = typer.Option(1, min=1, max=64, help="processes (each answers any request: "
                                      "nothing is kept in one)"),
          token_file: Path | None = typer.Option(None, help="make a default-tenant token here if the file "
                                                 "is missing (what `ocrq up` does)")) -> None:
    """Run the HTTP API in the foreground: /v1/jobs, OpenAI /v1/files and /v1/batches, webhooks,
    /docs and /openapi.json (ocrq[api])."""
    import uvicorn

    from api.tenants import Tenants, ensure_token_file, tenants_path

    settings = command_settings()
    if token_file is not None and ensure_token_file(settings, token_file):
        console.print(f"made a token for the default tenant in {token_file}")
    if not Tenants(settings).all():
        console.print(f"[yellow]no tenant has a token yet: every request will be 401; `ocrq token create --tenant "
                      f"NAME` makes one (written to {escape(str(tenants_path(settings)))})[/]")
    uvicorn.run("api.app:app_from_env", factory=True, host=host or settings.api.host,
                port=settings.api.port if port is None else port, workers=workers,
                log_level=settings.log_level.lower(), proxy_headers=True, server_header=False,
                access_log=settings.api.access_log)


@token_app.command("create")
def token_create(tenant: str = typer.Option(..., "--tenant", "-t", help="the tenant (lower-case letters, digits, "
                                            "'_', '-'; `default` is the CLI's)"),
                 label: str = typer.Option("", help="what the token is for (to revoke it by)")) -> None:
    """Make a token for TENANT: printed once here, only its sha256 is kept (api.tenants_file)."""
    from api.tenants import create_token, tenants_path

    settings = command_settings()
    try:
        token, secret = create_token(tenants_path(settings), tenant, label)
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        raise typer.Exit(code=2) from exc
    console.print(f"token for tenant {tenant} (shown once; kept hashed in {tenants_path(settings)}):")
    print(token)
    if secret is not None:
        console.print("webhook signing secret of the tenant (Standard Webhooks; shown once):")
        print(secret)


@token_app.command("list")
def token_list() -> None:
    """The tokens' tenants, labels and digest prefixes (no token is kept to show)."""
    from api.tenants import listed, tenants_path

    for row in listed(tenants_path(command_settings())):
        print(f"{row['tenant']}\t{row['label']}\t{row['digest']}")


@token_app.command("revoke")
def token_revoke(label: str = typer.Argument(..., help="the token's label, or a prefix of its digest (≥ 8)"),
                 tenant: str = typer.Option(..., "--tenant", "-t")) -> None:
    """Revoke a tenant's token: every replica refuses it within a second."""
    from api.tenants import revoke, tenants_path

    n = revoke(tenants_path(command_settings()), tenant, label)
    console.print(f"revoked {n} token(s) of tenant {tenant}")
    if not n:
        raise typer.Exit(code=1)
