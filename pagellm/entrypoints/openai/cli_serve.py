"""``pagellm serve [MODEL]``: the OpenAI-compatible server (see ``api_server``)."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagellm.entrypoints.openai.server_args import make_arg_parser

    parser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, ...)",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    make_arg_parser(parser)
    parser.set_defaults(func=_run)
    return parser


def _run(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.openai.server_args import start_engine

    async_llm = start_engine(args)  # loads on its thread while the server's modules import
    from pagellm.entrypoints.openai.api_server import exit_now, run_server

    exit_now(run_server(args, async_llm))
