"""Continuous batching, as vLLM v1 does it: no prefill or decode phases, only a token budget.

Each step hands out at most ``max_num_batched_tokens`` tokens, first to running requests (a
decode needs one token; an unfinished prefill takes a chunk), then to waiting ones in arrival
order, up to ``max_num_seqs`` requests in the batch. A request's progress is just
``num_computed_tokens`` chasing ``num_tokens``, so prefill chunks, decodes and the recompute of
a preempted request are all the same thing to the scheduler.

When the pool has no block for a running request, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
from its prompt and the outputs it already produced. The scheduler never touches tensors, nor
KV cache groups: a hybrid model's manager fits a step in every group or in none, and the step's
block ids go to the runner per group.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from pagellm.core.kv_cache_base import KVCacheBlocks, KVCacheManagerBase
from pagellm.core.kv_tier import KVTierCoreStats
from pagellm.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagellm.core.spec_decode_stats import SpecDecodingStats
from pagellm.core.spec_planner import SpecDecodePlanner
from pagellm.core.state_cache import StateCacheStats
from pagellm.request import Request, RequestStatus
from pagellm.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot; the counters are cumulative, so any number of readers can take differences."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_blocks: int
    num_used_blocks: int
    num_cached_free_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, found
    num_preemptions: int
    num_running_tokens: int  # KV tokens held by running requests
    num_block_table_entries: int  # blocks running requests hold, all KV cache groups (null entries not counted)
    num_kv_cache_groups: int = 1
    spec_decoding: Optional[SpecDecodingStats] = None
    state_cache: Optional[StateCacheStats] = None  # a hybrid model's recurrent state slots
    kv_tier: Optional[KVTierCoreStats] = None  # the offloading tier: the scheduler's counters
    kv_tier_worker: Optional[Any] = None  # and the worker's (bytes, seconds, errors)
    num_loading_reqs: int = 0  # waiting for their pages from the tier


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManagerBase,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        speculative_config: Optional[SpeculativeConfig] = None,
        max_loras: int = 0,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_loras = max_loras  # distinct adapters the running batch may hold (0: LoRA off)
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Waiting for their prefix's pages from the offloading tier (pagellm.core.kv_tier).
        self.loading: dict[str, Request] = {}
        self.kv_tier_worker_stats: Optional[Any] = None  # the worker's tier counters, as last reported
        # Left the batch since the last step; the runner drops their state.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Speculative decoding's side of scheduling: which drafts to verify, how many to propose.
        self.spec = (
            SpecDecodePlanner(speculative_config, max_model_len, max_num_batched_tokens) if speculative_config is not None else None
        )

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends requests from outside the step (abort, stop string found by the detokenizer)."""
        finished = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.request_id in self.loading:
                del self.loading[request.request_id]
            else:
                self.waiting.remove(request)
            self._free_request(request, status)
            finished.append(request)
        return finished

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        if self.spec is not None:
            self.spec.forget(request.request_id)
        request.status = status
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ---- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        new_block_ids: dict[str, tuple[list[int], ...]] = {}  # per KV cache group
        preempted: list[Request] = []
        spec_decode_tokens: dict[str, list[int]] = {}

        # Running requests first, oldest first, so preemption hits the newest.
        idx = 0
        while idx < len(self.running) and token_budget > 0:
            request = self.running[idx]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new_tokens <= 0:
                idx += 1  # fully computed and waiting for its sample: nothing to run
                continue
            spec_token_ids = self.spec.tokens_to_verify(request, num_new_tokens, token_budget) if self.spec is not None else []
            num_new_tokens += len(spec_token_ids)
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, self._with_lookahead(request, num_new_tokens), num_draft_tokens=len(spec_token_ids)
                )
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself: nothing else can run either
            num_scheduled[request.request_id] = num_new_tokens
            new_block_ids[request.request_id] = new_blocks.block_ids_by_group
            if spec_token_ids:
                spec_decode_tokens[request.request_id] = spec_token_ids
            token_budget -= num_new_tokens
            idx += 1

        # Admit waiting requests while there is budget, unless we just had to evict someone.
        if not preempted and self.admits_waiting_requests():
            skipped: list[Request] = []
            pending_hashes = self._pending_prefix_hashes() if self.kv_cache_manager.enable_caching else None
            loras = {r.lora_int_id for r in self.running} - {0}
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= self.max_loras:
                    skipped.append(self.waiting.popleft())  # its adapter would need a slot none frees this step
                    continue
                computed_blocks: Optional[KVCacheBlocks] = None
                num_hit_tokens = 0
                if request.num_computed_tokens == 0:
                    computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                    # The next block is being computed by a request already running (a burst behind
                    # one new prefix): wait for it instead of computing it a second time.
                    next_idx = num_hit_tokens // self.block_size
                    if (
                        pending_hashes
                        and next_idx < len(request.block_hashes)
                        and request.block_hashes[next_idx] in pending_hashes
                    ) or self.kv_cache_manager.waits_for_pending(request, num_hit_tokens):
                        skipped.append(self.waiting.popleft())
                        continue
                    # The prefix goes on in the offloading tier: load it (beside the other requests'
                    # steps) instead of computing it; the request waits for its own pages only.
                    num_tier_blocks = self.kv_cache_manager.tier_hit(request, num_hit_tokens)
                    if num_tier_blocks and self.kv_cache_manager.start_tier_load(
                        request, computed_blocks, num_hit_tokens, num_tier_blocks
                    ):
                        self.loading[request.request_id] = self.waiting.popleft()
                        continue
                num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, self._with_lookahead(request, num_new_tokens, num_hit_tokens), computed_blocks
                )
                if new_blocks is None:
                    break
                self.waiting.popleft()
                if computed_blocks is not None:
                    self.kv_cache_manager.record_prefix_hit(request, num_hit_tokens)
                request.num_computed_tokens = num_hit_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                if request.scheduled_time is None:
                    request.scheduled_time = time.monotonic()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                if request.lora_int_id:
                    loras.add(request.lora_int_id)
                if pending_hashes is not None and num_hit_tokens + num_new_tokens < request.num_prompt_tokens:
                    pending_hashes.update(request.block_hashes[(num_hit_tokens + num_new_tokens) // self.block_size :])
                num_scheduled[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                block_ids = self.kv_cache_manager.get_block_ids_by_group(request.request_id)
                new_reqs.append(
                    NewRequestData(
                        req_id=request.request_id,
                        token_ids=list(request.all_token_ids),
                        num_prompt_tokens=request.num_prompt_tokens,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids[0],
                        num_computed_tokens=num_hit_tokens,
                        num_output_tokens=request.num_output_tokens,
                        extra_group_block_ids=block_ids[1:],
                        pooling_params=request.pooling_params,
                        lora_request=request.lora_request,
                    )
                )
            # Skipped requests keep their place at the head of the queue.
            self.waiting.extendleft(reversed(skipped))

        new_ids = {r.req_id for r in new_reqs}
        for request in self.running:
            req_id = request.request_id
            if req_id in num_scheduled and req_id not in new_ids:
                block_ids = new_block_ids[req_id]
                cached_reqs.append(
                    CachedRequestData(
                        req_id=req_id,
                        new_block_ids=block_ids[0],
                        num_computed_tokens=request.num_computed_tokens,
                        new_token_ids=request.all_token_ids[-1:] if request.num_output_tokens else [],
                        extra_group_new_block_ids=block_ids[1:],
                    )
                )

        # Layout order: the runner builds the flat batch in running order.
        ordered = {r.request_id: num_scheduled[r.request_id] for r in self.running if r.request_id in num_scheduled}
        output = SchedulerOutput(
            new_reqs=new_reqs,
            cached_reqs=cached_reqs,
            num_scheduled_tokens=ordered,
            total_num_scheduled_tokens=sum(ordered.values()),
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            scheduled_spec_decode_tokens=spec_decode_tokens,
            num_draft_tokens_to_propose=self.spec.drafts_to_propose(ordered, self.requests, len(self.running))
            if self.spec is not None
            else {},
            state_steps=self.kv_cache_manager.take_state_steps(),
        )
        output.kv_saves, output.kv_loads = self.kv_cache_manager.take_tier_orders()
        self._finished_req_ids = set()
        # Tokens handed out now count as computed: their KV is written by this step's forward pass.
        for req_id, n in ordered.items():
            self.requests[req_id].num_computed_tokens += n
        return output

    # ---- speculative decoding (pagellm.core.spec_planner) -----------------------------

    def observe_step_cost(self, num_tokens: int, seconds: float) -> None:
        """A step's width and duration (less any proposing), for the adaptive speculation policy."""
        if self.spec is not None:
            self.spec.step_costs.observe(num_tokens, seconds)

    def observe_proposal_cost(self, num_requests: int, seconds_per_position: float) -> None:
        """What one draft-model pass over ``num_requests`` drafting requests took."""
        if self.spec is not None and num_requests and self.spec.num_lookahead_tokens:
            self.spec.proposal_costs.observe(num_requests, seconds_per_position)

    def _with_lookahead(self, request: Request, num_new_tokens: int, num_computed_tokens: Optional[int] = None) -> int:
        if self.spec is None:
            return num_new_tokens
        computed = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        return self.spec.with_lookahead(computed, num_new_tokens)

    def admits_waiting_requests(self) -> bool:
        """Whether waiting requests may join the batch this step; continuous batching always lets them."""
        return True

    def _pending_prefix_hashes(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests have yet to compute."""
        pending: set[bytes] = set()
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                first = request.num_computed_tokens // self.block_size
                pending.update(request.block_hashes[first:])
        return pending

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.add(request.request_id)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.kv_cache_manager.finish_step()
        ended = self.kv_cache_manager.finish_tier_loads(runner_output.kv_loads_done, runner_output.kv_tier_removed)
        for req_id in reversed(ended):
            request = self.loading.pop(req_id, None)
            if request is not None:
                self.waiting.appendleft(request)  # its pages are in the pool now: admitted as a prefix hit
        if runner_output.kv_tier_stats is not None:
            self.kv_tier_worker_stats = runner_output.kv_tier_stats
        outputs: list[EngineCoreOutput] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            error = runner_output.failed.get(req_id)
            token_ids = runner_output.sampled_token_ids.get(req_id)
            prompt_logprobs = self._new_prompt_logprobs(request, scheduler_output, runner_output)
            if error is not None:
                self.running.remove(request)
                self._free_request(request, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="error", error=error))
                continue
            if not token_ids:
                if request.max_tokens == 0 and request.num_computed_tokens >= request.num_tokens:
                    # Scoring or pooling: the prompt is done and nothing is to be generated.
                    pooled = runner_output.pooler_output.get(req_id)
                    if request.pooling_params is None:
                        status = RequestStatus.FINISHED_LENGTH_CAPPED
                    else:
                        status = RequestStatus.FINISHED_STOPPED if pooled is not None else RequestStatus.FINISHED_ERROR
                    self.running.remove(request)
                    self._free_request(request, status)
                    outputs.append(
                        EngineCoreOutput(
                            req_id,
                            [],
                            new_prompt_logprobs=prompt_logprobs,
                            finish_reason=RequestStatus.finish_reason(status),
                            num_cached_tokens=max(request.num_cached_tokens, 0),
                            scheduled_time=request.scheduled_time,
                            pooled=pooled,
                            error="the runner returned no pooled output" if status == RequestStatus.FINISHED_ERROR else None,
                        )
                    )
                elif prompt_logprobs:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_logprobs))
                continue  # a prefill chunk that did not reach the end of the known tokens
            spec_token_ids = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if spec_token_ids:
                # Rejected drafts' KV slots are not computed after all: the next step rewrites them.
                # A recurrent state goes back to the one saved after the accepted drafts.
                num_accepted = len(token_ids) - 1
                request.num_computed_tokens -= len(spec_token_ids) - num_accepted
                self.kv_cache_manager.accept_drafts(request, len(spec_token_ids), num_accepted)
                self.spec.observe_verification(request.request_id, len(spec_token_ids), num_accepted)
            status = None
            num_new = 0
            for token_id in token_ids:
                request.append_output_token_ids([token_id])
                num_new += 1
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            new_token_ids = token_ids[:num_new]
            if req_id in runner_output.draft_token_ids and status is None:
                request.spec_token_ids = runner_output.draft_token_ids[req_id]
            out = EngineCoreOutput(
                req_id=req_id,
                new_token_ids=new_token_ids,
                new_logprobs=runner_output.logprobs.get(req_id, [])[:num_new],
                new_prompt_logprobs=prompt_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                scheduled_time=request.scheduled_time,
            )
            if status is not None:
                self.running.remove(request)
                self._free_request(request, status)
                out.finish_reason = RequestStatus.finish_reason(status)
                out.stop_reason = request.stop_reason
            outputs.append(out)
        return outputs

    @staticmethod
    def _new_prompt_logprobs(request: Request, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list:
        """This step's prompt logprobs, less positions already reported before a preemption."""
        rows = runner_output.prompt_logprobs.get(request.request_id)
        if not rows:
            return []
        # The runner reports positions from where this step started, which num_computed_tokens has passed.
        first = request.num_computed_tokens - scheduler_output.num_scheduled_tokens[request.request_id]
        skip = max(0, request.num_prompt_logprobs_sent - first)
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent, first + len(rows))
        return rows[skip:]

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens and token_id in params.all_stop_token_ids:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        pool = kv.block_pool
        cache_stats = kv.prefix_cache_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.usage(),
            num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            prefix_cache_queries=cache_stats.num_queries,
            prefix_cache_hits=cache_stats.num_hits,
            num_preemptions=self.num_preemptions,
            num_running_tokens=sum(r.num_computed_tokens for r in self.running),
            num_block_table_entries=sum(kv.num_held_blocks(r.request_id) for r in self.running),
            num_kv_cache_groups=kv.num_kv_cache_groups,
            spec_decoding=self.spec.stats.copy() if self.spec is not None else None,
            state_cache=kv.state_cache.stats() if getattr(kv, "state_cache", None) is not None else None,
            kv_tier=kv.tier.stats.copy() if getattr(kv, "tier", None) is not None else None,
            kv_tier_worker=self.kv_tier_worker_stats,
            num_loading_reqs=len(self.loading),
        )
