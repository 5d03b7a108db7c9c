"""Grammar and reasoning state of every constrained request in the runner's batch, and the per-step logits mask.

Each step, every constrained row's matcher writes its allowed tokens into one shared bitmask
(a C++ call per request, no Python over the vocabulary) and one batched call masks the logits.
The backend is created on first use so that servers never asked for structured output do not
pay for it. With a reasoning parser, a grammar waits for the end of the reasoning, and a request
whose thinking budget is spent has its next token forced (``reasoning.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.backend import XgrammarBackend
from pagellm.structured_output.reasoning import ReasoningBounds, ReasoningTracker
from pagellm.structured_output.request_state import GrammarState


@dataclass
class _Constrained:
    """One request's constraints: a grammar, a reasoning tracker, or both."""

    grammar: Optional[GrammarState]
    reasoning: Optional[ReasoningTracker]

    def accept(self, token_id: int) -> None:
        if self.reasoning is not None and not self.reasoning.accept(token_id):
            return  # still reasoning: the grammar starts after the end marker
        if self.grammar is not None:
            self.grammar.accept(token_id)

    @property
    def answering(self) -> bool:
        return self.reasoning is None or self.reasoning.ended

    @property
    def forced_token(self) -> Optional[int]:
        return None if self.reasoning is None else self.reasoning.forced_token()


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: set[int], reasoning: Optional[ReasoningBounds] = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = set(stop_token_ids)
        self.reasoning = reasoning
        self._backend: Optional[XgrammarBackend] = None
        self.states: dict[str, _Constrained] = {}
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

    def wants(self, params: SamplingParams) -> bool:
        """Whether a request needs a state here: a grammar, or a thinking budget to enforce."""
        return params.structured_outputs is not None or (self.reasoning is not None and params.thinking_token_budget is not None)

    def add_request(self, req_id: str, params: SamplingParams, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """A request's constraints, brought to where it is (a resumed request replays its outputs)."""
        spec = params.structured_outputs
        grammar = None if spec is None else GrammarState(req_id, self.backend.matcher(self.backend.compile(spec)))
        tracker = None
        if self.reasoning is not None:
            tracker = ReasoningTracker(self.reasoning, prompt_token_ids, params.thinking_token_budget)
        state = _Constrained(grammar, tracker)
        for token_id in output_token_ids:
            state.accept(token_id)
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
        masked = []
        forced: list[tuple[int, int]] = []
        for i in rows:
            state = self.states[req_ids[i]]
            token = state.forced_token
            if token is not None:
                forced.append((i, token))
            elif state.answering and state.grammar is not None and state.grammar.fill(bitmask, i):
                masked.append(i)
        if forced:
            logits = _force(logits, forced)
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
        forced: list[tuple[int, int]] = []
        for req_id, drafts in zip(req_ids, draft_token_ids):
            state = self.states.get(req_id)
            if state is not None and state.forced_token is not None:
                forced.append((first_row, state.forced_token))  # its drafts were dropped (valid_drafts)
            elif state is not None and state.answering and state.grammar is not None:
                masked.extend(state.grammar.fill_along(bitmask, first_row, drafts))
            first_row += len(drafts) + 1
        if forced:
            logits = _force(logits, forced)
        if masked:
            if logits.dtype != _float32():
                logits = logits.float()
            self.backend.apply_bitmask(logits, bitmask, masked)
        return logits

    def valid_drafts(self, req_id: str, draft_token_ids: list[int]) -> list[int]:
        """Drafts cut at the first one the request's grammar refuses (verifying it would be wasted)."""
        state = self.states.get(req_id)
        if state is None:
            return draft_token_ids
        if state.forced_token is not None:
            return []
        if not state.answering or state.grammar is None:
            return draft_token_ids  # drafts within the reasoning are not checked against the grammar
        return state.grammar.valid_prefix(draft_token_ids)


def _force(logits: Any, forced: list[tuple[int, int]]) -> Any:
    """Rows whose next token is fixed: every other token's logit set to -inf."""
    import torch

    rows = torch.tensor([r for r, _ in forced], dtype=torch.long, device=logits.device)
    tokens = torch.tensor([t for _, t in forced], dtype=torch.long, device=logits.device)
    logits[rows] = float("-inf")
    logits[rows, tokens] = 0.0
    return logits


def _float32() -> Any:
    import torch

    return torch.float32
