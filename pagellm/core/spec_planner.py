"""Speculative decoding's side of scheduling: which drafts a step verifies, how many to propose.

The scheduler asks this planner three things: the drafts a decoding request verifies now (cut to
the token budget, the model's length and max_tokens), the extra KV slots a draft model writes
ahead, and after the step is laid out how many drafts each sampling request should get for the
next one (``plan_drafts``, from each request's acceptance and the measured step costs). No
tensors: plain counts in, plain counts out.
"""
from __future__ import annotations

from pagellm.core.spec_decode_stats import SpecDecodingStats
from pagellm.core.spec_policy import AcceptanceEstimate, StepCostModel, plan_drafts
from pagellm.request import Request
from pagellm.speculative_config import SpeculativeConfig

# A draft model starts drafting for a request only while this many of its tokens are still to
# come: its first proposal runs it over the whole request.
DRAFT_MODEL_MIN_REMAINING = 32


class SpecDecodePlanner:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_spec_tokens = config.num_speculative_tokens
        # A draft model writes KV ahead of the verified tokens while it drafts: room for k more.
        self.num_lookahead_tokens = self.num_spec_tokens if config.method == "draft_model" else 0
        self.stats = SpecDecodingStats(self.num_spec_tokens)
        # The adaptive policy's inputs (pagellm.core.spec_policy): per request, how often its
        # drafts are accepted; per step width, what a step costs; a draft model's passes.
        self._acceptance: dict[str, AcceptanceEstimate] = {}
        self._proposed: set[str] = set()  # requests asked for drafts at least once
        self.step_costs = StepCostModel()
        self.proposal_costs = StepCostModel()

    def forget(self, req_id: str) -> None:
        self._acceptance.pop(req_id, None)
        self._proposed.discard(req_id)

    def tokens_to_verify(self, request: Request, num_new_tokens: int, token_budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: as many as the budget, the model's
        length and max_tokens leave room for (the step yields up to one token more than its drafts)."""
        spec = request.spec_token_ids
        if not spec:
            return []
        request.spec_token_ids = []
        if num_new_tokens != request.num_tokens - request.num_computed_tokens or num_new_tokens != 1:
            return []  # not a plain decode (a resumed request recomputes first)
        room = min(
            token_budget - num_new_tokens,
            self.max_model_len - request.num_tokens - 1,
            request.max_tokens - request.num_output_tokens - 1,
        )
        return spec[: max(room, 0)]

    def with_lookahead(self, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Slots to allocate: the step's tokens, plus a draft model's lookahead within the model's length."""
        room = self.max_model_len - num_computed_tokens - num_new_tokens
        return num_new_tokens + max(0, min(self.num_lookahead_tokens, room))

    def drafts_to_propose(self, num_scheduled: dict[str, int], requests: dict[str, Request], num_running: int) -> dict[str, int]:
        """Per request that samples this step, how many drafts the runner proposes for the next one."""
        config = self.config
        if config.disable_by_batch_size is not None and num_running > config.disable_by_batch_size:
            return {}
        candidates: dict[str, tuple[int, float]] = {}
        num_base_tokens = 0  # what the next step runs without drafts
        for req_id, n in num_scheduled.items():
            request = requests[req_id]
            unscheduled = request.num_tokens - request.num_computed_tokens - n
            if unscheduled > 0:  # a prefill chunk that does not reach the end: nothing is sampled
                num_base_tokens += unscheduled
                continue
            num_base_tokens += 1
            # After this step the request has at least one more token; drafts past what the
            # model's length or max_tokens can still take would never be verified.
            remaining = request.max_tokens - request.num_output_tokens
            k = min(self.num_spec_tokens, self.max_model_len - request.num_tokens - 2, remaining - 2)
            if k <= 0:
                continue
            if self.num_lookahead_tokens and req_id not in self._proposed and remaining < DRAFT_MODEL_MIN_REMAINING:
                continue
            candidates[req_id] = (k, self._acceptance.setdefault(req_id, AcceptanceEstimate()).rate)
        if not config.adaptive:
            plan = {r: k for r, (k, _) in candidates.items()}
        else:
            num_base_tokens = min(num_base_tokens, self.max_num_batched_tokens)
            plan = plan_drafts(candidates, num_base_tokens, len(candidates), self.step_costs, self.proposal_costs)
            for req_id in candidates.keys() - plan.keys():
                self._acceptance[req_id].idle()
        self._proposed.update(plan)
        return plan

    def observe_verification(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.stats.observe(num_draft_tokens, num_accepted_tokens)
        self._acceptance.setdefault(req_id, AcceptanceEstimate()).observe(num_draft_tokens, num_accepted_tokens)
