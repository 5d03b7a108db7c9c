"""How many drafts each request verifies next step: the count that maximises tokens per second.

A request's drafts are accepted one after another with some probability ``a`` (its running
estimate: accepted drafts over drafts tried, decayed so that it follows the text), so k drafts
yield ``1 + a + a^2 + ... + a^k`` tokens in expectation. A step's cost grows with its tokens
(``StepCostModel``, measured from the engine's own steps: on a CPU a step of a few rows costs
about one row's, a wide one costs per row; until a step as narrow as the next one has run, it
runs without drafts, to be measured). Each further draft adds ``a^(k+1)`` expected tokens
and one token of cost; the policy adds drafts, best first, while the whole batch's expected
tokens per second still rise. So speculation drafts long where it is accepted and cheap, drafts
little once the batch is wide, and not at all where nothing is accepted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

# Decay of a request's acceptance counts per verification, and their prior (a = 0.5, worth
# two drafts tried). A request that drafts nothing drifts back towards the prior, so it tries
# again now and then.
_ACCEPTANCE_DECAY = 0.8
_PRIOR_ACCEPTED, _PRIOR_TRIED = 1.0, 2.0
_IDLE_DECAY = 0.95
# Step costs: an exponential average per token count.
_COST_DECAY = 0.8


@dataclass
class AcceptanceEstimate:
    accepted: float = _PRIOR_ACCEPTED
    tried: float = _PRIOR_TRIED

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        # Drafts after the first rejection were never tried.
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = _ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.tried = _ACCEPTANCE_DECAY * self.tried + tried

    def idle(self) -> None:
        self.accepted = _IDLE_DECAY * self.accepted + (1 - _IDLE_DECAY) * _PRIOR_ACCEPTED / _PRIOR_TRIED
        self.tried = _IDLE_DECAY * self.tried + (1 - _IDLE_DECAY)


class StepCostModel:
    """Seconds a step of n tokens takes, from the steps seen (linear between the counts seen)."""

    def __init__(self) -> None:
        self._num_tokens: list[int] = []
        self._seconds: list[float] = []

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        i = bisect.bisect_left(self._num_tokens, num_tokens)
        if i < len(self._num_tokens) and self._num_tokens[i] == num_tokens:
            self._seconds[i] = _COST_DECAY * self._seconds[i] + (1 - _COST_DECAY) * seconds
        else:
            self._num_tokens.insert(i, num_tokens)
            self._seconds.insert(i, seconds)

    @property
    def num_observed(self) -> int:
        return len(self._num_tokens)

    @property
    def widest(self) -> int:
        return self._num_tokens[-1]

    def cost(self, num_tokens: int) -> Optional[float]:
        """Linear between the widths seen, and below the narrowest along the first segment's
        slope (never under half its cost); None past the widest, or below the only one: nothing
        to say there yet."""
        xs, ys = self._num_tokens, self._seconds
        if not xs or num_tokens > xs[-1]:
            return None
        i = bisect.bisect_left(xs, num_tokens)
        if xs[i] == num_tokens:
            return ys[i]
        if i == 0:
            if len(xs) == 1:
                return None
            slope = max(0.0, (ys[1] - ys[0]) / (xs[1] - xs[0]))
            return max(ys[0] - slope * (xs[0] - num_tokens), 0.5 * ys[0])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)


def plan_drafts(
    candidates: dict[str, tuple[int, float]],
    num_base_tokens: int,
    num_outputs: int,
    cost_model: StepCostModel,
    proposal_costs: Optional[StepCostModel] = None,
) -> dict[str, int]:
    """Drafts per request (``req_id -> (most drafts it may take, acceptance rate)``) for a step
    of ``num_base_tokens`` known tokens that yields ``num_outputs`` tokens without drafts, best
    expected tokens per second first. Widths the cost model cannot price yet are taken whole
    (that is how it learns them). ``proposal_costs``: a draft model's seconds per draft position
    by the number of requests drafting (its passes run once per position, over those requests);
    n-gram lookup costs nothing."""
    increments: list[tuple[float, str]] = []
    for req_id, (max_drafts, rate) in candidates.items():
        gain = 1.0
        for _ in range(max_drafts):
            gain *= rate
            increments.append((gain, req_id))
    increments.sort(key=lambda x: -x[0])
    expected = float(max(num_outputs, 1))
    base_cost = cost_model.cost(num_base_tokens)
    if base_cost is None:
        return {}  # a step without drafts first, to learn what drafts are to be weighed against
    best, best_n = expected / base_cost, 0
    drafts: dict[str, int] = {}
    for n, (gain, req_id) in enumerate(increments, start=1):
        expected += gain
        drafts[req_id] = drafts.get(req_id, 0) + 1
        cost = cost_model.cost(num_base_tokens + n)
        if cost is None:
            best_n = len(increments)  # unpriced: try it all once
            break
        if proposal_costs is not None and proposal_costs.num_observed:
            per_position = proposal_costs.cost(len(drafts))
            if per_position is None:  # more drafting requests than seen: scale the widest seen
                widest = proposal_costs.widest
                per_position = proposal_costs.cost(widest) * len(drafts) / widest
            cost += per_position * max(drafts.values())
        if expected / cost > best:
            best, best_n = expected / cost, n
    plan: dict[str, int] = {}
    for _, req_id in increments[:best_n]:
        plan[req_id] = plan.get(req_id, 0) + 1
    return plan
