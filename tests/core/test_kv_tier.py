"""The scheduler's side of the offloading tier, without a model: exact block ids of what is saved
and loaded, and a fake runner whose "pages" are the tokens a block holds, so that every prefix
served from the pool or the tier is checked against the tokens it stands for."""
from __future__ import annotations

import pytest
from sched_utils import FakeRunner, expected_output, make_request, make_scheduler, run_to_completion

from pagellm.core.block_hash import hash_full_blocks
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.request import RequestStatus

BS = 4


class PagedRunner(FakeRunner):
    """FakeRunner plus KV pages: computing a token writes it into its block's page; the tier is a
    dict of pages by key; every scheduled request's computed prefix must read back its tokens."""

    def __init__(self, block_size: int, tier: dict | None = None, fail_keys: set | None = None, hold: bool = False) -> None:
        super().__init__(block_size)
        self.pages: dict[int, list] = {}
        self.tier = {} if tier is None else tier
        self.fail_keys = fail_keys or set()
        self.hold = hold  # loads finish only when released (to test waiting and aborts)
        self.pending: dict[str, int] = {}
        self.saved: list[tuple[int, bytes]] = []
        self.loaded: list[tuple[str, list[tuple[int, bytes]]]] = []

    def execute(self, out: SchedulerOutput, requests) -> ModelRunnerOutput:
        for block_id, key in out.kv_saves:  # before the step writes anything
            self.tier[key] = list(self.pages.get(block_id, []))
            self.saved.append((block_id, key))
        done = {}
        for req_id, items in out.kv_loads.items():
            self.loaded.append((req_id, items))
            num_ok = 0
            for block_id, key in items:
                if key in self.fail_keys or key not in self.tier:
                    break
                self.pages[block_id] = list(self.tier[key])
                num_ok += 1
            (self.pending.__setitem__(req_id, num_ok) if self.hold else done.__setitem__(req_id, num_ok))
        for new in out.new_reqs:  # a prefix hit must read back the tokens it stands for
            for j, block_id in enumerate(new.block_ids[: new.num_computed_tokens // self.block_size]):
                assert self.pages.get(block_id) == new.token_ids[j * self.block_size : (j + 1) * self.block_size], (new.req_id, j)
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs}
        starts.update({c.req_id: c.num_computed_tokens for c in out.cached_reqs})
        result = super().execute(out, requests)
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            for pos in range(starts[req_id], starts[req_id] + n):
                page = self.pages.setdefault(st["blocks"][pos // self.block_size], [])
                del page[pos % self.block_size :]
                page.append(st["tokens"][pos])
        result.kv_loads_done = done
        return result

    def release(self) -> dict[str, int]:
        done, self.pending = self.pending, {}
        return done


def _tiered(num_blocks: int = 9, keys=()):
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=4, max_num_batched_tokens=64)
    sched.kv_cache_manager.enable_tier(keys)
    return sched


PROMPT_A = list(range(100, 117))  # 4 full blocks and one token
PROMPT_B = list(range(200, 217))


def test_evicted_blocks_are_saved_before_reuse_and_a_later_prefix_loads_them():
    sched, runner = _tiered(num_blocks=7), PagedRunner(BS)
    sched.add_request(make_request(sched, "a", PROMPT_A, max_tokens=2))
    assert run_to_completion(sched, runner)["a"] == expected_output(PROMPT_A, 2)
    keys_a = hash_full_blocks(PROMPT_A, BS)
    # "a" freed its 5 blocks tail first; its 4 full ones are cached. "b" needs 5 of the 7 blocks:
    # the 2 never used, a's partial last block, then two cached ones from the queue's head (a's
    # deepest full blocks first), whose pages are saved.
    sched.add_request(make_request(sched, "b", PROMPT_B, max_tokens=2))
    out = sched.schedule()
    assert [key for _, key in out.kv_saves] == [keys_a[3], keys_a[2]]
    sched.update_from_output(out, runner.execute(out, sched.requests))
    run_to_completion(sched, runner)
    assert set(keys_a[2:4]) <= set(runner.tier)
    # A repeat of "a": blocks 0-1 from the pool, 2-3 loaded from the tier into fresh blocks.
    sched.add_request(make_request(sched, "a2", PROMPT_A, max_tokens=2))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("a2") is None and sched.loading.keys() == {"a2"}
    ((req_id, items),) = out.kv_loads.items()
    assert req_id == "a2" and [k for _, k in items] == keys_a[2:4]
    sched.update_from_output(out, runner.execute(out, sched.requests))
    sched.kv_cache_manager.check_integrity()
    out = sched.schedule()  # admitted with all 16 tokens a hit: only the last token runs
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("a2", 16)]
    sched.update_from_output(out, runner.execute(out, sched.requests))
    assert run_to_completion(sched, runner)["a2"] == expected_output(PROMPT_A, 2)[1:]
    tier = sched.stats().kv_tier
    assert (tier.num_loads, tier.num_blocks_loaded, tier.num_hit_tokens, tier.num_blocks_failed) == (1, 2, 8, 0)


def test_a_failed_page_loads_the_blocks_before_it_and_recomputes_the_rest():
    keys = hash_full_blocks(PROMPT_A, BS)
    tier = {k: PROMPT_A[i * BS : (i + 1) * BS] for i, k in enumerate(keys)}
    sched, runner = _tiered(keys=keys), PagedRunner(BS, tier, fail_keys={keys[2]})
    sched.add_request(make_request(sched, "a", PROMPT_A, max_tokens=3))
    assert run_to_completion(sched, runner)["a"] == expected_output(PROMPT_A, 3)
    ((_, items),) = runner.loaded
    assert [k for _, k in items] == keys  # a cold pool: the whole prefix from the tier
    stats = sched.stats().kv_tier
    assert (stats.num_blocks_loaded, stats.num_blocks_failed, stats.num_hit_tokens) == (2, 2, 8)
    assert keys[2] not in sched.kv_cache_manager.tier.keys  # the damaged page is forgotten


def test_a_request_waits_only_for_its_own_loads_and_an_abort_returns_its_blocks_when_they_land():
    keys = hash_full_blocks(PROMPT_A, BS)
    tier = {k: PROMPT_A[i * BS : (i + 1) * BS] for i, k in enumerate(keys)}
    sched, runner = _tiered(num_blocks=16, keys=keys), PagedRunner(BS, tier, hold=True)
    sched.add_request(make_request(sched, "a", PROMPT_A, max_tokens=2))
    sched.add_request(make_request(sched, "b", PROMPT_B, max_tokens=2))
    out = sched.schedule()
    assert set(out.kv_loads) == {"a"} and set(out.num_scheduled_tokens) == {"b"}
    sched.update_from_output(out, runner.execute(out, sched.requests))
    for _ in range(3):  # "b" goes on; "a" waits
        out = sched.schedule()
        assert "a" not in out.num_scheduled_tokens
        sched.update_from_output(out, runner.execute(out, sched.requests))
        sched.kv_cache_manager.check_integrity()
    free_before = sched.kv_cache_manager.block_pool.num_free_blocks
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.num_free_blocks == free_before  # still being written
    out = sched.schedule()
    res = runner.execute(out, sched.requests)
    res.kv_loads_done = runner.release()
    sched.update_from_output(out, res)
    sched.kv_cache_manager.check_integrity()
    assert sched.kv_cache_manager.block_pool.num_free_blocks >= free_before + 4 and not sched.loading
    # The loaded pages joined the prefix cache all the same: a new request finds them in memory.
    sched.add_request(make_request(sched, "a3", PROMPT_A, max_tokens=2))
    out = sched.schedule()
    assert not out.kv_loads and [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("a3", 16)]


def test_keys_the_tier_dropped_are_not_looked_up():
    keys = hash_full_blocks(PROMPT_A, BS)
    sched = _tiered(keys=keys)
    sched.kv_cache_manager.finish_tier_loads({}, [keys[1]])
    request = make_request(sched, "a", PROMPT_A)
    assert sched.kv_cache_manager.tier_hit(request, 0) == 1
    assert sched.kv_cache_manager.tier_hit(make_request(sched, "p", PROMPT_A, prompt_logprobs=1), 0) == 0


def test_tier_needs_prefix_caching():
    sched = make_scheduler(enable_caching=False)
    with pytest.raises(ValueError, match="prefix caching"):
        sched.kv_cache_manager.enable_tier([])
