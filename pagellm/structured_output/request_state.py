"""One request's walk through its grammar: which tokens may come next, and the tokens taken."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class GrammarState:
    """A grammar matcher for one request, advanced with every token the request samples."""

    def __init__(self, req_id: str, matcher: Any) -> None:
        self.req_id = req_id
        self.matcher = matcher
        # Set when a token was refused: the request goes on unconstrained rather than failing mid-way.
        self.broken = False

    def accept(self, token_id: int) -> None:
        if self.broken or self.matcher.is_terminated():
            return  # past the end (ignore_eos): the stop tokens that follow need no checking
        if not self.matcher.accept_token(token_id):
            logger.warning("request %s: token %d refused by its grammar; no longer constrained", self.req_id, token_id)
            self.broken = True

    def replay(self, token_ids: list[int]) -> None:
        """Brings a fresh matcher to where a preempted request was (it recomputes its outputs)."""
        for token_id in token_ids:
            self.accept(token_id)

    def fill(self, bitmask: Any, row: int) -> bool:
        """Writes the allowed next tokens into ``bitmask[row]``; False when nothing is to be masked."""
        if self.broken or self.matcher.is_terminated():
            return False  # past the end (only with ignore_eos): the grammar has nothing more to say
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_along(self, bitmask: Any, first_row: int, draft_token_ids: list[int]) -> list[int]:
        """Fills rows ``first_row + j`` with the tokens allowed after the first j drafts, up to the
        first draft the grammar refuses (no later row can be reached); the matcher ends where it
        began. Returns the rows filled."""
        rows: list[int] = []
        num_accepted = 0
        for j in range(len(draft_token_ids) + 1):
            if self.broken or self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, first_row + j)
            rows.append(first_row + j)
            if j == len(draft_token_ids) or not self.matcher.accept_token(draft_token_ids[j]):
                break
            num_accepted += 1
        if num_accepted:
            self.matcher.rollback(num_accepted)
        return rows

    def valid_prefix(self, draft_token_ids: list[int]) -> list[int]:
        """The drafts up to the first one the grammar refuses; the matcher ends where it began."""
        if self.broken:
            return draft_token_ids
        num_accepted = 0
        for token_id in draft_token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num_accepted += 1
        if num_accepted:
            self.matcher.rollback(num_accepted)
        return draft_token_ids[:num_accepted]

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
