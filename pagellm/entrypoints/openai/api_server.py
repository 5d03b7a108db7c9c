"""The OpenAI-compatible HTTP server: FastAPI routes, guards, graceful shutdown.

``python -m pagellm.entrypoints.openai.api_server [MODEL] [flags]`` and ``pagellm serve`` run it.
A pure-ASGI middleware guards every request before FastAPI sees it: it refuses new work while
draining (503), checks the API key on ``/v1/*`` (401) and reads the body with a size cap (413).
SIGTERM/SIGINT start a drain: in-flight requests finish within ``--shutdown-timeout`` (then they
are aborted) and the process exits 0; a crashed engine makes ``/health`` 503 and the exit code 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any, Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagellm
from pagellm import envs
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from pagellm.entrypoints.errors import (
    APIError,
    api_error_response,
    error_response,
    format_validation_error,
)
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.openai.guard import GuardMiddleware
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from pagellm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.server_args import chat_options_from_args, make_arg_parser, start_engine
from pagellm.entrypoints.openai.serving_base import to_api_error
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_models import OpenAIServingModels, parse_lora_module
from pagellm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.entrypoints.server_state import DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_STORED_RESPONSES, ServerState

logger = logging.getLogger(__name__)

def build_app(
    async_llm: AsyncLLM,
    metrics: EngineMetrics,
    api_key: Optional[str] = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    model_root: Optional[str] = None,
    trust_request_chat_template: bool = False,
    dashboard: bool = True,
    dashboard_show_text: bool = False,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: Optional[str] = None,
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
    lora_modules: Sequence[str] = (),
    chat_options: Optional[dict[str, Any]] = None,
) -> FastAPI:
    """``chat_options``: OpenAIServingChat's reasoning and template options (``chat_options_from_args``)."""
    app = FastAPI(title="pagellm OpenAI-compatible server", version=pagellm.__version__)
    state = ServerState(api_key=api_key, max_request_body_bytes=max_request_body_bytes)
    app.state.server = state
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    name = async_llm.model_name
    completions = OpenAIServingCompletion(async_llm, name)
    chat = OpenAIServingChat(
        async_llm, name, trust_request_chat_template, enable_auto_tool_choice, tool_call_parser, **(chat_options or {})
    )
    tokenization = OpenAIServingTokenization(async_llm, name, trust_request_chat_template)
    responses = OpenAIServingResponses(chat, ResponseStore(max_stored_responses))
    embedding = OpenAIServingEmbedding(async_llm, name)
    served = OpenAIServingModels(async_llm, name, model_root)
    for spec in lora_modules:
        served.register(*parse_lora_module(spec))
    for serving in (completions, chat, tokenization, embedding):
        serving.models = served
    app.state.models = served

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = format_validation_error(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(EngineOverloadedError)
    @app.exception_handler(EngineDeadError)
    async def _engine_error(_: Request, exc: Exception) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(f"internal error: {type(exc).__name__}", 500)

    @app.get("/health")
    async def health() -> Response:
        if async_llm.is_dead:
            return error_response(f"the engine is dead: {async_llm.dead_error!r}", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=pagellm.__version__)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return served.list_models()

    if envs.allow_runtime_lora_updating():  # as vLLM: a client naming paths to read is opt-in

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            return Response(await served.load_lora_adapter(request.lora_name, request.lora_path), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            return Response(await served.unload_lora_adapter(request.lora_name), media_type="text/plain")

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await tokenization.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await tokenization.detokenize(request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embedding.create_embedding(request, raw_request)

    if dashboard:
        from pagellm.entrypoints.dashboard.hub import DashboardHub
        from pagellm.entrypoints.dashboard.router import dashboard_router

        app.state.dashboard = DashboardHub(async_llm, metrics, state, dashboard_show_text)
        app.include_router(dashboard_router(app.state.dashboard, state))
    app.add_middleware(GuardMiddleware, state=state)
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn with a drain on SIGTERM/SIGINT and an exit when the engine dies."""

    def __init__(self, config: uvicorn.Config, state: ServerState, async_llm: AsyncLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.async_llm = async_llm
        self.shutdown_timeout = shutdown_timeout
        self._drain_deadline: Optional[float] = None
        self._aborted_at: Optional[float] = None
        self._dead_since: Optional[float] = None

    def handle_exit(self, sig: int, frame) -> None:  # frame: the signal handler's signature
        # Unlike uvicorn's, this does not re-raise the signal after shutdown: a drain exits 0.
        if self.state.draining:
            logger.warning("second signal: exiting now")
            self.should_exit = True
            self.force_exit = True
            return
        logger.info(
            "received %s: refusing new requests, finishing %d in flight (up to %.0f s)",
            signal.Signals(sig).name,
            self.state.num_in_flight,
            self.shutdown_timeout,
        )
        self.state.draining = True
        self._drain_deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        now = time.monotonic()
        if self.async_llm.is_dead:
            # A moment for in-flight requests to receive their errors, then go: a supervisor restarts us.
            if self._dead_since is None:
                self._dead_since = now
                logger.error("the engine is dead; shutting down")
            return now - self._dead_since > 1.0
        if self._drain_deadline is None:
            return False
        if self.state.num_in_flight == 0:
            return True
        if now >= self._drain_deadline:
            if self._aborted_at is None:
                logger.warning("shutdown timeout: aborting %d requests still in flight", self.state.num_in_flight)
                self.async_llm.abort_all()
                self._aborted_at = now
            return now - self._aborted_at > 2.0
        return False


def run_server(args: argparse.Namespace, async_llm: Optional[AsyncLLM] = None) -> int:
    """Serves until drained or the engine dies; returns the exit code. ``async_llm``: an engine
    already loading on its thread (``pagellm serve`` starts it before importing this module, so
    the two overlap); built here from ``args`` otherwise."""
    t0 = time.perf_counter()
    api_key = args.api_key if args.api_key is not None else envs.api_key()
    if async_llm is None:
        async_llm = start_engine(args)
    # The app and uvicorn's protocol modules are built while the engine loads on its thread: they
    # need only the served name, and building them meanwhile takes them off the start's critical path.
    metrics = EngineMetrics(async_llm.model_name)
    app = build_app(
        async_llm,
        metrics,
        api_key,
        args.max_request_body_bytes,
        None,  # the model's root on /v1/models: its resolved path, known once loaded
        args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_stored_responses=args.max_stored_responses,
        dashboard=not args.no_dashboard,
        dashboard_show_text=args.dashboard_show_text,
        lora_modules=args.lora_modules,
        chat_options=chat_options_from_args(args),
    )
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        lifespan="off",
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    uv_config.load()
    async_llm.wait_until_built()
    engine = async_llm.engine
    app.state.models.model_root = engine.model_path
    if getattr(engine, "memory_plan", None) is not None:
        metrics.record_memory_plan(engine.memory_plan)
    async_llm.stat_logger = metrics  # before any request: the engine thread reads it per step
    for lora in app.state.models.loras.values():
        engine.add_lora(lora)  # a bad adapter stops the server here, not at its first request
    server = GracefulServer(uv_config, app.state.server, async_llm, args.shutdown_timeout)
    logger.info(
        "serving %s on http://%s:%d (engine loaded in %.1f s; %.1f s since the server's modules were imported)%s",
        engine.model_name,
        args.host,
        args.port,
        getattr(engine, "load_time_s", 0.0),
        time.perf_counter() - t0,
        "; API key required" if api_key else "",
    )
    try:
        server.run()
    finally:
        dead = async_llm.is_dead
        async_llm.shutdown()
    if not server.started:
        return 1  # e.g. the port was taken
    return 1 if dead else 0


def exit_now(code: int) -> None:
    """Exits without the interpreter's teardown: collecting a loaded engine's many objects is slow,
    and a drained server should be gone at once (its state is all in memory, nothing to flush;
    ``AsyncLLM.shutdown`` has let a packed-weights file being written finish)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Optional[list[str]] = None) -> int:
    parser = make_arg_parser()
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = run_server(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    exit_now(code)
    return code  # not reached


if __name__ == "__main__":
    sys.exit(main())
