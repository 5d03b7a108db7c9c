"""Model-free drivers for the scheduler: a fake runner that 'samples' a deterministic token."""
from __future__ import annotations

from typing import Optional

from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.speculative_config import SpeculativeConfig


def fake_token(token_ids: list[int]) -> int:
    """What the fake model generates next: a function of the whole context, as a real model's."""
    return (sum(token_ids) * 31 + len(token_ids)) % 1000 + 1000


def fake_embedding(token_ids: list[int]) -> list[float]:
    """What the fake model pools a prompt into: a function of every token, as MEAN pooling's."""
    return [float(sum(token_ids)), float(len(token_ids))]


class FakeRunner:
    """Tracks what the runner would hold, and checks the scheduler's instructions are coherent.

    A pooling request (``pooling_params`` set) is never sampled: when its prompt is computed it
    gets ``fake_embedding`` once, and is never scheduled again."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.state: dict[str, dict] = {}
        self.pooling_req_ids: set[str] = set()
        self.num_pooled: dict[str, int] = {}

    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.state
            self.state[new.req_id] = {"tokens": list(new.token_ids), "computed": new.num_computed_tokens, "blocks": list(new.block_ids)}
            if new.pooling_params is not None:
                self.pooling_req_ids.add(new.req_id)
        for cached in out.cached_reqs:
            st = self.state[cached.req_id]
            st["blocks"].extend(cached.new_block_ids)
            assert st["computed"] == cached.num_computed_tokens
        sampled, pooled = {}, {}
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            st["computed"] += n
            assert st["computed"] <= len(st["tokens"])
            assert len(st["blocks"]) * self.block_size >= st["computed"], "not enough blocks for the computed tokens"
            if st["computed"] == len(st["tokens"]) and req_id in self.pooling_req_ids:
                assert self.num_pooled.get(req_id, 0) == 0, f"{req_id} scheduled after its prompt was pooled"
                self.num_pooled[req_id] = 1
                pooled[req_id] = fake_embedding(st["tokens"])
            elif st["computed"] == len(st["tokens"]):
                token = fake_token(st["tokens"])
                st["tokens"].append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(sampled_token_ids=sampled, pooler_output=pooled)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    enable_caching: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, max_loras=max_loras)


def make_hybrid_scheduler(
    num_blocks: int = 64,
    num_slots: int = 16,
    interval: int = 8,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    enable_caching: bool = True,
    block_size: int = 4,
    speculative_config: Optional[SpeculativeConfig] = None,
) -> Scheduler:
    """A hybrid model's cache without a model: three recurrent layers (``num_slots`` state slots,
    checkpoints every ``interval`` tokens, and under speculation a draft slot per draft) and one
    attention layer."""
    layout = group_layers([None] * 4, state_layer_ids=(0, 1, 2))
    num_draft_slots = speculative_config.num_speculative_tokens if speculative_config is not None else 0
    kv = KVCacheManager(
        num_blocks, block_size, 256, enable_caching, layout, num_state_slots=num_slots, state_checkpoint_interval=interval,
        num_state_draft_slots=num_draft_slots,
    )
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, 256, speculative_config=speculative_config)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One step: schedule, run, take the output back, and check the manager's bookkeeping."""
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out, sched.requests))
    sched.kv_cache_manager.check_integrity()
    return out


def make_pooling_request(sched: Scheduler, req_id: str, prompt: list[int]) -> Request:
    """A request to embed, as the engine makes one: max_tokens 0 and pooling params."""
    hasher = make_block_hasher(sched.block_size) if sched.kv_cache_manager.enable_caching else None
    return Request(req_id, prompt, SamplingParams(max_tokens=0, temperature=0.0), 0, block_hasher=hasher, pooling_params=PoolingParams())


def make_request(
    sched: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 4, lora_request: Optional[LoRARequest] = None, **params
) -> Request:
    hasher = make_block_hasher(sched.block_size) if sched.kv_cache_manager.enable_caching else None
    p = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, prompt, p, max_tokens, block_hasher=hasher, lora_request=lora_request)


def run_to_completion(sched: Scheduler, runner: Optional[FakeRunner] = None, max_steps: int = 10_000) -> dict[str, list[int]]:
    runner = runner or FakeRunner(sched.block_size)
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        res = runner.execute(out, sched.requests)
        for o in sched.update_from_output(out, res):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv_cache_manager.check_integrity()
    assert not sched.has_unfinished_requests()
    return outputs


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = fake_token(tokens)
        tokens.append(t)
        out.append(t)
    return out

