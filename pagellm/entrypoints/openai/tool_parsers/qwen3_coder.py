"""``qwen3_coder``: Qwen3-Coder's (and Qwen3.5's) XML tool calls, as vLLM's parser of that name reads them.

A call is ``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``. Values are
text; each is typed by the request's JSON schema for that tool (integers, numbers, booleans, objects and
arrays as JSON or Python literals, ``null``), and left a string where the schema does not say or the
value does not fit. Like vLLM it forgives a missing ``<tool_call>``, ``</parameter>`` or (at the end of
the reply) ``</function>``. Text before the first call is content; text between and after calls is not.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Optional

from pagellm.entrypoints.openai.tool_parsers.base import BAD, PENDING, CallScan, ParsedToolCall, ScanningToolParser

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_CONTAINER_TYPES = ("object", "array", "arr")


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _schema_type(prop: Any) -> str:
    if not isinstance(prop, dict) or "type" not in prop:
        return "string"
    kind = prop["type"]
    if isinstance(kind, list):  # ["integer", "null"]: the value's type is the one that is not null
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def convert_value(value: str, prop: Any, known: bool) -> Any:
    """A parameter's text typed by its schema ``prop``; ``known`` says whether the schema names the parameter.
    Follows vLLM: ``null`` is None for any type, a value that does not fit its type stays a string (a boolean
    that is not true/false is false)."""
    if value.lower() == "null":
        return None
    if not known:
        return value
    kind = _schema_type(prop)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in _CONTAINER_TYPES or kind.startswith(("dict", "list")):
        try:
            loaded = json.loads(value)
        except ValueError:
            pass
        else:
            if _json_safe(loaded):
                return loaded
    # Other types, and containers written as Python literals ({'k': 'v'}, True, None).
    try:
        literal = ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value
    return literal if _json_safe(literal) else value



class Qwen3CoderToolParser(ScanningToolParser):
    name = "qwen3_coder"
    starts = ("<tool_call>", "<function=")
    markers = ("<tool_call>", "</tool_call>")
    # A function's body ends at </function>, at </tool_call> when the model left </function> out, or at
    # the end of the reply; a parameter's value at its close tag or where the next tag of the call begins.
    _FUNCTION_ENDS = ("</function>", "</tool_call>")
    _PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)

    def _properties(self, name: str) -> Optional[dict[str, Any]]:
        schema = self.tool_schema(name)
        if not isinstance(schema, dict):
            return None
        props = schema.get("properties", schema)
        return props if isinstance(props, dict) else None

    def _call(self, body: str) -> Optional[ParsedToolCall]:
        name, sep, params = body.partition(">")
        name = name.strip()
        if not sep or not name:
            return None
        props = self._properties(name) or {}
        args: dict[str, Any] = {}
        for match in self._PARAMETER.finditer(params):
            pname, sep, value = match.group(1).partition(">")
            if not sep:
                return None
            # One newline after the open tag and one before the close tag are layout, not value.
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[pname] = convert_value(value, props.get(pname), pname in props)
        return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))

    def _scan(self, text: str, final: bool) -> Optional[CallScan]:
        """The calls of the text; ``final`` when it is the whole reply, the only time the open last call is read."""
        starts = [i for i in (text.find(m) for m in self.starts) if i >= 0]
        if not starts:
            return None
        scan = CallScan(min(starts))
        pos = scan.content_end
        # str.find rather than a lazy regex: the base rescans the reply on every delta, and a long open
        # argument would otherwise cost a regex step per character each time.
        while (begin := text.find("<function=", pos)) >= 0:
            begin += len("<function=")
            ends = [(at, len(tag)) for tag in self._FUNCTION_ENDS if (at := text.find(tag, begin)) >= 0]
            if not ends:  # still open: the end of the text so far
                scan.state, scan.tail = PENDING, self._call(text[begin:]) if final else None
                break
            end, tag_len = min(ends)
            call = self._call(text[begin:end])
            if call is None:
                scan.state = BAD  # closed, and its name or a parameter tag is malformed for good
                break
            scan.calls.append(call)
            pos = end + tag_len
        return scan
