"""``<think>...</think>`` parsers: ``qwen3``, ``deepseek_r1``, and ``string``, whose markers come from
``reasoning_config``, as vLLM's parsers of those semantics.

The reply begins inside reasoning: the template may have opened ``<think>`` in the prompt (Qwen 3.5,
DeepSeek-R1, Qwen3 thinking-2507), so a reply with no end marker is all reasoning (cut short), and a
``<think>`` the model writes itself at the beginning is dropped. With thinking turned off
(``enable_thinking: False``, or a prompt that already closed ``</think>``) the reply is content unless
it opens ``<think>`` itself.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from pagellm.reasoning.base import ReasoningBoundaryStrings, config_strings
from pagellm.reasoning.tags import TagReasoningParser, TagSyntax

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL = "<tool_call>"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")


def qwen_tool_call_end(text: str, final: bool) -> Optional[tuple[int, bool]]:
    """Qwen 3.5 may open ``<tool_call>`` before closing ``</think>``: a ``<tool_call>`` followed by
    ``<function=`` ends reasoning there. A bare mention of ``<tool_call>`` in the thinking does not;
    until the text after it tells, the position is held (decided=False)."""
    start = 0
    while (k := text.find(TOOL_CALL, start)) >= 0:
        after = text[k + len(TOOL_CALL) :].lstrip()
        if _FUNCTION_OPEN.match(after):
            return k, True
        if not final and (len(after) <= len("<function") and "<function".startswith(after)):
            return k, False
        start = k + 1
    return None


class DeepSeekR1ReasoningParser(TagReasoningParser):
    name = "deepseek_r1"
    syntax = TagSyntax(starts=(THINK,), ends=(END_THINK,))
    boundary = ReasoningBoundaryStrings(THINK, END_THINK, END_THINK)


class Qwen3ReasoningParser(TagReasoningParser):
    name = "qwen3"
    syntax = TagSyntax(starts=(THINK,), ends=(END_THINK,), implicit_end=qwen_tool_call_end, implicit_markers=(TOOL_CALL,))
    boundary = ReasoningBoundaryStrings(THINK, END_THINK, END_THINK)


class StringReasoningParser(TagReasoningParser):
    """Markers from ``reasoning_config`` (``reasoning_start_str``, ``reasoning_end_str``), with
    vLLM's base ``<think>`` semantics: the start marker is optional, a reply with no end is reasoning."""

    name = "string"

    def __init__(
        self,
        tokenizer: Any = None,
        prompt_token_ids: Sequence[int] = (),
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        reasoning_config: Optional[dict[str, Any]] = None,
    ) -> None:
        start, end = self._strings(reasoning_config)
        self.syntax = TagSyntax(starts=(start,), ends=(end,))
        super().__init__(tokenizer, prompt_token_ids, chat_template_kwargs, reasoning_config)

    @staticmethod
    def _strings(reasoning_config: Optional[dict[str, Any]]) -> tuple[str, str]:
        start, end = config_strings(reasoning_config)
        if not start or not end:
            raise ValueError(
                "the string reasoning parser needs reasoning_config with reasoning_start_str and reasoning_end_str, "
                'e.g. {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}'
            )
        return start, end

    @classmethod
    def boundary_strings(cls, reasoning_config: Optional[dict[str, Any]] = None) -> ReasoningBoundaryStrings:
        start, end = cls._strings(reasoning_config)
        return ReasoningBoundaryStrings(start, end, end)
