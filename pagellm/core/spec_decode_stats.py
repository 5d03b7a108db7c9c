"""Speculative decoding counters, named as vLLM's ``spec_decode_*`` metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Cumulative over the engine's life; readers take differences."""

    num_spec_tokens: int  # k: drafts a verification checks at most
    num_drafts: int = 0  # verifications (a request's drafts checked in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # How often the draft at position i (0-based) was accepted; position i needs 0..i-1 accepted too.
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: the accepted drafts plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def since(self, earlier: "SpecDecodingStats") -> "SpecDecodingStats":
        return self._combine(earlier, -1)

    def plus(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        return self._combine(other, 1)

    def _combine(self, other: "SpecDecodingStats", sign: int) -> "SpecDecodingStats":
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            [a + sign * b for a, b in zip(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos)],
        )

    def to_dict(self) -> dict:
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }
