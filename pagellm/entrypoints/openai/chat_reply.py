"""One chat choice's reply read apart: the reasoning, the answer, and the tool calls in the answer.

The reasoning parser (``--reasoning-parser``) takes the thinking off the front; what is left is the
answer, which the tool-call parser (``tool_choice`` "auto") or the forced-call JSON (``required`` or
a named function, constrained only after the thinking) turns into calls. Whole replies and streamed
pieces go through the same steps, so a stream's deltas join into the whole reply.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser
from pagellm.entrypoints.openai.tools import forced_tool_calls

# OpenAI's reasoning_effort as a thinking budget in tokens (None: no limit), for models that think
# without an effort setting of their own; an explicit thinking_token_budget wins.
EFFORT_BUDGETS: dict[str, Optional[int]] = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None}


@dataclass
class ReplyParts:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: list[ParsedToolCall]


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def template_kwargs(request: ChatCompletionRequest, defaults: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The chat template's options: the server's defaults, then the request's; ``reasoning_effort``
    reaches templates that read it (gpt-oss), and "none" turns thinking off where a template can."""
    kwargs = dict(defaults or {})
    kwargs.update(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
        if request.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    return kwargs


def thinking_budget(request: ChatCompletionRequest, default: Optional[int]) -> Optional[int]:
    """The request's budget: its own, else its reasoning_effort's, else the server's."""
    if request.thinking_token_budget is not None:
        return request.thinking_token_budget
    if request.reasoning_effort is not None:
        return EFFORT_BUDGETS[request.reasoning_effort]
    return default


class ChatReply:
    """One choice's reader; streaming keeps state, so each choice has its own."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        tool_mode: str,
        tool_parser_cls: Optional[type[ToolParser]],
        reasoning_parser: Any,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self.request = request
        self.tool_mode = tool_mode
        self.reasoning = reasoning_parser
        self.tools: Optional[ToolParser] = None
        if tool_mode == "auto" and tool_parser_cls is not None:
            self.tools = tool_parser_cls(tools=[t.model_dump(exclude_none=True) for t in request.tools or []])
            self.tools.prime(prompt_token_ids)
        self._answer = ""  # a forced call's JSON, read once whole

    def _calls(self, content: Optional[str], token_ids: Sequence[int]) -> tuple[Optional[str], list[ParsedToolCall]]:
        if self.tool_mode in ("named", "required"):
            forced = forced_tool_calls(self.request, self.tool_mode, content or "")
            # Cut short (max_tokens): the text goes back as content, finish_reason "length".
            return (None, forced) if forced is not None else (content, [])
        if self.tools is not None:
            parsed = self.tools.extract(content or "", token_ids)
            return parsed.content, parsed.tool_calls
        return content, []

    def whole(self, text: str, token_ids: Sequence[int]) -> ReplyParts:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text, token_ids)
        content, calls = self._calls(content, token_ids)
        return ReplyParts(reasoning, content, calls)

    def stream(self, delta_text: str, delta_token_ids: Sequence[int], finished: bool) -> ReplyDelta:
        out = ReplyDelta()
        content = delta_text
        if self.reasoning is not None:
            piece = self.reasoning.extract_reasoning_streaming(delta_text, delta_token_ids)
            out.reasoning, content = piece.reasoning, piece.content
            if finished:
                rest = self.reasoning.finish()
                out.reasoning += rest.reasoning
                content += rest.content
        if self.tools is not None:
            piece = self.tools.extract_streaming(content, finished, delta_token_ids)
            out.content, out.tool_calls = piece.content, [call for _, call in piece.tool_calls]
        elif self.tool_mode in ("named", "required"):
            # Forced calls are JSON that only parses whole: held back until the reply ends.
            self._answer += content
            if finished:
                out.content, out.tool_calls = self._calls(self._answer, ())
                out.content = out.content or ""
        else:
            out.content = content
        return out

    def num_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        return 0 if self.reasoning is None else self.reasoning.num_reasoning_tokens(token_ids)
