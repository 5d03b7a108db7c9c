"""``pythonic``: a reply that is one Python list of calls, ``[get_weather(city='Paris'), get_time()]``
(Llama 3.2 and 4, ToolACE), as vLLM's parser of that name.

The whole reply must be the list: it must begin with ``[`` and hold nothing but calls of a plain
name with keyword arguments whose values are literals (strings, numbers, booleans, None, and lists
and dicts of them). Python's ``ast`` reads it, so quoting and escapes are Python's. Anything else,
one bad call included, leaves the whole reply as content.
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, ToolParser

_CLOSE_TO_OPEN = {")": "(", "]": "[", "}": "{"}
# How a call list can begin: "[", then a name, then "(" (each possibly not written yet).
_HEAD = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*(?:\(|$)|$)")


class _NotACall(ValueError):
    pass


def _literal(node: ast.expr) -> Any:
    """A JSON value from an argument's syntax tree; _NotACall for anything but literals."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, int, str)):
            return value
        # inf and nan (1e999) would serialize as Infinity/NaN, which is not JSON.
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotACall(f"unsupported literal {value!r}")
    # A negative number is a unary minus on a constant in the tree.
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand
        if isinstance(operand, ast.Constant) and isinstance(operand.value, (int, float)) and not isinstance(operand.value, bool):
            value = -operand.value if isinstance(node.op, ast.USub) else operand.value
            if math.isfinite(value):
                return value
        raise _NotACall("unsupported unary expression")
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            # A None key is ``**mapping``; other keys must be literals JSON can name.
            if not isinstance(key, ast.Constant) or not isinstance(key.value, (str, int, float, bool, type(None))):
                raise _NotACall("dict keys must be literals")
            out[key.value] = _literal(value)
        return out
    raise _NotACall(f"unsupported argument {type(node).__name__}")


def _call(node: ast.expr) -> ParsedToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise _NotACall("not a call of a plain name")
    if node.args or any(kw.arg is None for kw in node.keywords):
        raise _NotACall("only keyword arguments")
    args = {kw.arg: _literal(kw.value) for kw in node.keywords}
    return ParsedToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


def _parse(source: str) -> ast.expr:
    try:
        return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError) as e:  # ValueError: null bytes
        raise _NotACall(str(e)) from None


def parse_call_list(text: str) -> Optional[list[ParsedToolCall]]:
    """The calls of a whole ``[f(a=1), ...]`` text; None when it is not such a list (or is empty)."""
    if not text.startswith("["):
        return None
    try:
        tree = _parse(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        return [_call(e) for e in tree.elts]
    except _NotACall:
        return None


def _elements(text: str) -> tuple[list[str], int, bool]:
    """The top-level elements of the list that ``text`` opens, as far as they are complete:
    (elements, index just past the closing "]" or -1 while open, brackets mismatched). Strings are
    skipped, so a ``')'`` in a value counts for nothing."""
    stack: list[str] = []
    quote = ""
    start, i, found = 1, 0, []
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or stack.pop() != _CLOSE_TO_OPEN[ch]:
                return found, -1, True
            if not stack:
                found.append(text[start:i])
                return found, i + 1, False
        elif ch == "," and len(stack) == 1:
            found.append(text[start:i])
            start = i + 1
        i += 1
    return found, -1, False


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        calls = parse_call_list(text)
        if calls is None:
            return ParsedMessage(text, [])
        return ParsedMessage(None, calls)

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        if not text:
            return PartialParse(0)
        # As vLLM: only a reply that begins with "[" can be calls; anything else is content.
        if not _HEAD.match(text):
            return PartialParse(len(text))
        elements, end, mismatched = _elements(text)
        calls: list[ParsedToolCall] = []
        for k, element in enumerate(elements):
            source = element.strip()
            last = end >= 0 and k == len(elements) - 1
            if last and not source and k > 0:
                break  # a trailing comma before "]"
            try:
                call = _call(_parse(source))
            except _NotACall:
                # A complete element that is not a call makes the whole reply content: send it now,
                # unless calls already went out (then the end of the reply decides).
                return PartialParse(0 if calls else len(text), calls)
            # The call before "]" waits for the end of the reply, which must add nothing but space:
            # text after the list makes it all content, and its calls must not have gone out.
            if not last:
                calls.append(call)
        if (mismatched or (end >= 0 and text[end:].strip())) and not calls:
            return PartialParse(len(text))
        return PartialParse(0, calls)
