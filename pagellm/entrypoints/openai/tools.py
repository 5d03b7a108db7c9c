"""Tools on /v1/chat/completions: tool_choice resolution, the tools prompt, and forced-call grammars.

``auto`` lets the model write its own tool-call format, read back by the tool-call parser.
``required`` and a named function are forced with a JSON schema, as vLLM does: an array of
``{"name", "parameters"}`` objects, or the named function's arguments themselves, so that the
reply always parses.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ChatTool
from pagellm.entrypoints.openai.tool_parsers import ParsedToolCall
from pagellm.sampling_params import StructuredOutputsParams

# Hermes' tool prompt, for chat templates that ignore ``tools`` (SmolLM2's among them).
_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def resolve_tool_choice(request: ChatCompletionRequest, auto_enabled: bool) -> str:
    """"none", "auto", "required" or "named"; 400 for choices the server or the tools cannot honour."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return "none"
    if choice is None:
        return "auto" if auto_enabled else "none"
    if choice == "auto" and not auto_enabled:
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', param="tool_choice")
    if isinstance(choice, str):
        return choice
    if choice.function.name not in {t.function.name for t in request.tools}:
        raise APIError(f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice")
    return "named"


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_constraint(request: ChatCompletionRequest, mode: str) -> Optional[StructuredOutputsParams]:
    if mode == "named":
        tool = next(t for t in request.tools or [] if t.function.name == request.tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if mode == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": _parameters(t)},
                "required": ["name", "parameters"],
            }
            for t in request.tools or []
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def forced_tool_calls(request: ChatCompletionRequest, mode: str, text: str) -> Optional[list[ParsedToolCall]]:
    """The calls a forced reply spells; None when it does not parse (cut short by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if mode == "named":
        return [ParsedToolCall(request.tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    return [ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


def add_tools_to_messages(messages: list[dict[str, Any]], request: ChatCompletionRequest, template: Optional[str]) -> list[dict[str, Any]]:
    """Messages with the tools described (when the template does not do it) and past calls as text."""
    if template is not None and "tools" in template:
        return messages
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                calls.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>")
            m["content"] = "\n".join(filter(None, [m.get("content") or ""] + calls))
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
        out.append(m)
    if request.tools:
        tools = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in request.tools)
        prompt = _TOOLS_PROMPT.format(tools=tools)
        if out and out[0].get("role") == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}"
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
