"""Reasoning parsers: a reply's thinking split from its answer, whole or streamed (``--reasoning-parser NAME``).

Names and semantics are vLLM's: ``qwen3``, ``deepseek_r1``, ``granite``, ``gemma4``, ``openai_gptoss``
(gpt-oss's harmony channels; also ``gpt_oss``), and ``string``, whose markers come from
``--reasoning-config``. Each lives in its own module, imported when chosen. This package imports
only the standard library and ``openai_harmony``: the engine and the serving layer both use it.
"""

from __future__ import annotations

import importlib

from pagellm.reasoning.base import ReasoningBoundaryStrings, ReasoningDelta, ReasoningParser

# name -> (module, class)
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("think", "Qwen3ReasoningParser"),
    "deepseek_r1": ("think", "DeepSeekR1ReasoningParser"),
    "granite": ("granite", "GraniteReasoningParser"),
    "gemma4": ("gemma4", "Gemma4ReasoningParser"),
    "openai_gptoss": ("gpt_oss", "GptOssReasoningParser"),
    "gpt_oss": ("gpt_oss", "GptOssReasoningParser"),
    "string": ("think", "StringReasoningParser"),
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        module, cls = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(REASONING_PARSERS)}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


__all__ = ["REASONING_PARSERS", "ReasoningBoundaryStrings", "ReasoningDelta", "ReasoningParser", "get_reasoning_parser"]
