"""Where a request's reasoning ends, in token ids: the thinking budget and grammars that wait for the answer.

A reasoning model writes its thinking first, between a start and an end string (``<think>`` and
``</think>``, or gpt-oss's channels). The engine knows those strings only as token ids
(``ReasoningBounds``, resolved once from ``--reasoning-parser``). Per request, a
``ReasoningTracker`` follows the output: whether the reasoning has ended, how many tokens it took,
and, once ``thinking_token_budget`` is spent, which token must come next to close it (the end string
is forced into the output one token per step, so the model goes on to its answer). A grammar or
forced tool call constrains only what follows the end, as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class ReasoningBounds:
    """The reasoning section's markers as token ids: ``start_ids`` opens it (empty where the model
    has no opening marker), ``end_ids`` closes it, ``forced_end_ids`` is written when the budget
    runs out (it ends with ``end_ids``)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    forced_end_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.end_ids:
            raise ValueError("the reasoning end string encodes to no tokens")
        if not self.forced_end_ids:
            raise ValueError("the forced reasoning end string encodes to no tokens")


def _ends_with(token_ids: Sequence[int], tail: Sequence[int], end: int) -> bool:
    """Whether ``token_ids[:end]`` ends with ``tail``."""
    n = len(tail)
    return n <= end and tuple(token_ids[end - n : end]) == tuple(tail)


def reasoning_ended(bounds: ReasoningBounds, token_ids: Sequence[int]) -> bool:
    """Whether ``token_ids`` (a prompt) leave the model past its reasoning: the last marker in them
    is an end marker. With neither marker the model is taken to be about to reason (as vLLM does:
    a template that does not open the thinking lets the model open it)."""
    for i in range(len(token_ids), 0, -1):
        if _ends_with(token_ids, bounds.end_ids, i):
            return True
        if bounds.start_ids and _ends_with(token_ids, bounds.start_ids, i):
            return False
    return False


class ReasoningTracker:
    """One request's walk through its reasoning, fed every token it samples (and, when resumed
    after preemption, replayed with the tokens it had)."""

    def __init__(self, bounds: ReasoningBounds, prompt_token_ids: Sequence[int], budget: Optional[int]) -> None:
        self.bounds = bounds
        self.budget = budget
        self.ended = reasoning_ended(bounds, prompt_token_ids)
        self.num_reasoning_tokens = 0
        self._recent: list[int] = []  # the last few outputs, to spot a multi-token end marker
        self._forcing = 0  # tokens of forced_end_ids already written; > 0 while forcing

    def accept(self, token_id: int) -> bool:
        """Takes the next output token; True when it is the first token after the reasoning (the
        one a grammar sees first)."""
        if self.ended:
            return True
        self.num_reasoning_tokens += 1
        if self._forcing:
            self._forcing += 1
        self._recent.append(token_id)
        del self._recent[: -len(self.bounds.end_ids)]
        # A forced end that does not finish with the end marker's tokens (tokenized in context) ends it too.
        if _ends_with(self._recent, self.bounds.end_ids, len(self._recent)) or self._forcing > len(self.bounds.forced_end_ids):
            self.ended = True
            self._forcing = 0
        return False

    def forced_token(self) -> Optional[int]:
        """The token that must come next, when the budget is spent and the end is being written."""
        if self.ended or self.budget is None:
            return None
        if not self._forcing:
            if self.num_reasoning_tokens < self.budget:
                return None
            self._forcing = 1
        return self.bounds.forced_end_ids[self._forcing - 1]


def reasoning_bounds(tokenizer: Any, parser_name: Optional[str], reasoning_config: Optional[dict[str, Any]]) -> Optional[ReasoningBounds]:
    """The bounds ``--reasoning-parser`` (and ``--reasoning-config``) describe, in this tokenizer's ids."""
    if parser_name is None:
        return None
    from pagellm.reasoning import get_reasoning_parser

    strings = get_reasoning_parser(parser_name).boundary_strings(reasoning_config)

    def encode(text: Optional[str]) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ReasoningBounds(encode(strings.start), encode(strings.end), encode(strings.forced_end))
