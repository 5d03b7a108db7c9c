"""Model-free drivers for KV cache groups: a scheduler over a grouped manager, and a fake runner
that writes each position's "KV" into a per-group slot store and checks every read a windowed
attention makes finds what it must, so a block freed or handed out too early shows."""
from __future__ import annotations

from typing import Optional, Sequence

from sched_utils import fake_token

from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def make_grouped_scheduler(
    layer_windows: Sequence[Optional[int]],
    num_blocks: int = 32,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    enable_caching: bool = False,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching, kv_cache_layout=group_layers(layer_windows))
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)


def make_request(sched: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 4) -> Request:
    hasher = make_block_hasher(sched.block_size) if sched.kv_cache_manager.enable_caching else None
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, block_hasher=hasher)


def tables(sched: Scheduler, req_id: str) -> tuple[list[int], ...]:
    return sched.kv_cache_manager.get_block_ids_by_group(req_id)


class WindowCheckingRunner:
    """Keeps the runner's per-group block tables from the scheduler's deltas, writes a marker of
    each new position's prefix into its group's slot, then checks every slot each query reads
    (its window, or its whole context for full attention) holds the right marker."""

    def __init__(self, block_size: int, group_windows: Sequence[Optional[int]], null_block_id: Optional[int]) -> None:
        self.block_size = block_size
        self.group_windows = list(group_windows)
        self.null_block_id = null_block_id
        self.slots: list[dict[int, int]] = [{} for _ in self.group_windows]
        self.state: dict[str, dict] = {}
        self.num_reads = 0

    @classmethod
    def for_scheduler(cls, sched: Scheduler) -> "WindowCheckingRunner":
        kv = sched.kv_cache_manager
        null = kv.block_pool.null_block
        return cls(kv.block_size, kv.kv_cache_layout.group_windows, None if null is None else null.block_id)

    def _slot(self, group: int, st: dict, pos: int) -> int:
        return st["tables"][group][pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput, requests: object = None) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.state
            self.state[new.req_id] = {
                "tokens": list(new.token_ids),
                "computed": new.num_computed_tokens,
                "tables": [list(ids) for ids in new.block_ids_by_group],
            }
        for cached in out.cached_reqs:
            st = self.state[cached.req_id]
            for table, ids in zip(st["tables"], cached.new_block_ids_by_group):
                table.extend(ids)
            assert st["computed"] == cached.num_computed_tokens
        # Every backend writes the whole batch's keys and values before it attends.
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            for group in range(len(self.group_windows)):
                for pos in range(st["computed"], st["computed"] + n):
                    assert st["tables"][group][pos // self.block_size] != self.null_block_id, "a write into the null block"
                    self.slots[group][self._slot(group, st, pos)] = hash(tuple(st["tokens"][: pos + 1]))
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            for group, window in enumerate(self.group_windows):
                for q in range(st["computed"], st["computed"] + n):
                    lo = 0 if window is None else max(0, q - window + 1)
                    for j in range(lo, q + 1):
                        expected = hash(tuple(st["tokens"][: j + 1]))
                        assert self.slots[group][self._slot(group, st, j)] == expected, (req_id, group, q, j)
                        self.num_reads += 1
            st["computed"] += n
            assert st["computed"] <= len(st["tokens"])
            if st["computed"] == len(st["tokens"]):
                token = fake_token(st["tokens"])
                st["tokens"].append(token)
                sampled[req_id] = [token]
        return ModelRunnerOutput(sampled_token_ids=sampled)


def step(sched: Scheduler, runner: WindowCheckingRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_integrity()
    return out
