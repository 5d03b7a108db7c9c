"""``granite4``: Granite 4.0 and 4.0-H replies, as vLLM's parser of that name::

    Let me look that up. <tool_call> {"name": "get_weather", "arguments": {"city": "Tokyo"}} </tool_call>

Any number of ``<tool_call> {json} </tool_call>`` blocks, with text before, between and after them.
Each block holds one ``{"name": ..., "arguments": ...}`` object; Granite models often write the
arguments as a JSON string of the object, which is read as that object. The text outside the
blocks, joined as written, is the content.

As in vLLM, one bad block makes the whole reply content with no calls: a start marker inside a
block, an end marker with no block open, an empty or unclosed block, a block that is not such an
object. Stricter than vLLM, so that every call's arguments are a JSON object: arguments that are
not an object (nor a string holding one), a name that is not a string, and numbers JSON cannot
carry (NaN, 1e999) count as bad too.

Streaming (the base class): text before the first block goes out as it comes, each call once its
end marker is in, and the text after the first block when the reply ends, since a later bad block
would turn the whole reply into content. Calls already sent by then stay sent (as in vLLM, which
streams each call when its block closes), and the rest of the reply follows as content.
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, ToolParser, held_back
from pagellm.entrypoints.openai.tool_parsers.granite import _DECODER, _granite_call

TC_START, TC_END = "<tool_call>", "</tool_call>"
_MARKER = re.compile(f"({re.escape(TC_START)})|{re.escape(TC_END)}")


def _block_call(block: str) -> Optional[ParsedToolCall]:
    """The call one block's text holds (whitespace around the JSON allowed); None when it is none."""
    try:
        obj = _DECODER.decode(block)
    except (ValueError, RecursionError):
        return None
    return _granite_call(obj)


def _scan(text: str, start: int = 0) -> tuple[list[str], list[str], bool]:
    """From ``start``: the text outside blocks (pieces), the insides of the complete blocks before
    anything out of place, and whether all of it is well formed (an open block at the end is not)."""
    outside: list[str] = []
    blocks: list[str] = []
    last = start
    open_at = -1  # where the open block's inside begins
    for match in _MARKER.finditer(text, start):
        if match.group(1):  # a start marker
            if open_at >= 0:
                return outside, blocks, False
            outside.append(text[last : match.start()])
            open_at = match.end()
        else:
            if open_at < 0 or open_at == match.start():
                return outside, blocks, False
            blocks.append(text[open_at : match.start()])
            open_at = -1
            last = match.end()
    if open_at >= 0:
        return outside, blocks, False
    outside.append(text[last:])
    return outside, blocks, True


class Granite4ToolParser(ToolParser):
    markers = (TC_START, TC_END)
    name = "granite4"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        outside, blocks, ok = _scan(text)
        if not ok or not blocks:
            return ParsedMessage(text, [])
        calls = [_block_call(block) for block in blocks]
        if any(c is None for c in calls):
            return ParsedMessage(text, [])
        content = "".join(outside)
        # Kept as written (not stripped), so that it equals the streamed content.
        return ParsedMessage(content if content.strip() else None, calls)  # type: ignore[arg-type]

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        first = text.find(TC_START)
        end = held_back(text, [TC_START]) if first < 0 else first
        # Only space so far is held back: a reply of calls alone has no content.
        content_end = end if text[:end].strip() else 0
        if first < 0:
            return PartialParse(content_end)
        if TC_END in text[:first]:
            return PartialParse(len(text))  # an end marker with no block open: all content, surely
        _, blocks, _ = _scan(text, first)
        calls: list[ParsedToolCall] = []
        for block in blocks:
            call = _block_call(block)
            if call is None:
                break  # a bad block: the end of the reply decides (it will be all content)
            calls.append(call)
        return PartialParse(content_end, calls)
