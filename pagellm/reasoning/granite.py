"""``granite``: IBM Granite's phrases, "Here is my thought process:" then "Here is my response:"
(also with "Here's", which quantized models write), as vLLM's parser of that name.

The phrases are plain text, not special tokens, so a reply that does not begin with the thought
phrase is content, and a tail that may begin a phrase is held back while streaming.
"""

from __future__ import annotations

from pagellm.reasoning.base import ReasoningBoundaryStrings
from pagellm.reasoning.tags import TagReasoningParser, TagSyntax

THOUGHT = ("Here is my thought process:", "Here's my thought process:")
RESPONSE = ("Here is my response:", "Here's my response:")


class GraniteReasoningParser(TagReasoningParser):
    name = "granite"
    syntax = TagSyntax(starts=THOUGHT, ends=RESPONSE)
    reasoning_first = False
    boundary = ReasoningBoundaryStrings(THOUGHT[0], RESPONSE[0], RESPONSE[0])
