"""``gemma4``: Gemma 4's own call syntax, as vLLM's parser of that name::

    <|tool_call>call:get_weather{location:<|"|>Paris<|"|>,days:3}<tool_call|>

Keys are bare, strings sit between ``<|"|>`` delimiters (so they need no escapes), other values are
bare words (numbers, ``true``/``false``, ``null``), ``{...}`` and ``[...]`` nest, and calls follow
each other with nothing between. Values are read as vLLM reads them, forgivingly: an unterminated
string runs to the end, a word that is not a number or keyword stays a string.

Each complete ``<|tool_call>call:NAME{...}<tool_call|>`` is a call. The text outside them (before
the first, between, after the last, and an unfinished call at the end) is content, kept as written
so that it equals what was streamed; vLLM's streaming sends that same text.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, ToolParser, held_back

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
STRING_DELIM = '<|"|>'
_CALL = re.compile(r"<\|tool_call>call:([\w\-.]+)\{(.*?)\}<tool_call\|>", re.DOTALL)
_SEPARATORS = " ,\n\t"
_SPACE = " \n\t"


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _scalar(word: str) -> Any:
    """A bare word's value: true/false, null (or none/nil), a number, else the word itself."""
    word = word.strip()
    if word in ("true", "false"):
        return word == "true"
    if word.lower() in ("null", "none", "nil"):
        return None
    try:
        # As vLLM: a dot makes a float, otherwise an integer ("1e5" stays a string).
        number = float(word) if "." in word else int(word)
    except ValueError:
        return word
    # 1.5e999 is inf, which JSON cannot carry: keep the word.
    return number if not isinstance(number, float) or math.isfinite(number) else word


def _closing(text: str, i: int, open_ch: str, close_ch: str) -> tuple[int, bool]:
    """Just past the bracket that closes the one at ``text[i]`` (delimited strings skipped, so a
    bracket inside one does not count); (len(text), False) when it never closes."""
    depth = 0
    while i < len(text):
        if text.startswith(STRING_DELIM, i):
            end = text.find(STRING_DELIM, i + len(STRING_DELIM))
            if end < 0:
                return len(text), False
            i = end + len(STRING_DELIM)
            continue
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1, True
        i += 1
    return len(text), False


def _value(text: str, i: int, stops: str) -> Optional[tuple[Any, int]]:
    """The value that starts at ``text[i]`` and where it ends; None when there is none (a stray
    closing bracket), which ends the enclosing object or list."""
    if text.startswith(STRING_DELIM, i):
        begin = i + len(STRING_DELIM)
        end = text.find(STRING_DELIM, begin)
        return (text[begin:], len(text)) if end < 0 else (text[begin:end], end + len(STRING_DELIM))
    for open_ch, close_ch, parse in (("{", "}", parse_gemma4_args), ("[", "]", parse_gemma4_array)):
        if text[i] == open_ch:
            end, closed = _closing(text, i, open_ch, close_ch)
            return parse(text[i + 1 : end - 1 if closed else end]), end
    end = i
    while end < len(text) and text[end] not in stops:
        end += 1
    return None if end == i else (_scalar(text[i:end]), end)


def parse_gemma4_args(text: str) -> dict[str, Any]:
    """The inside of ``{...}``: ``key:value`` pairs separated by commas, as a dict."""
    out: dict[str, Any] = {}
    i = 0
    while True:
        i = _skip(text, i, _SEPARATORS)
        colon = text.find(":", i)
        if i >= len(text) or colon < 0:
            return out
        key = text[i:colon].strip()
        if len(key) >= 2 * len(STRING_DELIM) and key.startswith(STRING_DELIM) and key.endswith(STRING_DELIM):
            key = key[len(STRING_DELIM) : -len(STRING_DELIM)]
        i = _skip(text, colon + 1, _SPACE)
        if i >= len(text):
            out[key] = ""
            return out
        got = _value(text, i, ",}]")
        if got is None:
            return out
        out[key], i = got


def parse_gemma4_array(text: str) -> list[Any]:
    """The inside of ``[...]``: values separated by commas, as a list."""
    items: list[Any] = []
    i = 0
    while True:
        i = _skip(text, i, _SEPARATORS)
        if i >= len(text):
            return items
        got = _value(text, i, ",]")
        if got is None:
            return items
        value, i = got
        items.append(value)


def _to_call(match: re.Match[str]) -> ParsedToolCall:
    return ParsedToolCall(match.group(1), json.dumps(parse_gemma4_args(match.group(2)), ensure_ascii=False))


class Gemma4ToolParser(ToolParser):
    markers = (TOOL_CALL_START, TOOL_CALL_END)
    name = "gemma4"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        matches = list(_CALL.finditer(text))
        if not matches:
            return ParsedMessage(text, [])
        content, last = "", 0
        for match in matches:
            content += text[last : match.start()]
            last = match.end()
        content += text[last:]
        return ParsedMessage(content if content.strip() else None, [_to_call(m) for m in matches])

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return PartialParse(held_back(text, [TOOL_CALL_START]))
        # A call is complete once its end marker is there; the matches so far are the first of the
        # whole reply's, since a match ends at the first "}<tool_call|>" after its start.
        return PartialParse(start, [_to_call(m) for m in _CALL.finditer(text)])
