"""What every tool-call parser gives back, and the streaming that all of them share.

A parser reads one model family's tool-call text. It says two things about the text so far:
``extract`` parses a whole reply, ``partial`` says how much of an unfinished one is surely content
and which calls are already complete. The base class turns ``partial`` into stream deltas: content
goes out as it comes (less a tail that may begin a call), each call once it is complete (its name,
then its arguments in one piece, so that the argument deltas of a call always join into valid
JSON), and when the reply ends, ``extract`` decides: a call that does not parse is sent as content,
never as an error.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.protocol import random_id
from pagellm.reasoning.tags import held_back as held_back  # call markers are held back as reasoning markers are


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = field(default_factory=lambda: random_id("call"))


@dataclass
class ParsedMessage:
    content: Optional[str]  # None when the reply is only tool calls (or whitespace around them)
    tool_calls: list[ParsedToolCall]


@dataclass
class StreamDelta:
    """What one streamed piece of text adds: content and/or (index, call) of newly complete calls."""

    content: str = ""
    tool_calls: list[tuple[int, ParsedToolCall]] = field(default_factory=list)


@dataclass
class PartialParse:
    """An unfinished reply as far as it can be read: ``content_end`` leading characters are content
    for sure (they may be sent), ``calls`` are the calls already complete, in order."""

    content_end: int
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """One reply's parser (streaming keeps state): ``tools`` are the request's tools as OpenAI
    dicts (``{"type": "function", "function": {...}}``), for parsers that type arguments by schema."""

    name: str = ""
    # Strings that start a call: where a tokenizer makes them special tokens, the reply is decoded
    # with special tokens kept, or the parser would never see them.
    markers: tuple[str, ...] = ()

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None) -> None:
        self.tools = tools or []
        self._text = ""
        self._token_ids: list[int] = []
        self._sent_content = 0  # characters of the text streamed as content
        self._num_calls = 0  # calls streamed
        self._done = False

    def prime(self, prompt_token_ids: Sequence[int]) -> None:
        """Told the prompt before the reply (for formats whose prompt can open the reply's first
        message, as harmony's); most parsers need nothing of it."""
        return None

    @abstractmethod
    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        """The whole reply parsed. Text with a malformed call stays content (no calls), as vLLM does."""

    @abstractmethod
    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        """An unfinished reply read as far as it goes (see ``PartialParse``)."""

    def tool_schema(self, name: str) -> Optional[dict[str, Any]]:
        """The JSON schema of the named tool's parameters, when the request gave it."""
        for tool in self.tools:
            fn = tool.get("function", tool) if isinstance(tool, dict) else {}
            if fn.get("name") == name:
                return fn.get("parameters") or {}
        return None

    def extract_streaming(self, delta_text: str, finished: bool, delta_token_ids: Sequence[int] = ()) -> StreamDelta:
        """Feeds the next piece of the reply; returns what may be sent now."""
        if self._done:
            return StreamDelta()
        self._text += delta_text
        self._token_ids.extend(delta_token_ids)
        out = StreamDelta()
        if finished:
            self._done = True
            whole = self.extract(self._text, self._token_ids)
            sent = self._text[: self._sent_content]
            if not whole.tool_calls:
                out.content = self._text[self._sent_content :]
                return out
            # Calls already sent stay as they were (same ids); the rest go now.
            for i, call in enumerate(whole.tool_calls[self._num_calls :], start=self._num_calls):
                out.tool_calls.append((i, call))
            self._num_calls = len(whole.tool_calls)
            content = whole.content or ""
            if content.startswith(sent):
                out.content = content[len(sent) :]
            return out
        part = self.partial(self._text, self._token_ids)
        if part.content_end > self._sent_content:
            out.content = self._text[self._sent_content : part.content_end]
            self._sent_content = part.content_end
        for i, call in enumerate(part.calls[self._num_calls :], start=self._num_calls):
            out.tool_calls.append((i, call))
        self._num_calls = max(self._num_calls, len(part.calls))
        return out


PENDING, DONE, BAD = "pending", "done", "bad"


@dataclass
class CallScan:
    """A reply read by a ``ScanningToolParser``: content up to ``content_end``, then ``calls``."""

    content_end: int
    calls: list[ParsedToolCall] = field(default_factory=list)
    state: str = DONE  # DONE: every call read; PENDING: the last one is still open; BAD: one will never parse
    tail: Optional[ParsedToolCall] = None  # an open last call that the whole reply takes as it stands


class ScanningToolParser(ToolParser):
    """A format whose reply is content up to the first of ``starts``, then calls that ``_scan`` reads:
    ``extract`` and ``partial`` follow from the scan's state."""

    starts: tuple[str, ...] = ()

    @abstractmethod
    def _scan(self, text: str, final: bool) -> Optional[CallScan]:
        """The calls of the text (None when nothing may start one); ``final`` when it is the whole reply."""

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        scan = self._scan(text, final=True)
        if scan is None or scan.state == BAD or (scan.state == PENDING and scan.tail is None):
            return ParsedMessage(text, [])
        calls = scan.calls + ([scan.tail] if scan.tail is not None else [])
        if not calls:
            return ParsedMessage(text, [])
        content = text[: scan.content_end]
        return ParsedMessage(content if content.strip() else None, calls)

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        scan = self._scan(text, final=False)
        if scan is None:
            end, calls = held_back(text, self.starts), []
        elif scan.state == BAD and not scan.calls:
            return PartialParse(len(text))  # the reply will be content whatever follows
        else:
            end, calls = scan.content_end, scan.calls
        # Whitespace alone before the calls is not content (the whole reply says None), so it waits.
        return PartialParse(end if text[:end].strip() else 0, calls)
