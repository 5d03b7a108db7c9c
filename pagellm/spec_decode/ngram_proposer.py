"""N-gram prompt lookup: drafts copied from what followed the sequence's last n tokens before.

Outputs that quote, summarise or edit their prompt repeat its spans; when the last n tokens
(n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) occurred earlier in the request,
the k tokens that followed that occurrence are proposed. The most recent occurrence wins (it is
the likeliest to continue the same way), and the longest n is tried first.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pagellm.speculative_config import SpeculativeConfig
from pagellm.worker.input_batch import InputBatch


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    @classmethod
    def from_config(cls, config: Optional[SpeculativeConfig]) -> Optional["NgramProposer"]:
        """The proposer an n-gram config asks for; None for any other (or no) speculation."""
        if config is None or config.method != "ngram":
            return None
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, token_ids: np.ndarray, num_draft_tokens: int) -> list[int]:
        """Up to ``num_draft_tokens`` drafts to follow ``token_ids`` (a 1-D array), or none."""
        num_tokens = len(token_ids)
        if num_draft_tokens <= 0 or num_tokens < self.prompt_lookup_min + 1:
            return []
        # Earlier occurrences of the last token end every candidate match: usually a few, so
        # each longer n-gram is checked on those alone (one pass over the sequence in all).
        ends = np.flatnonzero(token_ids[: num_tokens - 1] == token_ids[num_tokens - 1])
        for n in range(min(self.prompt_lookup_max, num_tokens - 1), self.prompt_lookup_min - 1, -1):
            hits = ends[ends >= n - 1]
            for j in range(1, n):
                if not hits.size:
                    break
                hits = hits[token_ids[hits - j] == token_ids[num_tokens - 1 - j]]
            if hits.size:
                start = int(hits[-1]) + 1
                return token_ids[start : start + num_draft_tokens].tolist()
        return []

    def propose_batch(self, batch: InputBatch, requests: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        """Drafts for ``(req_id, row, k)`` requests, read from the runner's batch rows."""
        drafts: dict[str, list[int]] = {}
        for req_id, row, k in requests:
            proposal = self.propose(batch.token_ids[row, : int(batch.num_tokens[row])], k)
            if proposal:
                drafts[req_id] = proposal
        return drafts
