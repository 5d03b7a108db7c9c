"""The Responses API's input and tools read into the chat path's messages, tools and tool_choice.

Input items are checked one by one, so that a 400 names the item and what about it pagellm cannot
serve (images, files, built-in tools' items, item references); each becomes the chat message the
same turn would be on ``/v1/chat/completions``.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatMessage, ChatTool, FunctionDefinition, NamedFunction, NamedToolChoice
from pagellm.entrypoints.openai.protocol_responses import FunctionTool

INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_MEDIA_PARTS = {"input_image": "images", "input_file": "files", "input_audio": "audio"}


def _bad_input(index: int, message: str) -> APIError:
    return APIError(f"input[{index}]: {message}", param="input")


def _text_of(index: int, content: Any) -> str:
    """A message's content as one string: text parts joined, as the chat path joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad_input(index, "content must be a string or a list of input_text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise _bad_input(index, f"{_MEDIA_PARTS[kind]} ({kind} parts) are not supported; only text is")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad_input(index, f"content parts must be input_text or output_text with a string text, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string_field(index: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad_input(index, f"a {item.get('type')} item needs a string {name!r}")
    return value


def normalize_input(value: Union[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The request's input as checked items (a string is one user message), ready to store and replay."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise _bad_input(i, f"role must be one of {', '.join(INPUT_ROLES)}, got {role!r}")
            items.append({"type": "message", "role": role, "content": _text_of(i, item.get("content"))})
        elif kind == "function_call":
            fields = {name: _string_field(i, item, name) for name in ("call_id", "name", "arguments")}
            items.append({"type": "function_call", **fields})
        elif kind == "function_call_output":
            call_id = _string_field(i, item, "call_id")
            items.append({"type": "function_call_output", "call_id": call_id, "output": _text_of(i, item.get("output"))})
        elif kind == "reasoning":
            continue  # earlier thinking: chat templates drop it from the history, as OpenAI does
        else:
            raise _bad_input(
                i, f"items of type {kind!r} are not supported (message, function_call, function_call_output and reasoning are)"
            )
    if not items:
        raise APIError("input must not be empty", param="input")
    return items


def items_to_messages(items: list[dict[str, Any]], instructions: Optional[str]) -> list[ChatMessage]:
    """Checked items as chat messages: a run of function calls joins the assistant turn before it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return [ChatMessage(**m) for m in messages]


def function_tools(tools: Optional[list[dict[str, Any]]]) -> list[FunctionTool]:
    """The request's tools; anything but a function tool (web_search, file_search, mcp, ...) is a 400."""
    out = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(f"tools[{i}]: built-in tools such as {kind!r} are not supported; only function tools are", param="tools")
        try:
            out.append(FunctionTool(**tool))
        except ValueError as e:
            raise APIError(f"tools[{i}]: {e}", param="tools") from None
    return out


def chat_tools(tools: list[FunctionTool]) -> Optional[list[ChatTool]]:
    if not tools:
        return None
    return [ChatTool(function=FunctionDefinition(**t.model_dump(exclude={"type"}))) for t in tools]


def chat_tool_choice(choice: Union[str, dict[str, Any], None]) -> Union[str, NamedToolChoice, None]:
    """``{"type": "function", "name": ...}`` becomes the chat path's named choice; other kinds are a 400."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise APIError(f"tool_choice must be none, auto, required or a function, got {choice!r}", param="tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise APIError(f"tool_choice of type {choice.get('type')!r} is not supported; only function choices are", param="tool_choice")
    return NamedToolChoice(function=NamedFunction(name=choice["name"]))
