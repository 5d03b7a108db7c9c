"""``POST /v1/chat/completions``: messages through the model's chat template, reply streamed or not."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_llm import RequestStream
from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.chat_reply import ChatReply, template_kwargs, thinking_budget
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
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    random_id,
)
from pagellm.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    logprob_value,
    make_usage,
    messages_to_dicts,
    prompt_logprobs_json,
    run_until_disconnected,
    sse,
    sse_error,
)
from pagellm.entrypoints.openai.tool_parsers import ParsedToolCall, get_tool_parser
from pagellm.entrypoints.openai.tools import add_tools_to_messages, forced_constraint, resolve_tool_choice
from pagellm.outputs import CompletionOutput, SampleLogprobs


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[ChatCompletionLogProbsContent] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    reply: Optional[ChatReply] = None  # made with the first output (its parsers need the prompt)
    num_tool_calls: int = 0


@dataclass
class ChatRun:
    """A chat request added to the engine: what reading its reply needs."""

    request: ChatCompletionRequest
    request_id: str
    created: int
    stream: RequestStream
    n: int
    role: str
    echo: str
    tool_mode: str  # "none", "auto", "required" or "named"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # As the engine last reported them, for the usage.
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class ChatDelta:
    """One streamed piece of one choice, or (``usage`` set, nothing else) the tally at the end."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatCompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    usage: Optional[UsageInfo] = None


