"""What the completion and chat handlers share: model check, prompts, request fan-out, SSE, errors."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

from fastapi import Request
from pydantic import BaseModel

from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, LazyPrompt, RequestStream
from pagellm.entrypoints.errors import APIError, error_body
from pagellm.entrypoints.openai.protocol import ChatMessage, PromptTokensDetails, UsageInfo
from pagellm.entrypoints.openai.serving_models import OpenAIServingModels
from pagellm.lora.request import LoRARequest
from pagellm.outputs import Logprob, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Logprobs of -inf are not valid JSON; OpenAI's clients get vLLM's floor instead.
LOGPROB_FLOOR = -9999.0
SSE_DONE = "data: [DONE]\n\n"


def to_api_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception raised while adding or running a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400)
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), 503, headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), 503)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(f"internal error: {type(exc).__name__}: {exc}", 500)


# JSON leaves U+0085, U+2028 and U+2029 raw inside strings, and clients that split an event stream
# with str.splitlines() or httpx's aiter_lines() break lines there; escaped, the JSON is the same.
_LINE_BREAK_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(json_text: str) -> str:
    """One server-sent event carrying ``json_text``, safe for line-splitting clients."""
    # Scanning for the three characters is far cheaper than translate(): translate only the rare chunk that needs it.
    if "\x85" in json_text or "\u2028" in json_text or "\u2029" in json_text:
        json_text = json_text.translate(_LINE_BREAK_ESCAPES)
    return f"data: {json_text}\n\n"


def sse(chunk: BaseModel, exclude: Optional[set[str]] = None) -> str:
    return sse_data(chunk.model_dump_json(exclude=exclude))


def sse_error(exc: BaseException) -> str:
    err = to_api_error(exc)
    return sse_data(json.dumps(error_body(err.message, err.status_code, err.param)))


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens),
    )


def prompt_logprobs_json(
    prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[Optional[dict[int, Logprob]]], as_token_ids: Optional[bool]
) -> list[Optional[dict[int, dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: one entry per prompt token (None for the first, which nothing
    predicts), each {token id: {logprob, rank, decoded_token}}."""
    out: list[Optional[dict[int, dict[str, Any]]]] = []
    for step in list(prompt_logprobs)[: len(prompt_token_ids)]:
        if step is None:
            out.append(None)
            continue
        out.append(
            {
                token_id: {
                    "logprob": logprob_value(lp),
                    "rank": lp.rank,
                    "decoded_token": f"token_id:{token_id}" if as_token_ids else lp.decoded_token,
                }
                for token_id, lp in step.items()
            }
        )
    return out


