"""Grammar state of every constrained request in the runner's batch, and the per-step logits mask.

Each step, every constrained row's matcher writes its allowed tokens into one shared bitmask
(a C++ call per request, no Python over the vocabulary) and one batched call masks the logits.
The backend is created on first use so that servers never asked for structured output do not
pay for it.
"""
from __future__ import annotations

from typing import Any, Optional

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend import XgrammarBackend
from pagellm.structured_output.request_state import GrammarState


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = set(stop_token_ids)
        self._backend: Optional[XgrammarBackend] = None
        self.states: dict[str, GrammarState] = {}
        self._bitmask: Any = None

    @property
    def backend(self) -> XgrammarBackend:
        if self._backend is None:
            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._backend

    def validate(self, spec: StructuredOutputsParams) -> None:
        """Compiles (and caches) the grammar now, so that a bad one is refused before admission."""
        self.backend.compile(spec)

    # -- runner side ------------------------------------------------------------------------------

    def add_request(self, req_id: str, spec: StructuredOutputsParams, output_token_ids: list[int]) -> None:
        state = GrammarState(req_id, self.backend.matcher(self.backend.compile(spec)))
        state.replay(output_token_ids)
        self.states[req_id] = state

    def remove_request(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def accept(self, req_id: str, token_id: int) -> None:
        state = self.states.get(req_id)
        if state is not None:
            state.accept(token_id)

    def apply_bitmask(self, logits: Any, req_ids: list[str]) -> Any:
        """The logits with the tokens each constrained row's grammar forbids next masked (in place
        when they are float32, as xgrammar's CPU kernel needs)."""
        if not self.states:
            return logits
        rows = [i for i, req_id in enumerate(req_ids) if req_id in self.states]
        if not rows:
            return logits
        if self._bitmask is None or self._bitmask.shape[0] < len(req_ids):
            self._bitmask = self.backend.allocate_bitmask(max(len(req_ids), 64))
        bitmask = self._bitmask[: len(req_ids)]
        masked = [i for i in rows if self.states[req_ids[i]].fill(bitmask, i)]
        if masked:
            if logits.dtype != _float32():
                logits = logits.float()
            self.backend.apply_bitmask(logits, bitmask, masked)
        return logits

    def apply_bitmask_for_drafts(self, logits: Any, req_ids: list[str], draft_token_ids: list[list[int]]) -> Any:
        """Speculative decoding's verification rows masked: request i owns ``len(drafts) + 1`` rows,
        the j-th masked as its grammar stands after its first j drafts."""
        if not self.states or not any(req_id in self.states for req_id in req_ids):
            return logits
        num_rows = sum(len(d) + 1 for d in draft_token_ids)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = self.backend.allocate_bitmask(max(num_rows, 64))
        bitmask = self._bitmask[:num_rows]
        masked: list[int] = []
        first_row = 0
        for req_id, drafts in zip(req_ids, draft_token_ids):
            state = self.states.get(req_id)
            if state is not None:
                masked.extend(state.fill_along(bitmask, first_row, drafts))
            first_row += len(drafts) + 1
        if masked:
            if logits.dtype != _float32():
                logits = logits.float()
            self.backend.apply_bitmask(logits, bitmask, masked)
        return logits

    def valid_drafts(self, req_id: str, draft_token_ids: list[int]) -> list[int]:
        """Drafts cut at the first one the request's grammar refuses (verifying it would be wasted)."""
        state = self.states.get(req_id)
        return draft_token_ids if state is None else state.valid_prefix(draft_token_ids)


def _float32() -> Any:
    import torch

    return torch.float32
