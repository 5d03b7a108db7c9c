"""What the scheduler tells the model runner each step, and what comes back.

Only deltas cross: a request's full token list and sampling settings are sent once, when it
(re)enters the batch; afterwards each step sends just its new block ids and token count. The
runner keeps the rest in its persistent batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from pagellm.core.state_cache import StateStep
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


class LogprobRow(NamedTuple):
    """Logprobs at one position, as plain lists; column 0 is the sampled (or prompt) token."""

    token_ids: list[int]  # k + 1 ids: the chosen token, then the top k
    logprobs: list[float]
    rank: int  # the chosen token's rank in the distribution (1 = most likely)


@dataclass
class NewRequestData:
    """A request entering the running batch: new, or resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt plus any outputs generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # KV cache group 0's table (a one-group cache's only one)
    num_computed_tokens: int  # prefix-cache hit: the runner skips these
    num_output_tokens: int  # outputs so far (seeded sampling continues from here)
    extra_group_block_ids: tuple[list[int], ...] = ()  # groups 1.. of a hybrid model
    pooling_params: Optional[PoolingParams] = None  # a pooling request: pooled, never sampled
    lora_request: Optional[LoRARequest] = None  # the adapter's identity; the runner holds its weights

    @property
    def block_ids_by_group(self) -> tuple[list[int], ...]:
        return (self.block_ids, *self.extra_group_block_ids)


@dataclass
class CachedRequestData:
    """A request that was already in the batch last step."""

    req_id: str
    new_block_ids: list[int]  # KV cache group 0's new blocks
    num_computed_tokens: int
    # The token sampled last step, which this step feeds to the model. The runner already knows
    # it (it sampled it), so this is only for runners that did not keep it.
    new_token_ids: list[int] = field(default_factory=list)
    extra_group_new_block_ids: tuple[list[int], ...] = ()  # groups 1.. of a hybrid model

    @property
    def new_block_ids_by_group(self) -> tuple[list[int], ...]:
        return (self.new_block_ids, *self.extra_group_new_block_ids)


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # Step order: runners lay out the flat batch in this order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that left the batch since the last step (finished, aborted or preempted).
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    # Speculative decoding: each verifying request's drafts, which its scheduled tokens include
    # after the one known token; and how many drafts the runner should propose after this step
    # for each request (absent: none).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_draft_tokens_to_propose: dict[str, int] = field(default_factory=dict)
    # A hybrid model's recurrent state: each scheduled request's slot, restore and checkpoints.
    state_steps: dict[str, StateStep] = field(default_factory=dict)
    # The offloading tier (pagellm.core.kv_tier): pages to save before this step's forward pass
    # overwrites their blocks, and per request the pages to load, as (block id, key).
    kv_saves: list[tuple[int, bytes]] = field(default_factory=list)
    kv_loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the sampled tokens (one, or under speculative decoding the accepted
    drafts and one more), or nothing for a partial prefill chunk."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)  # one row per sampled token
    # req_id -> one row per prompt position this step covered.
    prompt_logprobs: dict[str, list[LogprobRow]] = field(default_factory=dict)
    # Requests that failed inside the runner (e.g. sampling blew up), with the error message.
    failed: dict[str, str] = field(default_factory=dict)
    # Drafts proposed after this step, for the next one's verification.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests whose prompt this step finished: the pooled hidden state (float32 values).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # The offloading tier: per request whose load ended, how many leading pages loaded (the rest
    # failed); keys the tier dropped; the worker's tier counters (None without a tier).
    kv_loads_done: dict[str, int] = field(default_factory=dict)
    kv_tier_removed: list[bytes] = field(default_factory=list)
    kv_tier_stats: Optional[Any] = None


@dataclass
class EngineCoreOutput:
    """One request's progress from one step, for the output processor."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobRow] = field(default_factory=list)
    new_prompt_logprobs: list[LogprobRow] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    # When the request was first admitted to the running set (monotonic), for queue-time metrics.
    scheduled_time: Optional[float] = None
    pooled: Optional[list[float]] = None  # a finished pooling request's embedding

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
