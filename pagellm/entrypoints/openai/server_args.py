"""``pagellm serve``'s flags, and the engine they describe, started before the server's own
modules load: parsing the command line must not import FastAPI, and the engine's weights are
packed (native code, the interpreter let go) while the HTTP side imports."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, Optional, Union

from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS as TOOL_PARSER_NAMES
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
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_PARSER_NAMES),
        help="how to read tool calls out of the model's text (vLLM's names)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) used in place of the model's own",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        help='options every chat request\'s template gets unless the request sets them, JSON: \'{"enable_thinking": false}\'',
    )
    parser.add_argument(
        "--default-thinking-token-budget",
        type=int,
        default=None,
        help="with --reasoning-parser: the thinking budget of chat requests that set none (default: no limit)",
    )
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


def chat_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The chat endpoint's reasoning and template options from ``pagellm serve``'s flags; ValueError on bad ones."""
    template = getattr(args, "chat_template", None)
    if template is not None and "{" not in template:
        try:
            with open(template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {template!r}: {e}") from None
    kwargs = getattr(args, "default_chat_template_kwargs", None)
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except ValueError as e:
            raise ValueError(f"--default-chat-template-kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError("--default-chat-template-kwargs must be a JSON object")
    reasoning_config = getattr(args, "reasoning_config", None)
    if isinstance(reasoning_config, str):
        reasoning_config = json.loads(reasoning_config)  # checked by the engine's config already
    return {
        "reasoning_parser": getattr(args, "reasoning_parser", None),
        "reasoning_config": reasoning_config,
        "chat_template": template,
        "default_chat_template_kwargs": kwargs,
        "default_thinking_token_budget": getattr(args, "default_thinking_token_budget", None),
    }


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
    if dp > 1 and config.kv_offloading_dir is not None:
        raise ValueError("data-parallel replicas cannot share one --kv-offloading-dir; run one server per directory")
    if dp > 1 and config.enable_lora:
        raise ValueError("LoRA under data parallelism is not supported yet; use --data-parallel-size 1 with --enable-lora")
    if dp > 1:
        from pagellm.engine.data_parallel import DPAsyncLLM

        return DPAsyncLLM.from_config(config, dp)
    return AsyncLLM.from_config(config, wait=False)
