"""``llama3_json``: Llama 3.x / 4 JSON tool calls, as vLLM's parser of that name reads them.

The reply is an optional ``<|python_tag|>`` and then JSON objects ``{"name": ..., "parameters"|"arguments": {...}}``,
several of them usually separated by ``;``. Text before the first object (or the tag) is content; text between and
after the objects is dropped, as vLLM drops it. Every ``{`` outside a call must start a call: one that does not (a
brace in prose, a JSON object without a name) makes the whole reply content, as in vLLM.

This module also owns ``json_value_end``, the bracket matcher the mistral parser shares.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from pagellm.entrypoints.openai.tool_parsers.base import BAD, PENDING, CallScan, ParsedToolCall, ScanningToolParser

# A JSON string (its closing quote captured, absent while it is still open) or one bracket. Strings are matched
# whole by the regex engine, so a long argument costs one match per delta rather than a Python step per character.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?P<close>")?|[{}\[\]]', re.DOTALL)


def json_value_end(text: str, start: int) -> Optional[int]:
    """The index just past the JSON object or array opening at ``text[start]`` (brackets matched outside strings),
    or None while it is still open. The slice may still be invalid JSON; callers decode it."""
    depth = 0
    for match in _JSON_TOKEN.finditer(text, start):
        token = match.group()
        if token[0] == '"':
            if match.group("close") is None:
                return None  # a string still open runs to the end of the text
        elif token in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def arguments_json(args: Any) -> Optional[str]:
    """A call's arguments as OpenAI's JSON text of an object; None when they are not an object (a string holding
    a JSON object is taken, as some templates make models write that)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or Infinity: not JSON a client can read
        return None


class Llama3JsonToolParser(ScanningToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = starts = (TAG,)

    @staticmethod
    def _call(block: str) -> Optional[ParsedToolCall]:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        # vLLM prefers "arguments" when both are there, and needs one of them.
        if "arguments" in obj:
            args = arguments_json(obj["arguments"])
        elif "parameters" in obj:
            args = arguments_json(obj["parameters"])
        else:
            return None
        return None if args is None else ParsedToolCall(obj["name"], args)

    def _scan(self, text: str, final: bool) -> Optional[CallScan]:
        """None when nothing in the text may start a call."""
        tag, brace = text.find(self.TAG), text.find("{")
        starts = [i for i in (tag, brace) if i >= 0]
        if not starts:
            return None
        scan = CallScan(min(starts))
        pos = brace
        while pos >= 0:
            end = json_value_end(text, pos)
            if end is None:
                scan.state = PENDING
                break
            call = self._call(text[pos:end])
            if call is None:
                scan.state = BAD
                break
            scan.calls.append(call)
            pos = text.find("{", end)
        return scan
