"""The asyncio front of the engine: one background thread steps the ``LLMEngine``.

``LLMEngine`` is not thread-safe, so the engine thread is the only one that touches it. The asyncio
side hands it work as callables in a command list (add a request, abort one, tokenize), which the
thread applies between steps; outputs go back through one ``loop.call_soon_threadsafe`` per step
and event loop into per-request ``asyncio.Queue``s. Tokenization, chat templating and
detokenization all happen on the engine thread: torch releases the GIL inside its ops, and the
event loop stays free to serve HTTP.

Given a factory rather than an engine (``from_config``), the thread builds the engine itself, so
that one thread runs all of torch's parallel work and libgomp keeps a single pool of spinning
workers (see ``pagellm/__init__.py``).

When no request is in flight the thread first faults the KV cache's memory in, a few MiB at a time
(``KVCachePrefaulter``), then sleeps on a condition variable (no polling). If a step
raises, the engine is dead: every in-flight request ends with ``EngineDeadError``, new ones are
refused, and ``is_dead`` tells the server to report 503 and exit.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol, TypeVar, Union

from pagellm.config import EngineConfig
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import RequestOutputKind
from pagellm.engine.request_stream import RequestStream, StreamingFrontEnd
from pagellm.engine.stats import EngineStats
from pagellm.kernels import pack_cache
from pagellm.lora.request import LoRARequest
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
# A prompt, or a zero-argument callable that makes one on the engine thread (e.g. a chat
# template rendering), so that work never runs on the event loop.
LazyPrompt = Union[PromptType, Callable[[], PromptType]]


HEALTH_CHECK_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread crashed; no request can be served any more."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class StatLogger(Protocol):
    """Receives engine statistics on the engine thread (see ``pagellm.entrypoints.metrics``)."""

    def record_step(self, stats: EngineStats, now: float) -> None: ...

    # inter_token_latency: seconds since this request's previous tokens, None for its first ones.
    def record_output(self, output: RequestOutput, now: float, inter_token_latency: Optional[float]) -> None: ...

    def record_aborted(self, num_requests: int) -> None: ...


class _Command:
    """Work for the engine thread: ``run`` between steps, or ``fail`` if the engine died first."""

    __slots__ = ("run", "fail", "is_add")

    def __init__(self, run: Callable[[], None], fail: Callable[[BaseException], None] = lambda e: None, is_add: bool = False):
        self.run, self.fail, self.is_add = run, fail, is_add


class AsyncLLM(StreamingFrontEnd):
    def __init__(
        self,
        engine: Union[LLMEngine, Callable[[], LLMEngine]],
        max_waiting_requests: Optional[int] = None,
        stat_logger: Optional[StatLogger] = None,
        wait: bool = True,
        model_name: Optional[str] = None,
    ) -> None:
        """``engine`` is an engine, or a factory the engine thread calls to build one (its errors
        are raised here, or with ``wait=False`` by :meth:`wait_until_built`, which must come
        before anything else is asked of it but ``model_name``, given here when it is known first)."""
        self.stat_logger = stat_logger
        self._model_name = model_name
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._shutdown = False
        self._dead_error: Optional[BaseException] = None
        # Engine-thread state: the streams of requests in the engine, by request id.
        self._streams: dict[str, RequestStream] = {}
        # Read from the asyncio side without a lock: plain ints, each written by one thread.
        self._num_waiting = 0
        self._num_pending_adds = 0
        factory = engine if callable(engine) else (lambda: engine)
        built: Future[LLMEngine] = Future()
        self._thread = threading.Thread(target=self._run, args=(factory, built), name="pagellm-engine", daemon=True)
        self._thread.start()
        self._built = built
        self._max_waiting_requests = max_waiting_requests
        self.engine: Optional[LLMEngine] = None
        self.max_waiting_requests: Optional[int] = None
        if wait:
            self.wait_until_built()

    def wait_until_built(self) -> LLMEngine:
        """The engine once its thread has built it; raises what building it raised."""
        if self.engine is None:
            self.engine = self._built.result()
            self.max_waiting_requests = (
                self._max_waiting_requests
                if self._max_waiting_requests is not None
                else getattr(self.engine.config, "max_waiting_requests", None)
            )
        return self.engine

    @classmethod
    def from_config(cls, config: EngineConfig, stat_logger: Optional[StatLogger] = None, wait: bool = True) -> "AsyncLLM":
        """Builds the engine on the engine thread, which then steps it."""
        return cls(lambda: LLMEngine(config), config.max_waiting_requests, stat_logger, wait, config.model_name)

    # -- properties the server reads ---------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name if self._model_name is not None else self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead_error

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (approximate: read across threads)."""
        return len(self._streams) + self._num_pending_adds

    # -- asyncio side -------------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: LazyPrompt,
        params: SamplingParams | PoolingParams,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> RequestStream:
        """Validates and queues a request (``PoolingParams``: one to embed); returns once the engine accepted it.

        Raises ``ValueError`` for bad input (nothing is queued then), ``EngineOverloadedError``
        when ``max_waiting_requests`` are already waiting, ``EngineDeadError`` after a crash.
        """
        if self.max_waiting_requests is not None and self._num_waiting + self._num_pending_adds >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server is overloaded: {self.max_waiting_requests} requests are already waiting; retry later"
            )
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        accepted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                resolved = prompt() if callable(prompt) else prompt
                processed = self.engine.process_prompt(resolved, params)
                self.engine.add_request(
                    request_id, resolved, params, RequestOutputKind.DELTA, arrival_time, processed=processed, lora_request=lora_request
                )
            except Exception as e:  # noqa: BLE001 - bad input (ValueError) or a tokenizer failure: the caller's
                _resolve(loop, accepted, error=e)
                return
            self._streams[request_id] = stream
            _resolve(loop, accepted)

        self._submit(_Command(add, lambda e: _resolve(loop, accepted, error=e), is_add=True))
        try:
            await accepted
        except asyncio.CancelledError:
            # The caller went away while the engine was adding it; the abort follows the add.
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: Union[str, list[str]]) -> None:
        """Aborts requests and frees their blocks at the next step boundary. Thread-safe, idempotent."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        try:
            self._submit(_Command(lambda: self._abort_now(request_ids)))
        except EngineDeadError:
            pass  # a dead engine holds nothing worth freeing

    def abort_all(self) -> None:
        """Aborts every request in flight (e.g. at the end of a shutdown's grace period)."""
        try:
            # The list is taken on the engine thread, which owns it.
            self._submit(_Command(lambda: self._abort_now(list(self._streams))))
        except EngineDeadError:
            pass

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread (e.g. tokenization) and returns its result."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def call() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's error to handle
                _resolve(loop, done, error=e)
            else:
                _resolve(loop, done, result)

        self._submit(_Command(call, lambda e: _resolve(loop, done, error=e)))
        return await done

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify()
        self._thread.join(timeout)
        # A packed-weights file still being written is finished first: a server leaves by os._exit.
        pack_cache.wait_for_writes()

    def _submit(self, command: _Command) -> None:
        with self._cond:
            if self._dead_error is not None:
                raise EngineDeadError(f"the engine is dead: {self._dead_error!r}")
            if self._shutdown:
                raise EngineDeadError("the engine is shut down")
            self._commands.append(command)
            self._num_pending_adds += command.is_add
            self._cond.notify()

    # -- engine thread ------------------------------------------------------------------------------

    def _run(self, factory: Callable[[], LLMEngine], built: Future[LLMEngine]) -> None:
        try:
            engine = factory()
        except BaseException as e:  # noqa: BLE001 - handed to __init__, which raises it
            built.set_exception(e)
            return
        built.set_result(engine)
        prefault_pending = True  # until the engine says the KV cache is all faulted in
        # Tensor-parallel ranks are checked while idle too, so a dead one shows on /health at once.
        health_interval = HEALTH_CHECK_INTERVAL_S if getattr(getattr(engine, "config", None), "tensor_parallel_size", 1) > 1 else None
        try:
            while True:
                with self._cond:
                    while (idle := self._idle(engine)) and not prefault_pending:
                        self._cond.wait(health_interval)
                        if health_interval is not None:
                            engine.check_health()
                    if self._shutdown:
                        break
                    commands, self._commands = self._commands, []
                    self._num_pending_adds -= sum(c.is_add for c in commands)
                if idle:
                    # Nothing to serve: fault in a slice of the KV cache now rather than in a step.
                    prefault_pending = engine.prefault_kv_cache()
                    continue
                for i, command in enumerate(commands):
                    try:
                        command.run()
                    except BaseException:
                        with self._cond:  # so _fail_all fails the rest of this batch too
                            self._commands[:0] = commands[i + 1 :]
                        raise
                if engine.has_unfinished_requests():
                    self._dispatch(engine.step())
                stats = engine.stats()
                if self.stat_logger is not None:
                    self.stat_logger.record_step(stats, time.monotonic())
                self._num_waiting = stats.scheduler.num_waiting_reqs
        except BaseException as e:  # anything escaping a step leaves the engine unusable
            logger.exception("the engine loop crashed; failing all requests")
            with self._cond:
                self._dead_error = e
            self._fail_all(f"the engine crashed: {e!r}")
            _shutdown_engine(engine)
            return
        self._fail_all("the engine was shut down")
        _shutdown_engine(engine)

    def _idle(self, engine: LLMEngine) -> bool:
        """Nothing to do: no command, no shutdown, no request in the engine (hold ``_cond``)."""
        return not self._commands and not self._shutdown and not engine.has_unfinished_requests()

    def _dispatch(self, ready: list[RequestOutput]) -> None:
        if not ready:
            return
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = defaultdict(list)
        for output in ready:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by its caller meanwhile
            if self.stat_logger is not None:
                self._record_output(stream, output, now)
            if output.finished:
                del self._streams[output.request_id]
            by_loop[stream.loop].append((stream, output))
        for loop, items in by_loop.items():
            _deliver_threadsafe(loop, items)

    def _abort_now(self, request_ids: list[str]) -> None:
        finals = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue  # finished already, or never added
            aborted = self.engine.abort_request([request_id])
            finals.append((stream, aborted[0] if aborted else RequestOutput(request_id, None, [], [], finished=True)))
        if not finals:
            return
        if self.stat_logger is not None:
            self.stat_logger.record_aborted(len(finals))
        # A caller still reading (e.g. one cut off by a shutdown) sees finish_reason "abort".
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, output in finals:
            by_loop[stream.loop].append((stream, output))
        for loop, items in by_loop.items():
            _deliver_threadsafe(loop, items)

    def _record_output(self, stream: RequestStream, output: RequestOutput | EmbeddingRequestOutput, now: float) -> None:
        itl = None
        if isinstance(output, RequestOutput) and any(c.token_ids for c in output.outputs):
            if stream.last_token_time is not None:
                itl = now - stream.last_token_time
            stream.last_token_time = now
        if self.stat_logger is not None:
            self.stat_logger.record_output(output, now, itl)

    def _fail_all(self, message: str) -> None:
        """Ends every queued command and in-flight request with EngineDeadError (nothing may hang)."""
        with self._cond:  # _submit refuses new commands from here on (dead or shut down)
            pending, self._commands = self._commands, []
            self._num_pending_adds = 0
        for command in pending:
            command.fail(EngineDeadError(message))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, BaseException]]] = defaultdict(list)
        for stream in self._streams.values():
            by_loop[stream.loop].append((stream, EngineDeadError(message)))
        self._streams.clear()
        for loop, items in by_loop.items():
            _deliver_threadsafe(loop, items)


def _shutdown_engine(engine: LLMEngine) -> None:
    """Stops the engine's tensor-parallel ranks, if it has any."""
    try:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
    except Exception:
        logger.exception("shutting the engine's ranks down failed")


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _deliver_threadsafe(loop: asyncio.AbstractEventLoop, items: list) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:
        pass  # that event loop is closed: its requests have nobody left to read them


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None, error: Optional[BaseException] = None) -> None:
    def set_it() -> None:
        if future.done():
            return  # cancelled by a caller that went away
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_it)
    except RuntimeError:
        pass
