"""``/v1/responses``: OpenAI's Responses API on top of the chat path.

A request becomes the chat request its conversation would be (``input_items.py``), runs through
``OpenAIServingChat.start_chat`` and ``stream_deltas`` (chat template, sampling parameters,
structured output, tool-call parsing, detokenised streaming), and the chat deltas are re-cut into
the Responses API's output items and typed stream events. Streamed and non-streamed replies are
built by the same ``ResponseBuilder``, so they are the same response.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.errors import APIError, error_body
from pagellm.entrypoints.openai.chat_reply import EFFORT_BUDGETS
from pagellm.entrypoints.openai.input_items import (
    chat_tool_choice,
    chat_tools,
    function_tools,
    items_to_messages,
    normalize_input,
)
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, DeltaToolCall, UsageInfo
from pagellm.entrypoints.openai.protocol_responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.serving_base import run_until_disconnected, sse_data, to_api_error
from pagellm.entrypoints.openai.serving_chat import ChatDelta, ChatRun, OpenAIServingChat


def check_supported(request: ResponsesRequest) -> None:
    """400 for what the request asks that this server cannot honour, rather than ignoring it."""
    refused = {
        "background": "background responses are not supported",
        "include": "include is not supported (no logprobs, reasoning or tool outputs to add)",
        "conversation": "conversations are not supported; chain turns with previous_response_id",
        "prompt": "stored prompt templates are not supported",
        "max_tool_calls": "max_tool_calls is not supported; use parallel_tool_calls=false for at most one call",
    }
    for name, message in refused.items():
        if getattr(request, name):
            raise APIError(message, param=name)
    reasoning = request.reasoning
    if reasoning is not None and reasoning.effort not in (None, *EFFORT_BUDGETS):
        raise APIError(f"reasoning.effort must be one of {', '.join(EFFORT_BUDGETS)}, got {reasoning.effort!r}", param="reasoning")
    if request.top_logprobs:
        raise APIError("top_logprobs is not supported on /v1/responses", param="top_logprobs")
    if request.truncation == "auto":
        raise APIError('truncation "auto" is not supported; an input too long for the context is refused', param="truncation")
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise APIError("text.verbosity cannot be honoured by this server", param="text")
    if request.structured_outputs is not None and request.text is not None and request.text.format.type != "text":
        raise APIError("structured_outputs cannot be combined with text.format", param="structured_outputs")
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise APIError(f"max_output_tokens must be at least 1, got {request.max_output_tokens}", param="max_output_tokens")


def response_usage(usage: UsageInfo) -> ResponseUsage:
    num_cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    num_reasoning = usage.completion_tokens_details.reasoning_tokens if usage.completion_tokens_details else 0
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=num_cached),
        output_tokens=usage.completion_tokens or 0,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=num_reasoning),
        total_tokens=usage.total_tokens,
    )


class ResponseBuilder:
    """Chat deltas -> the response's output items, and (when ``emit``) the SSE events that build them."""

    def __init__(self, response: ResponseObject, emit: bool) -> None:
        self.response = response
        self.emit = emit
        self.num_events = 0
        self.held_text = ""  # whitespace before any item: dropped if tool calls follow, as the chat path drops it
        self.message: Optional[OutputMessage] = None
        self.reasoning: Optional[ReasoningItem] = None
        self.call: Optional[FunctionCallItem] = None
        self.skipping_call = False  # a second call under parallel_tool_calls=false
        self.finish_reason: Optional[str] = None

    def event(self, kind: str, **fields: Any) -> list[str]:
        if not self.emit:
            return []
        body = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return [f"event: {kind}\n" + sse_data(json.dumps(body, ensure_ascii=False))]

    def lifecycle(self, kind: str) -> list[str]:
        return self.event(kind, response=self.response.model_dump())

    def feed(self, d: ChatDelta) -> list[str]:
        if d.usage is not None:
            self.response.usage = response_usage(d.usage)
            return []
        events: list[str] = []
        if d.delta.reasoning:
            events += self._reasoning(d.delta.reasoning)
        for call in d.delta.tool_calls or []:
            events += self._tool_call(call)
        if d.delta.content:
            events += self._text(d.delta.content)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        return events

    def _index(self, item: Any) -> int:
        return self.response.output.index(item)

    def _reasoning(self, text: str) -> list[str]:
        events: list[str] = []
        if self.reasoning is None:
            self.reasoning = ReasoningItem(content=[ReasoningText()])
            self.response.output.append(self.reasoning)
            events += self.event("response.output_item.added", output_index=self._index(self.reasoning), item=self.reasoning.model_dump())
        item = self.reasoning
        item.content[0].text += text
        return events + self.event(
            "response.reasoning_text.delta", item_id=item.id, output_index=self._index(item), content_index=0, delta=text
        )

    def _close_reasoning(self) -> list[str]:
        item = self.reasoning
        if item is None or item.status != "in_progress":
            return []
        item.status = "completed"
        where = {"item_id": item.id, "output_index": self._index(item)}
        return self.event("response.reasoning_text.done", **where, content_index=0, text=item.content[0].text) + self.event(
            "response.output_item.done", output_index=where["output_index"], item=item.model_dump()
        )

    def _text(self, text: str) -> list[str]:
        events = self._close_reasoning() + self._close_call()
        if self.message is None:
            if not (self.held_text + text).strip():
                self.held_text += text
                return events
            text, self.held_text = self.held_text + text, ""
            events += self._open_message()
        message = self.message
        if message is None:
            return events
        message.content[0].text += text
        return events + self.event(
            "response.output_text.delta", item_id=message.id, output_index=self._index(message), content_index=0, delta=text, logprobs=[]
        )

    def _open_message(self) -> list[str]:
        self.message = OutputMessage()
        self.response.output.append(self.message)
        events = self.event("response.output_item.added", output_index=self._index(self.message), item=self.message.model_dump())
        self.message.content.append(OutputText())
        return events + self.event(
            "response.content_part.added", item_id=self.message.id, output_index=self._index(self.message), content_index=0,
            part=OutputText().model_dump(),
        )

    def _close_message(self) -> list[str]:
        message, self.message = self.message, None
        if message is None:
            return []
        message.status = "incomplete" if self.finish_reason == "length" else "completed"
        where = {"item_id": message.id, "output_index": self._index(message)}
        part = message.content[0]
        return (
            self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
            + self.event("response.content_part.done", **where, content_index=0, part=part.model_dump())
            + self.event("response.output_item.done", output_index=where["output_index"], item=message.model_dump())
        )

    def _tool_call(self, delta: DeltaToolCall) -> list[str]:
        events: list[str] = []
        if delta.id is not None:  # a new call: the chat path sends id and name first, then the arguments
            events += self._close_reasoning() + self._close_message() + self._close_call()
            self.skipping_call = not self.response.parallel_tool_calls and any(
                isinstance(item, FunctionCallItem) for item in self.response.output
            )
            if self.skipping_call:
                return events
            name = delta.function.name if delta.function is not None else None
            self.call = FunctionCallItem(call_id=delta.id, name=name or "")
            self.response.output.append(self.call)
            events += self.event("response.output_item.added", output_index=self._index(self.call), item=self.call.model_dump())
        arguments = delta.function.arguments if delta.function is not None else None
        if self.call is not None and not self.skipping_call and arguments:
            self.call.arguments += arguments
            events += self.event(
                "response.function_call_arguments.delta", item_id=self.call.id, output_index=self._index(self.call), delta=arguments
            )
        return events

    def _close_call(self) -> list[str]:
        call, self.call = self.call, None
        if call is None:
            return []
        call.status = "completed"
        index = self._index(call)
        return self.event("response.function_call_arguments.done", item_id=call.id, output_index=index, arguments=call.arguments) + (
            self.event("response.output_item.done", output_index=index, item=call.model_dump())
        )

    def finish(self) -> list[str]:
        """Closes what is open and settles the status; the last event (streaming) is completed or incomplete."""
        events = self._close_reasoning() + self._close_call()
        if not any(not isinstance(item, ReasoningItem) for item in self.response.output):
            text, self.held_text = self.held_text, ""
            events += self._open_message()
            if text:
                events += self._text(text)
        events += self._close_message()
        if self.finish_reason == "length":
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return events + self.lifecycle("response.incomplete")
        self.response.status = "completed"
        return events + self.lifecycle("response.completed")


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        check_supported(request)
        items = normalize_input(request.input)
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id, param="previous_response_id")
            items = normalize_input(previous.conversation()) + items
        tools = function_tools(request.tools)
        text = request.text or TextConfig()
        chat_request = ChatCompletionRequest(
            model=request.model,
            messages=items_to_messages(items, request.instructions),
            tools=chat_tools(tools),
            tool_choice=chat_tool_choice(request.tool_choice),
            reasoning_effort=request.reasoning.effort if request.reasoning is not None else None,
            thinking_token_budget=request.thinking_token_budget,
            seed=request.seed,
            structured_outputs=request.structured_outputs,
            parallel_tool_calls=request.parallel_tool_calls,
            max_completion_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            response_format=text.format.to_response_format(),
            user=request.user,
            stream=request.stream,
        )
        response = ResponseObject(
            model=self.chat.served_model_name,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            text={"format": text.format.echo()},
            tools=tools,
            tool_choice=request.tool_choice or "auto",
            parallel_tool_calls=request.parallel_tool_calls is not False,
            previous_response_id=request.previous_response_id,
            store=request.store is not False,
            metadata=request.metadata or {},
            user=request.user,
            reasoning={"effort": request.reasoning.effort, "summary": None} if request.reasoning is not None else None,
        )
        run = await self.chat.start_chat(chat_request, response.id)
        builder = ResponseBuilder(response, emit=bool(request.stream))
        if request.stream:
            return StreamingResponse(self._stream(run, builder, items), media_type="text/event-stream")
        done = await run_until_disconnected(raw_request, lambda: self._collect(run, builder, items))
        if done is None:
            return Response(status_code=499)
        return JSONResponse(done.model_dump())

    async def _collect(self, run: ChatRun, builder: ResponseBuilder, items: list[dict[str, Any]]) -> ResponseObject:
        async for d in self.chat.stream_deltas(run):
            builder.feed(d)
        builder.finish()
        self._keep(builder.response, items)
        return builder.response

    async def _stream(self, run: ChatRun, builder: ResponseBuilder, items: list[dict[str, Any]]) -> AsyncIterator[str]:
        for event in builder.lifecycle("response.created") + builder.lifecycle("response.in_progress"):
            yield event
        try:
            async for d in self.chat.stream_deltas(run):
                for event in builder.feed(d):
                    yield event
            events = builder.finish()
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            api_error = to_api_error(e)
            err = error_body(api_error.message, api_error.status_code, api_error.param)["error"]
            yield builder.event("error", code=str(err["code"]), message=err["message"], param=err["param"])[0]
            return
        self._keep(builder.response, items)
        for event in events:
            yield event

    def _keep(self, response: ResponseObject, items: list[dict[str, Any]]) -> None:
        if response.store:
            self.store.put(response, items)

    def retrieve(self, response_id: str) -> JSONResponse:
        return JSONResponse(self.store.get(response_id).response.model_dump())

    def delete(self, response_id: str) -> JSONResponse:
        self.store.delete(response_id)
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())
