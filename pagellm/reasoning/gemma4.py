"""``gemma4``: Gemma 4's thinking channel, ``<|channel>thought\\n...<channel|>``, as vLLM's parser of
that name.

The reply is content until ``<|channel>`` opens reasoning (text before it stays content); the
``thought\\n`` label the model writes first is dropped; a ``<channel|>`` with no channel open is
dropped. The markers are special tokens: decode the reply with special tokens kept.
"""

from __future__ import annotations

from pagellm.reasoning.base import ReasoningBoundaryStrings
from pagellm.reasoning.tags import TagReasoningParser, TagSyntax

CHANNEL, END_CHANNEL = "<|channel>", "<channel|>"


class Gemma4ReasoningParser(TagReasoningParser):
    name = "gemma4"
    keep_special_tokens = True
    syntax = TagSyntax(
        starts=(CHANNEL,),
        ends=(END_CHANNEL,),
        start_anywhere=True,
        drop_stray_ends=True,
        reasoning_label="thought\n",
        empty_reasoning_is_none=True,
    )
    reasoning_first = False
    boundary = ReasoningBoundaryStrings(CHANNEL, END_CHANNEL, END_CHANNEL)