def make_chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    request: Any,
    add_special_tokens: bool,
    cache_salt: Optional[str],
    input_processor: Any = None,
    kwargs: Optional[dict[str, Any]] = None,
    chat_template: Optional[str] = None,
) -> dict[str, Any]:
    """Renders and tokenizes a conversation (runs on the engine thread); template errors -> ValueError.

    ``request`` (a chat or tokenize request) gives the template's options: ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template`` and ``chat_template_kwargs`` (``kwargs`` and
    ``chat_template``, when given, in their place: the server's defaults merged in). With
    ``input_processor``, a rendering too long for the context is refused before tokenizing.
    """
    from pagellm.tokenizer import render_chat

    kwargs = dict(request.chat_template_kwargs or {}) if kwargs is None else dict(kwargs)
    if request.continue_final_message:
        kwargs["continue_final_message"] = True
    template = request.chat_template or chat_template
    try:
        text = render_chat(tokenizer, messages, request.add_generation_prompt, template, **kwargs)
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
    def __init__(
        self,
        async_llm,
        served_model_name: str,
        trust_request_chat_template: bool = False,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: Optional[str] = None,
        reasoning_parser: Optional[str] = None,
        reasoning_config: Optional[dict[str, Any]] = None,
        chat_template: Optional[str] = None,
        default_chat_template_kwargs: Optional[dict[str, Any]] = None,
        default_thinking_token_budget: Optional[int] = None,
    ) -> None:
        from pagellm.reasoning import get_reasoning_parser

        super().__init__(async_llm, served_model_name, trust_request_chat_template)
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tool_parser_cls = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.reasoning_config = reasoning_config
        self.chat_template = chat_template  # --chat-template: in place of the model's own
        self.default_chat_template_kwargs = default_chat_template_kwargs
        if default_thinking_token_budget is not None and reasoning_parser is None:
            raise ValueError("a default thinking token budget needs --reasoning-parser")
        self.default_thinking_token_budget = default_thinking_token_budget

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start_chat(request, random_id("chatcmpl"))
        if request.stream:
            return StreamingResponse(self._stream(run), media_type="text/event-stream")
        response = await run_until_disconnected(raw_request, lambda: self._full(run))
        if response is None:
            return Response(status_code=499)
        return JSONResponse(response.model_dump())

    async def start_chat(self, request: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Validates the request, renders its conversation and adds it to the engine (the Responses API's entry too)."""
        lora_request = self.check_model(request.model)
        self.check_runner("Chat Completions")
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
        params = request.to_sampling_params(max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
        if self.reasoning_parser_cls is not None:
            params.thinking_token_budget = thinking_budget(request, self.default_thinking_token_budget)
            # Markers that are special tokens would be dropped from the text the parser reads.
            params.skip_special_tokens = params.skip_special_tokens and not self._special_markers
        elif request.thinking_token_budget is not None:
            raise APIError("thinking_token_budget needs a server started with --reasoning-parser", param="thinking_token_budget")
        params = self.check_params(params)
        messages = messages_to_dicts(request.messages)
        tokenizer = self.async_llm.tokenizer
        kwargs = template_kwargs(request, self.default_chat_template_kwargs)
        tool_mode = resolve_tool_choice(request, self.enable_auto_tool_choice and self.tool_parser_cls is not None)
        if tool_mode == "auto" and self.tool_parser_cls is not None and self._special(self.tool_parser_cls.markers):
            params.skip_special_tokens = False  # the call markers are special tokens
        if tool_mode in ("named", "required"):
            if params.structured_outputs is not None:
                raise APIError("a forced tool_choice cannot be combined with another output constraint", param="tool_choice")
            params.structured_outputs = forced_constraint(request, tool_mode)
        if tool_mode != "none":
            messages = add_tools_to_messages(messages, request, self.chat_template or getattr(tokenizer, "chat_template", None))
        if tool_mode == "auto" and request.n not in (None, 1) and request.stream:
            raise APIError("streamed tool calls support n=1 only", param="n")

        def prompt() -> dict[str, Any]:
            return make_chat_prompt(
                tokenizer,
                messages,
                request,
                request.add_special_tokens,
                request.cache_salt,
                self.async_llm.engine.input_processor,
                kwargs,
                self.chat_template,
            )

        role = "assistant" if request.add_generation_prompt else messages[-1]["role"]
        echo = ""
        if request.echo and messages[-1]["role"] == role:
            echo = messages[-1]["content"]
        created = int(time.time())
        streams = await self.add_requests(request_id, [prompt], params, time.monotonic(), lora_request)
        return ChatRun(request, request_id, created, streams[0], n, role, echo, tool_mode, kwargs)

    @functools.cached_property
    def _special_tokens(self) -> frozenset[str]:
        return frozenset(getattr(self.async_llm.tokenizer, "all_special_tokens", ()))

    def _special(self, markers: Sequence[Optional[str]]) -> bool:
        """Whether any of ``markers`` is a special token (skipped from the text unless asked not to)."""
        return any(m in self._special_tokens for m in markers if m)

    @property
    def _special_markers(self) -> bool:
        """Whether the reasoning markers are special tokens."""
        if self.reasoning_parser_cls.keep_special_tokens:
            return True
        strings = self.reasoning_parser_cls.boundary_strings(self.reasoning_config)
        return self._special((strings.start, strings.end))

    def _reply(self, run: ChatRun) -> ChatReply:
        reasoning = None
        if self.reasoning_parser_cls is not None:
            reasoning = self.reasoning_parser_cls(
                self.async_llm.tokenizer, run.prompt_token_ids, run.template_kwargs, self.reasoning_config
            )
        return ChatReply(run.request, run.tool_mode, self.tool_parser_cls, reasoning, run.prompt_token_ids)

    def _logprobs(
        self, request: ChatCompletionRequest, token_ids: list[int], logprobs: Optional[SampleLogprobs]
    ) -> list[ChatCompletionLogProbsContent]:
        if not request.logprobs or logprobs is None:
            return []
        num_top = request.top_logprobs or 0
        as_ids = bool(request.return_tokens_as_token_ids)

        def text(token_id: int, decoded: Optional[str]) -> str:
            if as_ids:
                return f"token_id:{token_id}"
            return decoded if decoded is not None else self.async_llm.tokenizer.decode([token_id])

        content = []
        for token_id, step in zip(token_ids, logprobs):
            chosen = step.get(token_id)
            if chosen is None:
                continue
            token = text(token_id, chosen.decoded_token)
            # The dict holds the sampled token (any rank) and the top-k: keep the top-k, by rank.
            top = sorted(((t, lp) for t, lp in step.items() if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[1].rank)
            top_items = []
            for t, lp in top:
                name = text(t, lp.decoded_token or "")
                top_items.append(
                    ChatCompletionLogProb(token=name, logprob=logprob_value(lp), bytes=list(name.encode("utf-8", errors="replace")))
                )
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=logprob_value(chosen),
                    bytes=list(token.encode("utf-8", errors="replace")),
                    top_logprobs=top_items,
                )
            )
        return content

    def _update_choice(self, request: ChatCompletionRequest, choice: _Choice, completion: CompletionOutput) -> tuple[str, list]:
        logprobs = self._logprobs(request, list(completion.token_ids), completion.logprobs)
        choice.text += completion.text
        choice.token_ids.extend(completion.token_ids)
        choice.logprobs.extend(logprobs)
        if completion.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason
        return completion.text, logprobs

    def _message(self, request: ChatCompletionRequest, choice: _Choice, role: str, echo: str, tool_mode: str) -> ChatResponseMessage:
        """The reply: reasoning apart, tool calls read out of the answer when tools are in play."""
        parts = choice.reply.whole(choice.text, choice.token_ids)  # type: ignore[union-attr]
        content: Optional[str] = parts.content
        if echo:
            content = echo + (content or "")
        if parts.tool_calls and tool_mode != "named" and choice.finish_reason == "stop":
            choice.finish_reason = "tool_calls"
        tool_calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parts.tool_calls]
        reasoning = parts.reasoning if request.include_reasoning else None
        return ChatResponseMessage(role=role, content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=tool_calls)

    @staticmethod
    def _tool_call_deltas(choice: _Choice, calls: list[ParsedToolCall]) -> list[DeltaMessage]:
        """Each call as OpenAI streams one: id, type and name first, then the arguments."""
        deltas = []
        for call in calls:
            index = choice.num_tool_calls
            choice.num_tool_calls += 1
            deltas.append(DeltaMessage(tool_calls=[
                DeltaToolCall(index=index, id=call.id, type="function", function=DeltaFunctionCall(name=call.name, arguments=""))
            ]))
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))]))
        return deltas

    async def _completions(self, run: ChatRun, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, CompletionOutput]]:
        """Each new piece of a sample not yet finished, with its choice; keeps the run's token counts."""
        async for _, output in self.iterate_streams([run.stream]):
            if output.error is not None:
                raise APIError(f"the engine failed on this request: {output.error}", 500)
            run.num_prompt_tokens, run.num_cached_tokens = len(output.prompt_token_ids), output.num_cached_tokens
            run.prompt_token_ids = list(output.prompt_token_ids)
            if output.prompt_logprobs:
                run.prompt_logprobs.extend(output.prompt_logprobs)
            for completion in output.outputs:
                choice = choices[completion.index]
                if choice.reply is None:
                    choice.reply = self._reply(run)
                if choice.finish_reason is None:  # finished samples of n > 1 repeat in later outputs
                    yield choice, completion

    def _usage(self, run: ChatRun, choices: list[_Choice]) -> UsageInfo:
        usage = make_usage(run.num_prompt_tokens, sum(len(c.token_ids) for c in choices), run.num_cached_tokens)
        if self.reasoning_parser_cls is not None:
            num = sum(c.reply.num_reasoning_tokens(c.token_ids) for c in choices if c.reply is not None)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=num)
        return usage

    async def _full(self, run: ChatRun) -> ChatCompletionResponse:
        request, n, role, echo, tool_mode = run.request, run.n, run.role, run.echo, run.tool_mode
        choices = [_Choice() for _ in range(n)]
        async for choice, completion in self._completions(run, choices):
            self._update_choice(request, choice, completion)
        for c in choices:
            c.reply = c.reply or self._reply(run)
        messages = [self._message(request, c, role, echo, tool_mode) for c in choices]
        return ChatCompletionResponse(
            id=run.request_id,
            created=run.created,
            model=self.response_model(run.request.model),
            choices=[
                ChatCompletionResponseChoice(
                    index=j,
                    message=message,
                    logprobs=ChatCompletionLogProbs(content=c.logprobs) if request.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for j, (c, message) in enumerate(zip(choices, messages))
            ],
            usage=self._usage(run, choices),
            prompt_logprobs=prompt_logprobs_json(run.prompt_token_ids, run.prompt_logprobs, request.return_tokens_as_token_ids)
            if request.prompt_logprobs is not None
            else None,
        )

    async def stream_deltas(self, run: ChatRun) -> AsyncIterator[ChatDelta]:
        """The reply as OpenAI's chat deltas, role first; the last one carries the usage. Raises on failure."""
        request, n, tool_mode = run.request, run.n, run.tool_mode
        choices = [_Choice() for _ in range(n)]
        # The role goes first, at once: clients see the stream open before the first token.
        for j in range(n):
            yield ChatDelta(j, DeltaMessage(role=run.role, content=""))
            if run.echo:
                yield ChatDelta(j, DeltaMessage(content=run.echo))
        async for choice, completion in self._completions(run, choices):
            _, logprobs = self._update_choice(request, choice, completion)
            finish_reason = completion.finish_reason
            piece = choice.reply.stream(completion.text, list(completion.token_ids), finish_reason is not None)  # type: ignore[union-attr]
            if piece.reasoning and request.include_reasoning:
                yield ChatDelta(completion.index, DeltaMessage(reasoning=piece.reasoning, reasoning_content=piece.reasoning))
            for delta in self._tool_call_deltas(choice, piece.tool_calls):
                yield ChatDelta(completion.index, delta)
            if choice.num_tool_calls and finish_reason == "stop" and tool_mode != "named":
                finish_reason = "tool_calls"
            text = piece.content
            if not text and not logprobs and finish_reason is None:
                continue
            yield ChatDelta(
                completion.index,
                DeltaMessage(content=text) if text or finish_reason is None else DeltaMessage(),
                ChatCompletionLogProbs(content=logprobs) if request.logprobs else None,
                finish_reason,
                completion.stop_reason,
            )
        yield ChatDelta(0, DeltaMessage(), usage=self._usage(run, choices))

    async def _stream(self, run: ChatRun) -> AsyncIterator[str]:
        request = run.request
        exclude = None if request.include_usage else {"usage"}
        try:
            async for d in self.stream_deltas(run):
                if d.usage is not None:
                    if request.include_usage:
                        yield sse(
                            ChatCompletionStreamResponse(
                                id=run.request_id, created=run.created, model=self.response_model(request.model), choices=[], usage=d.usage
                            )
                        )
                    continue
                choice = ChatCompletionResponseStreamChoice(
                    index=d.index, delta=d.delta, logprobs=d.logprobs, finish_reason=d.finish_reason, stop_reason=d.stop_reason
                )
                yield sse(
                    ChatCompletionStreamResponse(
                        id=run.request_id, created=run.created, model=self.response_model(request.model), choices=[choice]
                    ),
                    exclude,
                )
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            yield sse_error(e)
        yield SSE_DONE
