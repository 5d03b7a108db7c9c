"""``POST /v1/completions``: prompts (text or token ids, one or many) in, text out, streamed or not."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import LazyPrompt, RequestStream
from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_id,
)
from pagellm.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    lazy_prompts,
    logprob_value,
    make_usage,
    prompt_items,
    prompt_logprobs_json,
    run_until_disconnected,
    sse,
    sse_error,
)
from pagellm.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs

# One HTTP request fans out into prompts x n sequences. Without a cap, an 8 MiB body of one-token
# prompts times n=128 queues hundreds of millions of requests and the server runs out of memory.
MAX_SEQUENCES_PER_REQUEST = 1024


@dataclass
class _Choice:
    """One choice being accumulated (non-streamed) or tracked (streamed)."""

    text: str = ""
    num_tokens: int = 0
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    echoed: bool = False


@dataclass
class _PromptInfo:
    """Per prompt of the request: what usage and echo need, filled in as outputs arrive."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs = field(default_factory=list)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora_request = self.check_model(request.model)
        self.check_runner("Completions")
        if request.suffix:
            raise APIError("suffix is not supported", param="suffix")
        n = 1 if request.n is None else request.n
        if request.best_of is not None and request.best_of != n:
            raise APIError("best_of must be unset or equal to n", param="best_of")
        if request.max_tokens == 0 and not request.echo:
            # Scoring only makes sense when the prompt comes back (with its logprobs).
            raise APIError("max_tokens must be at least 1, or 0 with echo=true to score the prompt", param="max_tokens")
        params = self.check_params(request.to_sampling_params(request.max_tokens, request.logprobs))
        num_prompts = len(prompt_items(request.prompt))
        if num_prompts * n > MAX_SEQUENCES_PER_REQUEST:
            raise APIError(
                f"a request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts x n), "
                f"got {num_prompts} prompts x n={n}",
                param="prompt",
            )
        prompts = self._prompts(request)
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = request.logprobs  # echoed prompt tokens carry logprobs too
        request_id = random_id("cmpl")
        created = int(time.time())
        streams = await self.add_requests(request_id, prompts, params, time.monotonic(), lora_request)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, streams, n), media_type="text/event-stream"
            )
        response = await run_until_disconnected(raw_request, lambda: self._full(request, request_id, created, streams, n))
        if response is None:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    def _prompts(self, request: CompletionRequest) -> list[LazyPrompt]:
        items = prompt_items(request.prompt)
        if not items:
            raise APIError("prompt must not be empty", param="prompt")
        return lazy_prompts(items, self.async_llm.engine.input_processor, request.add_special_tokens, request.cache_salt)

    # -- helpers shared by both paths ----------------------------------------------------------------

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: Union[SampleLogprobs, PromptLogprobs],
        initial_offset: int,
        as_token_ids: bool = False,
    ) -> CompletionLogProbs:
        result = CompletionLogProbs()
        offset = initial_offset

        def text(token_id: int, decoded: Optional[str]) -> str:
            if as_token_ids:
                return f"token_id:{token_id}"
            return decoded if decoded is not None else self.async_llm.tokenizer.decode([token_id])

        for token_id, step in zip(token_ids, logprobs):
            if step is None or token_id not in step:  # the first prompt token has no logprob
                token = text(token_id, None)
                result.tokens.append(token)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                chosen = step[token_id]
                token = text(token_id, chosen.decoded_token)
                result.tokens.append(token)
                result.token_logprobs.append(logprob_value(chosen))
                result.top_logprobs.append({text(tid, lp.decoded_token): logprob_value(lp) for tid, lp in step.items()})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _echo_prefix(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.async_llm.tokenizer.decode(output.prompt_token_ids)

    def _update_choice(
        self,
        request: CompletionRequest,
        choice: _Choice,
        output: RequestOutput,
        completion: CompletionOutput,
        prompt_logprobs: PromptLogprobs,
    ) -> tuple[str, Optional[CompletionLogProbs]]:
        """Adds an output's delta to a choice; returns the new text and logprobs it contributes.

        The first delta of an echoed choice is prefixed with the prompt (and, with logprobs, the
        prompt tokens' logprobs, which are complete by then: they arrive before the first token).
        """
        text = completion.text
        token_ids = list(completion.token_ids)
        logprobs: list = list(completion.logprobs or [])
        if request.echo and not choice.echoed:
            choice.echoed = True
            text = self._echo_prefix(output) + text
            if request.logprobs is not None:
                prompt_ids = output.prompt_token_ids
                padded = list(prompt_logprobs) + [None] * (len(prompt_ids) - len(prompt_logprobs))
                token_ids = prompt_ids + token_ids
                logprobs = padded[: len(prompt_ids)] + logprobs
        new_logprobs = None
        if request.logprobs is not None:
            new_logprobs = self._logprobs(token_ids, logprobs, len(choice.text), bool(request.return_tokens_as_token_ids))
            choice.logprobs = _extend_logprobs(choice.logprobs, new_logprobs)
        choice.text += text
        choice.num_tokens += len(completion.token_ids)
        if completion.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        return text, new_logprobs

    async def _consume(self, streams: list[RequestStream], infos: list[_PromptInfo]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams, keeping ``infos`` (one per prompt) up to date."""
        async for i, output in self.iterate_streams(streams):
            if output.error is not None:
                raise APIError(f"the engine failed on this request: {output.error}", 500)
            infos[i].num_prompt_tokens = len(output.prompt_token_ids)
            infos[i].prompt_token_ids = list(output.prompt_token_ids)
            infos[i].num_cached_tokens = output.num_cached_tokens
            if output.prompt_logprobs:
                infos[i].prompt_logprobs.extend(output.prompt_logprobs)
            yield i, output

    # -- non-streamed ---------------------------------------------------------------------------------

    async def _full(
        self, request: CompletionRequest, request_id: str, created: int, streams: list[RequestStream], n: int
    ) -> CompletionResponse:
        choices = [_Choice() for _ in range(len(streams) * n)]
        infos = [_PromptInfo() for _ in streams]
        async for i, output in self._consume(streams, infos):
            for completion in output.outputs:
                choice = choices[i * n + completion.index]
                if choice.finish_reason is None:  # finished samples of n > 1 repeat in later outputs
                    self._update_choice(request, choice, output, completion, infos[i].prompt_logprobs)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.response_model(request.model),
            choices=[
                CompletionResponseChoice(
                    index=j,
                    text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(
                        infos[j // n].prompt_token_ids, infos[j // n].prompt_logprobs, request.return_tokens_as_token_ids
                    )
                    if request.prompt_logprobs is not None
                    else None,
                )
                for j, c in enumerate(choices)
            ],
            usage=_usage(infos, choices),
        )

    # -- streamed -------------------------------------------------------------------------------------

    async def _stream(
        self, request: CompletionRequest, request_id: str, created: int, streams: list[RequestStream], n: int
    ) -> AsyncIterator[str]:
        choices = [_Choice() for _ in range(len(streams) * n)]
        infos = [_PromptInfo() for _ in streams]
        # Without include_usage, chunks carry no usage key at all; with it, "usage": null until the last.
        exclude = None if request.include_usage else {"usage"}
        try:
            async for i, output in self._consume(streams, infos):
                for completion in output.outputs:
                    index = i * n + completion.index
                    choice = choices[index]
                    if choice.finish_reason is not None:
                        continue
                    text, logprobs = self._update_choice(request, choice, output, completion, infos[i].prompt_logprobs)
                    if not text and not completion.token_ids and completion.finish_reason is None:
                        continue
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        created=created,
                        model=self.response_model(request.model),
                        choices=[
                            CompletionResponseStreamChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=completion.finish_reason,
                                stop_reason=completion.stop_reason,
                            )
                        ],
                    )
                    yield sse(chunk, exclude)
            if request.include_usage:
                usage = _usage(infos, choices)
                model = self.response_model(request.model)
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            yield sse_error(e)
        yield SSE_DONE


def _usage(infos: list[_PromptInfo], choices: list[_Choice]):
    return make_usage(
        sum(info.num_prompt_tokens for info in infos),
        sum(c.num_tokens for c in choices),
        sum(info.num_cached_tokens for info in infos),
    )


def _extend_logprobs(acc: Optional[CompletionLogProbs], new: CompletionLogProbs) -> CompletionLogProbs:
    if acc is None:
        return new.model_copy(deep=True)  # `new` goes out in a chunk; keep the running total separate
    acc.tokens.extend(new.tokens)
    acc.token_logprobs.extend(new.token_logprobs)
    acc.top_logprobs.extend(new.top_logprobs)
    acc.text_offset.extend(new.text_offset)
    return acc
