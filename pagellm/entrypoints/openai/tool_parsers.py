"""Tool-call parsers: a model's own tool-call text -> OpenAI ``tool_calls``, whole or as stream deltas.

``hermes`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen,
and what small chat models are prompted to write), as vLLM's parser of that name.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from pagellm.entrypoints.openai.protocol import random_id


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: random_id("call"))


@dataclass
class ParsedMessage:
    content: Optional[str]
    tool_calls: list[ParsedToolCall]


@dataclass
class StreamDelta:
    """What one streamed piece of text adds: content and/or (index, call) of tool calls."""

    content: str = ""
    tool_calls: list[tuple[int, ParsedToolCall]] = field(default_factory=list)


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def __init__(self) -> None:
        self._text = ""
        self._sent_content = 0  # characters of text streamed as content
        self._num_calls = 0  # tool calls streamed

    @staticmethod
    def _call(block: str) -> Optional[ParsedToolCall]:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def extract(self, text: str) -> ParsedMessage:
        """The whole reply parsed; text with a malformed tool call stays content, as vLLM does."""
        if self.START not in text:
            return ParsedMessage(text, [])
        calls = [self._call(m.group(1)) for m in self._BLOCK.finditer(text)]
        if not calls or any(c is None for c in calls):
            return ParsedMessage(text, [])
        # Kept as written (not stripped), so that it equals the streamed content.
        content = text[: text.index(self.START)]
        return ParsedMessage(content if content.strip() else None, calls)  # type: ignore[arg-type]

    def extract_streaming(self, delta_text: str, finished: bool) -> StreamDelta:
        """Feeds the next piece of text; content goes out as it comes, each call once it is complete."""
        self._text += delta_text
        out = StreamDelta()
        start = self._text.find(self.START)
        # Content: everything before the first tag, less a tail that may be the tag's beginning.
        limit = start if start >= 0 else len(self._text)
        if start < 0 and not finished:
            for k in range(min(len(self.START) - 1, len(self._text)), 0, -1):
                if self.START.startswith(self._text[-k:]):
                    limit = len(self._text) - k
                    break
        if limit > self._sent_content:
            out.content = self._text[self._sent_content : limit]
            self._sent_content = limit
        if start < 0:
            return out
        blocks = list(self._BLOCK.finditer(self._text, start))
        for i, match in enumerate(blocks):
            if i < self._num_calls:
                continue
            complete = match.group(0).rstrip().endswith(self.END) or finished
            call = self._call(match.group(1)) if complete else None
            if call is None:
                if complete and finished:
                    # A malformed call at the end: its text goes out as content rather than being lost.
                    out.content += match.group(0)
                    self._num_calls += 1
                    continue
                break
            out.tool_calls.append((self._num_calls, call))
            self._num_calls += 1
        return out


TOOL_PARSERS = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> type[HermesToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_PARSERS)}") from None
