"""Tool-call parsers: a model family's own tool-call text -> OpenAI ``tool_calls``, whole or streamed.

``--tool-call-parser NAME`` picks one, with vLLM's names. Each lives in its own module, imported
when chosen.
"""
from __future__ import annotations

import importlib

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, StreamDelta, ToolParser
from pagellm.entrypoints.openai.tool_parsers.hermes import HermesToolParser

# name -> (module, class); vLLM's names.
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes", "HermesToolParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
    "granite": ("granite", "GraniteToolParser"),
    "granite4": ("granite4", "Granite4ToolParser"),
    "gemma4": ("gemma4", "Gemma4ToolParser"),
    "openai": ("openai", "OpenAIToolParser"),
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        module, cls = TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(TOOL_PARSERS)}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = [
    "HermesToolParser",
    "ParsedMessage",
    "ParsedToolCall",
    "PartialParse",
    "StreamDelta",
    "ToolParser",
    "TOOL_PARSERS",
    "get_tool_parser",
]