def prompt_items(prompt: Union[list[int], list[list[int]], str, list[str]]) -> list:
    """A request's prompts (completions' ``prompt``, embeddings' ``input``): one string or token list, or a list of them."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    return prompt if isinstance(prompt, list) else list(prompt)


def lazy_prompts(items: list, input_processor, add_special_tokens: bool = True, cache_salt: Optional[str] = None) -> list[LazyPrompt]:
    """Engine prompts for ``prompt_items``: token lists as they are, text tokenized on the engine thread."""
    out: list[LazyPrompt] = []
    for item in items:
        if isinstance(item, list):
            d: dict = {"prompt_token_ids": item}
            if cache_salt is not None:
                d["cache_salt"] = cache_salt
            out.append(d)
        elif add_special_tokens and cache_salt is None:
            out.append(item)
        else:

            def lazy(text: str = item) -> dict:
                d = {"prompt": text}
                if not add_special_tokens:
                    d["prompt_token_ids"] = input_processor.tokenize(text, add_special_tokens=False)
                if cache_salt is not None:
                    d["cache_salt"] = cache_salt
                return d

            out.append(lazy)
    return out


def logprob_value(logprob: Logprob) -> float:
    return max(logprob.logprob, LOGPROB_FLOOR)


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as plain dicts for the template; text content parts are joined into a string.

    Small chat templates index ``message['content']`` as a string, so parts are flattened here (as
    vLLM's "string" content format does). Non-text parts are refused: no model here reads images.
    """
    out = []
    for i, message in enumerate(messages):
        d = message.model_dump(exclude_none=True)
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                        param="messages",
                    )
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        elif content is None:
            d["content"] = ""
        out.append(d)
    return out


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, served_model_name: str, trust_request_chat_template: bool = False) -> None:
        self.async_llm = async_llm
        self.served_model_name = served_model_name
        self.trust_request_chat_template = trust_request_chat_template
        # The names requests may use; the app shares one instance, which also holds the LoRA adapters.
        self.models = OpenAIServingModels(async_llm, served_model_name)

    def check_chat_template(self, chat_template: Optional[str], chat_template_kwargs: Optional[dict[str, Any]]) -> None:
        """Refuses a template sent with the request unless the operator trusts clients with them.

        A template is a program run on the engine thread: the sandbox stops file and attribute
        access but not a loop of 10^10 steps, which would stall every request (vLLM's
        ``--trust-request-chat-template`` guards the same way).
        """
        if self.trust_request_chat_template:
            return
        if chat_template is not None or (chat_template_kwargs and "chat_template" in chat_template_kwargs):
            raise APIError(
                "chat_template in a request is refused; the server must be started with --trust-request-chat-template",
                param="chat_template",
            )

    def check_runner(self, api: str, pooling: bool = False) -> None:
        """Generation routes need the generate runner and /v1/embeddings the pooling one (vLLM's message)."""
        if (self.async_llm.engine.config.runner == "pooling") != pooling:
            raise APIError(f"The model does not support {api} API")

    def check_model(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter ``model`` names (None: the base model); 404 for a name not served."""
        return self.models.resolve(model)

    def response_model(self, model: Optional[str]) -> str:
        """The name a response reports: the adapter's when the request chose one (as vLLM), else the base model's."""
        return model if model and model in self.models.loras else self.served_model_name

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """Checks what SamplingParams cannot know alone: token ids against the vocabulary."""
        vocab_size = self.async_llm.engine.input_processor.vocab_size
        for token_id in params.logit_bias or {}:
            if not 0 <= token_id < vocab_size:
                raise APIError(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})", param="logit_bias")
        return params

    async def add_requests(
        self,
        base_request_id: str,
        prompts: Sequence[LazyPrompt],
        params: SamplingParams | PoolingParams,
        arrival_time: float,
        lora_request: Optional[LoRARequest] = None,
    ) -> list[RequestStream]:
        """Adds one engine request per prompt; all are validated or none is left running."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_request_id if len(prompts) == 1 else f"{base_request_id}-{i}"
                streams.append(await self.async_llm.add_request(request_id, prompt, params, arrival_time, lora_request))
        except BaseException as e:
            self.async_llm.abort([s.request_id for s in streams])
            if isinstance(e, asyncio.CancelledError):
                raise
            raise to_api_error(e) from e
        return streams

    async def iterate_streams(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields (prompt index, output) as they come from all streams; aborts the unfinished ones on exit."""
        try:
            if len(streams) == 1:
                async for output in streams[0]:
                    yield 0, output
                return
            pending: dict[asyncio.Future, int] = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
            try:
                while pending:
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for fut in done:
                        i = pending.pop(fut)
                        try:
                            output = fut.result()
                        except StopAsyncIteration:
                            continue
                        pending[asyncio.ensure_future(streams[i].__anext__())] = i
                        yield i, output
            finally:
                for fut in pending:
                    fut.cancel()
        finally:
            unfinished = [s.request_id for s in streams if not s.finished]
            if unfinished:
                self.async_llm.abort(unfinished)


async def run_until_disconnected(raw_request: Request, make_coro: Callable[[], Any]) -> Any:
    """Runs a non-streaming handler; if the client leaves first, cancels it (which aborts its requests).

    Returns the handler's result, or None when the client disconnected (nobody reads the answer).
    """

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    handler = asyncio.ensure_future(make_coro())
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if handler.done():
        return handler.result()
    logger.info("client disconnected; aborting its request")
    handler.cancel()
    try:
        await handler
    except BaseException:  # noqa: BLE001 - cancelled on purpose; nothing to report to a gone client
        pass
    return None
