"""``granite``: Granite 3.0 and 3.1 replies, ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``
(3.1 writes ``<tool_call>`` as text), as vLLM's parser of that name.

The reply must begin (after whitespace) with the marker or directly with the JSON list, and the
list must be all that follows. A reply that begins otherwise is content from its first character,
as vLLM reads it; a list that does not parse, or holds something that is not a call, leaves the
whole reply as content. Granite 4.0 writes ``<tool_call>{...}</tool_call>`` blocks between text
instead: that is vLLM's ``granite4`` (or ``hermes``), not this parser.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, ToolParser

# Granite 3.0's special token, then 3.1's plain-text tag; either, both in this order, or none.
MARKERS = ("<|tool_call|>", "<tool_call>")
_WS = " \t\r\n"


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: json.dumps would write Infinity, which is not JSON
        raise ValueError(f"non-finite number {text}")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")  # NaN, Infinity: Python's json accepts them, JSON does not


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _payload_start(text: str) -> tuple[int, bool]:
    """Where the JSON list should begin, past whitespace and the markers; and whether that is still
    undecided (the text so far is only whitespace or the beginning of a marker)."""
    i = _skip_ws(text, 0)
    for marker in MARKERS:
        if text.startswith(marker, i):
            i = _skip_ws(text, i + len(marker))
        elif i < len(text) and marker.startswith(text[i:]):
            return i, True
    return i, i >= len(text)


def _granite_call(obj: Any) -> Optional[ParsedToolCall]:
    """``{"name": ..., "arguments": {...}}`` as a call; arguments written as a JSON string of an
    object (which Granite models do) are read as that object. None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    args = obj["arguments"]
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class GraniteToolParser(ToolParser):
    name = "granite"
    markers = ("<|tool_call|>", "<tool_call>")

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        start, undecided = _payload_start(text)
        if undecided or text[start] != "[":
            return ParsedMessage(text, [])
        try:
            items = _DECODER.decode(text[start:].rstrip(_WS))
        except (ValueError, RecursionError):
            return ParsedMessage(text, [])
        if not isinstance(items, list) or not items:
            return ParsedMessage(text, [])
        calls = [_granite_call(item) for item in items]
        if any(c is None for c in calls):
            return ParsedMessage(text, [])
        return ParsedMessage(None, calls)  # type: ignore[arg-type]

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        start, undecided = _payload_start(text)
        if undecided:
            return PartialParse(0)
        if text[start] != "[":
            return PartialParse(len(text))
        calls: list[ParsedToolCall] = []
        i = start + 1
        while True:
            i = _skip_ws(text, i)
            try:
                item, end = _DECODER.raw_decode(text, i)
            except (ValueError, RecursionError):
                break  # not complete yet (or malformed: the end of the reply decides)
            sep = _skip_ws(text, end)
            if sep >= len(text):
                break  # wait for "," or "]": the item is complete only then
            call = _granite_call(item) if text[sep] in ",]" else None
            if call is None:
                # Surely not a call list: with no call sent yet, the reply is content from here on.
                return PartialParse(0 if calls else len(text), calls)
            if text[sep] == "]":
                # The last call waits for the end of the reply, which must add nothing but space:
                # text after the list makes it all content, and its calls must not have gone out.
                if text[sep + 1 :].strip() and not calls:
                    return PartialParse(len(text))
                break
            calls.append(call)
            i = sep + 1
        return PartialParse(0, calls)
