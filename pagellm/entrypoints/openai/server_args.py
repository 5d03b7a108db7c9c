"""``pagellm serve``'s flags, and the engine they describe, started before the server's own
modules load: parsing the command line must not import FastAPI, and the engine's weights are
packed (native code, the interpreter let go) while the HTTP side imports."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Optional, Union

from pagellm.entrypoints.server_state import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_STORED_RESPONSES

if TYPE_CHECKING:
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.engine.data_parallel import DPAsyncLLM


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: env PAGELLM_API_KEY)"
    )
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    parser.add_argument(
        "--max-waiting-requests", type=int, default=None, help="answer 503 once this many requests wait (default: unbounded)"
    )
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES)
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template sent with a request (it runs on the engine thread; off by default)",
    )
    parser.add_argument("--no-dashboard", action="store_true", help="do not serve the live KV cache view at /dashboard")
    parser.add_argument(
        "--dashboard-show-text",
        action="store_true",
        help="show prompt and block text on /dashboard (off by default: prompts are users' data)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    parser.add_argument("--tool-call-parser", default=None, choices=["hermes"], help="how to read tool calls out of the model's text")
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=DEFAULT_MAX_STORED_RESPONSES,
        help=f"responses kept in memory for previous_response_id and GET /v1/responses/ID, least recently used dropped first "
        f"(default {DEFAULT_MAX_STORED_RESPONSES}; 0 keeps none)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='LoRA adapters served by name (needs --enable-lora): name=path or \'{"name": ..., "path": ..., "base_model_name": ...}\'',
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])


def make_arg_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    from pagellm.cli import add_engine_args

    parser = parser or argparse.ArgumentParser(prog="pagellm serve", description="OpenAI-compatible HTTP server.")
    add_engine_args(parser, positional_model=True)
    add_server_args(parser)
    return parser


def start_engine(args: argparse.Namespace) -> Union["AsyncLLM", "DPAsyncLLM"]:
    """The engine ``args`` describe, loading on its own thread (``wait_until_built`` waits for
    it); ValueError for flags that contradict each other, before anything loads."""
    from pagellm.cli import engine_kwargs
    from pagellm.config import EngineConfig
    from pagellm.engine.async_llm import AsyncLLM

    config = EngineConfig(**engine_kwargs(args), max_waiting_requests=args.max_waiting_requests)
    dp = getattr(args, "data_parallel_size", 1) or 1
    if dp < 1:
        raise ValueError(f"data_parallel_size must be positive, got {dp}")
    if args.lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if dp > 1 and config.enable_lora:
        raise ValueError("LoRA under data parallelism is not supported yet; use --data-parallel-size 1 with --enable-lora")
    if dp > 1:
        from pagellm.engine.data_parallel import DPAsyncLLM

        return DPAsyncLLM.from_config(config, dp)
    return AsyncLLM.from_config(config, wait=False)
