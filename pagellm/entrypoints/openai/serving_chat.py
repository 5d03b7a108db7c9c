"""``POST /v1/chat/completions``: messages through the model's chat template, reply streamed or not."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    random_id,
)
from pagellm.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    logprob_value,
    make_usage,
    messages_to_dicts,
    run_until_disconnected,
    sse,
    sse_error,
)
from pagellm.outputs import CompletionOutput, SampleLogprobs


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[ChatCompletionLogProbsContent] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


def make_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: Optional[str],
    chat_template_kwargs: Optional[dict[str, Any]],
    add_special_tokens: bool,
    cache_salt: Optional[str],
    input_processor: Any = None,
) -> dict[str, Any]:
    """Renders and tokenizes a conversation (runs on the engine thread); template errors -> ValueError.

    With ``input_processor``, a rendering too long for the context is refused before tokenizing.
    """
    from pagellm.tokenizer import render_chat

    kwargs = dict(chat_template_kwargs or {})
    if continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = render_chat(tokenizer, messages, add_generation_prompt, chat_template, **kwargs)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja and template errors are the request's fault
        raise ValueError(f"could not apply the chat template: {type(e).__name__}: {e}") from None
    if input_processor is not None and hasattr(input_processor, "check_prompt_chars"):
        input_processor.check_prompt_chars(len(text))
    try:
        token_ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:  # noqa: BLE001 - e.g. lone surrogates in the messages
        raise ValueError(f"could not tokenize the messages: {e}") from None
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        if not request.messages:
            raise APIError("messages must not be empty", param="messages")
        if request.add_generation_prompt and request.continue_final_message:
            raise APIError("add_generation_prompt and continue_final_message cannot both be true", param="continue_final_message")
        self.check_chat_template(request.chat_template, request.chat_template_kwargs)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        n = 1 if request.n is None else request.n
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        params = self.check_params(request.to_sampling_params(max_tokens, (request.top_logprobs or 0) if request.logprobs else None))
        messages = messages_to_dicts(request.messages)
        tokenizer = self.async_llm.tokenizer

        def prompt() -> dict[str, Any]:
            return make_chat_prompt(
                tokenizer,
                messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template,
                request.chat_template_kwargs,
                request.add_special_tokens,
                request.cache_salt,
                self.async_llm.engine.input_processor,
            )

        role = "assistant" if request.add_generation_prompt else messages[-1]["role"]
        echo = ""
        if request.echo and messages[-1]["role"] == role:
            echo = messages[-1]["content"]
        request_id = random_id("chatcmpl")
        created = int(time.time())
        streams = await self.add_requests(request_id, [prompt], params, time.monotonic())
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, streams[0], n, role, echo), media_type="text/event-stream"
            )
        response = await run_until_disconnected(
            raw_request, lambda: self._full(request, request_id, created, streams[0], n, role, echo)
        )
        if response is None:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: Optional[SampleLogprobs]
    ) -> list[ChatCompletionLogProbsContent]:
        if not request.logprobs or logprobs is None:
            return []
        num_top = request.top_logprobs or 0
        content = []
        for token_id, step in zip(token_ids, logprobs):
            chosen = step.get(token_id)
            if chosen is None:
                continue
            token = chosen.decoded_token if chosen.decoded_token is not None else self.async_llm.tokenizer.decode([token_id])
            # The dict holds the sampled token (any rank) and the top-k: keep the top-k, by rank.
            top = sorted((lp for lp in step.values() if lp.rank is not None and lp.rank <= num_top), key=lambda lp: lp.rank)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=logprob_value(chosen),
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=lp.decoded_token or "",
                            logprob=logprob_value(lp),
                            bytes=list((lp.decoded_token or "").encode("utf-8", errors="replace")),
                        )
                        for lp in top
                    ],
                )
            )
        return content

    def _update_choice(self, request: ChatCompletionRequest, choice: _Choice, completion: CompletionOutput) -> tuple[str, list]:
        logprobs = self._logprobs(request, list(completion.token_ids), completion.logprobs)
        choice.text += completion.text
        choice.num_tokens += len(completion.token_ids)
        choice.logprobs.extend(logprobs)
        if completion.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        return completion.text, logprobs

    async def _full(
        self, request: ChatCompletionRequest, request_id: str, created: int, stream: RequestStream, n: int, role: str, echo: str
    ) -> ChatCompletionResponse:
        choices = [_Choice() for _ in range(n)]
        num_prompt = num_cached = 0
        async for _, output in self.iterate_streams([stream]):
            if output.error is not None:
                raise APIError(f"the engine failed on this request: {output.error}", 500)
            num_prompt, num_cached = len(output.prompt_token_ids), output.num_cached_tokens
            for completion in output.outputs:
                choice = choices[completion.index]
                if choice.finish_reason is None:  # finished samples of n > 1 repeat in later outputs
                    self._update_choice(request, choice, completion)
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=j,
                    message=ChatResponseMessage(role=role, content=echo + c.text),
                    logprobs=ChatCompletionLogProbs(content=c.logprobs) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for j, c in enumerate(choices)
            ],
            usage=make_usage(num_prompt, sum(c.num_tokens for c in choices), num_cached),
        )

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, created: int, stream: RequestStream, n: int, role: str, echo: str
    ) -> AsyncIterator[str]:
        choices = [_Choice() for _ in range(n)]
        num_prompt = num_cached = 0
        exclude = None if request.include_usage else {"usage"}

        def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id,
                    created=created,
                    model=self.served_model_name,
                    choices=[
                        ChatCompletionResponseStreamChoice(
                            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
                        )
                    ],
                ),
                exclude,
            )

        try:
            # The role goes first, at once: clients see the stream open before the first token.
            for j in range(n):
                yield chunk(j, DeltaMessage(role=role, content=""))
                if echo:
                    yield chunk(j, DeltaMessage(content=echo))
            async for _, output in self.iterate_streams([stream]):
                if output.error is not None:
                    raise APIError(f"the engine failed on this request: {output.error}", 500)
                num_prompt, num_cached = len(output.prompt_token_ids), output.num_cached_tokens
                for completion in output.outputs:
                    choice = choices[completion.index]
                    if choice.finish_reason is not None:
                        continue
                    text, logprobs = self._update_choice(request, choice, completion)
                    if not text and not logprobs and completion.finish_reason is None:
                        continue
                    yield chunk(
                        completion.index,
                        DeltaMessage(content=text) if text or completion.finish_reason is None else DeltaMessage(),
                        ChatCompletionLogProbs(content=logprobs) if request.logprobs else None,
                        completion.finish_reason,
                        completion.stop_reason,
                    )
            if request.include_usage:
                usage = make_usage(num_prompt, sum(c.num_tokens for c in choices), num_cached)
                yield sse(
                    ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name, choices=[], usage=usage)
                )
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            yield sse_error(e)
        yield SSE_DONE
