"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5
and 3, and what small chat models are prompted to write), as vLLM's parser of that name."""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, ToolParser, held_back


def json_call(block: str) -> Optional[ParsedToolCall]:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call; None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        if self.START not in text:
            return ParsedMessage(text, [])
        calls = [json_call(m.group(1)) for m in self._BLOCK.finditer(text)]
        if not calls or any(c is None for c in calls):
            return ParsedMessage(text, [])
        # Kept as written (not stripped), so that it equals the streamed content.
        content = text[: text.index(self.START)]
        return ParsedMessage(content if content.strip() else None, calls)  # type: ignore[arg-type]

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        start = text.find(self.START)
        if start < 0:
            return PartialParse(held_back(text, [self.START]))
        calls = []
        for match in self._BLOCK.finditer(text, start):
            call = json_call(match.group(1)) if match.group(0).endswith(self.END) else None
            if call is None:
                break
            calls.append(call)
        return PartialParse(start, calls)
