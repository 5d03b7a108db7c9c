"""``mistral``: Mistral's ``[TOOL_CALLS]`` tool calls, as vLLM's parser of that name reads them.

Two layouts, told apart by what follows each ``[TOOL_CALLS]``:

- older tokenizers (before v11): a JSON array, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
- v11 and newer: one call per token, ``[TOOL_CALLS]NAME{json}``, ``[TOOL_CALLS]NAME[ARGS]{json}`` or
  ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}``.

Text before the first ``[TOOL_CALLS]`` is content. Call ids are 9 alphanumeric characters, the only kind
Mistral's chat templates accept back (the model's own ``[CALL_ID]`` when it wrote a valid one). Unlike vLLM,
arguments that are not a JSON object make the reply content rather than a call with broken arguments.
"""
from __future__ import annotations

import json
import random
import re
import string
from typing import Optional

from pagellm.entrypoints.openai.tool_parsers.base import BAD, PENDING, CallScan, ParsedToolCall, ScanningToolParser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import arguments_json, json_value_end

_ALPHANUMERIC = string.ascii_letters + string.digits
_NAME = re.compile(r"[^\s{}\[\]\"]+")


def mistral_call_id() -> str:
    return "".join(random.choices(_ALPHANUMERIC, k=9))


def is_mistral_call_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()


class MistralToolParser(ScanningToolParser):
    name = "mistral"
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    markers = (BOT, ARGS, CALL_ID)
    starts = (BOT,)

    @staticmethod
    def _array_calls(seg: str, start: int, scan: CallScan) -> None:
        """The calls of a JSON array opening at ``seg[start]``, read item by item so that each can be sent once
        complete; whatever follows the array is ignored, as vLLM's fallback does."""
        pos = start + 1
        while True:
            while pos < len(seg) and seg[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(seg):
                scan.state = PENDING
                return
            if seg[pos] == "]":
                return
            if seg[pos] != "{":
                scan.state = BAD
                return
            end = json_value_end(seg, pos)
            if end is None:
                scan.state = PENDING
                return
            try:
                item = json.loads(seg[pos:end])
            except ValueError:
                item = None
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                scan.state = BAD
                return
            args = arguments_json(item.get("arguments"))
            if args is None:
                scan.state = BAD
                return
            scan.calls.append(ParsedToolCall(item["name"], args, mistral_call_id()))
            pos = end

    @classmethod
    def _named_call(cls, seg: str, scan: CallScan) -> None:
        """``NAME[CALL_ID]ID[ARGS]{json}`` (the bracketed parts optional); text after the object is ignored."""
        brace = seg.find("{")
        if brace < 0:
            scan.state = PENDING  # the name is still being written
            return
        head = seg[:brace].replace(cls.ARGS, "")
        name, _, call_id = head.partition(cls.CALL_ID)
        name, call_id = name.strip(), call_id.strip()
        end = json_value_end(seg, brace)
        if not _NAME.fullmatch(name):
            scan.state = BAD
            return
        if end is None:
            scan.state = PENDING
            return
        try:
            args = arguments_json(json.loads(seg[brace:end]))
        except ValueError:
            args = None
        if args is None:
            scan.state = BAD
            return
        scan.calls.append(ParsedToolCall(name, args, call_id if is_mistral_call_id(call_id) else mistral_call_id()))

    def _scan(self, text: str, final: bool) -> Optional[CallScan]:
        first = text.find(self.BOT)
        if first < 0:
            return None
        scan = CallScan(first)
        segments = text[first + len(self.BOT) :].split(self.BOT)
        for i, seg in enumerate(segments):
            last = i == len(segments) - 1
            if not seg.strip():
                continue  # nothing after this [TOOL_CALLS] (yet); vLLM skips an empty one
            body = seg.lstrip()
            if body.startswith("["):
                self._array_calls(body, 0, scan)
            else:
                self._named_call(seg, scan)
            if scan.state == BAD:
                return scan
            if scan.state == PENDING and not last:
                scan.state = BAD  # the next [TOOL_CALLS] came before this call was whole
                return scan
        return scan
