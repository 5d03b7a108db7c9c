"""The scheduler's side of the offloading tier, without a model: exact block ids of what is saved
and loaded, and a fake runner whose "pages" are the tokens a block holds (and, for a hybrid model,
whose state slots are the tokens a state has summarised), so that every prefix served from the pool
or the tier is checked against the tokens it stands for."""
from __future__ import annotations

import pytest
from sched_utils import FakeRunner, expected_output, make_hybrid_scheduler, make_request, make_scheduler, run_to_completion

from pagellm.core.block_hash import hash_full_blocks
from pagellm.core.kv_tier import is_state_key, state_tier_key
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.request import RequestStatus

BS = 4


class PagedRunner(FakeRunner):
    """FakeRunner plus KV pages: computing a token writes it into its block's page; the tier is a
    dict of pages by key; every scheduled request's computed prefix must read back its tokens."""

    def __init__(self, block_size: int, tier: dict | None = None, fail_keys: set | None = None, hold: bool = False) -> None:
        super().__init__(block_size)
        self.pages: dict[int, list] = {}
        self.slots: dict[int, tuple] = {}  # a hybrid model's state slots: the tokens each state summarises
        self.tier = {} if tier is None else tier
        self.fail_keys = fail_keys or set()
        self.hold = hold  # loads finish only when released (to test waiting and aborts)
        self.pending: dict[str, int] = {}
        self.saved: list[tuple[int, bytes]] = []
        self.loaded: list[tuple[str, list[tuple[int, bytes]]]] = []

    def execute(self, out: SchedulerOutput, requests) -> ModelRunnerOutput:
        for block_id, key in out.kv_saves:  # before the step writes anything
            self.tier[key] = self.slots.get(block_id, ()) if is_state_key(key) else list(self.pages.get(block_id, []))
            self.saved.append((block_id, key))
        done = {}
        for req_id, items in out.kv_loads.items():
            self.loaded.append((req_id, items))
            num_ok = 0
            for block_id, key in items:
                if key in self.fail_keys or key not in self.tier:
                    break
                if is_state_key(key):
                    self.slots[block_id] = self.tier[key]
                else:
                    self.pages[block_id] = list(self.tier[key])
                num_ok += 1
            (self.pending.__setitem__(req_id, num_ok) if self.hold else done.__setitem__(req_id, num_ok))
        for new in out.new_reqs:  # a prefix hit must read back the tokens it stands for
            for j, block_id in enumerate(new.block_ids[: new.num_computed_tokens // self.block_size]):
                assert self.pages.get(block_id) == new.token_ids[j * self.block_size : (j + 1) * self.block_size], (new.req_id, j)
            state_step = out.state_steps.get(new.req_id)
            if state_step is not None:  # and its state must be the one of the tokens it resumes after
                if state_step.restore_from is not None:
                    self.slots[state_step.slot] = self.slots[state_step.restore_from]
                state = self.slots.get(state_step.slot, ()) if new.num_computed_tokens else ()
                assert state == tuple(new.token_ids[: new.num_computed_tokens]), f"{new.req_id} resumes from another prefix's state"
        starts = {r.req_id: r.num_computed_tokens for r in out.new_reqs}
        starts.update({c.req_id: c.num_computed_tokens for c in out.cached_reqs})
        result = super().execute(out, requests)
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            for pos in range(starts[req_id], starts[req_id] + n):
                page = self.pages.setdefault(st["blocks"][pos // self.block_size], [])
                del page[pos % self.block_size :]
                page.append(st["tokens"][pos])
            state_step = out.state_steps.get(req_id)
            if state_step is not None:
                for p, slot in state_step.checkpoints:
                    self.slots[slot] = tuple(st["tokens"][:p])
                self.slots[state_step.slot] = tuple(st["tokens"][: starts[req_id] + n])
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


# ---- a hybrid model: recurrent state checkpoints go to the tier with their pages -----------------

PROMPT_H = list(range(1, 22))  # 21 tokens: checkpoints at 8 and 16 (the interval) and 20 (the last full block)
PROMPT_G = list(range(300, 321))


def _hybrid_tiered(num_blocks: int, num_slots: int = 5, keys=()):
    sched = make_hybrid_scheduler(num_blocks=num_blocks, num_slots=num_slots, interval=8)
    sched.kv_cache_manager.enable_tier(keys)
    return sched


def _run_one(sched, runner, req_id: str, prompt: list[int]) -> list[int]:
    sched.add_request(make_request(sched, req_id, prompt, max_tokens=2))
    return run_to_completion(sched, runner)[req_id]


def _h_then_g(num_blocks: int, num_slots: int = 5, hold: bool = False):
    """"h" then "g" run to completion on a tiered hybrid scheduler: (scheduler, runner, h's block hashes)."""
    sched, runner = _hybrid_tiered(num_blocks=num_blocks, num_slots=num_slots), PagedRunner(BS, hold=hold)
    _run_one(sched, runner, "h", PROMPT_H)
    _run_one(sched, runner, "g", PROMPT_G)
    return sched, runner, hash_full_blocks(PROMPT_H, BS)


def _finish_h2(sched, runner, out):
    """Runs the step ``out`` and "h2" to its end: ("h2"'s tokens from those steps, the tier's counters)."""
    sched.update_from_output(out, runner.execute(out, sched.requests))
    return run_to_completion(sched, runner)["h2"], sched.stats().kv_tier


def test_a_hybrid_models_evicted_checkpoints_are_saved_and_a_prefix_in_memory_loads_only_its_state():
    sched, runner = _hybrid_tiered(num_blocks=64), PagedRunner(BS)
    assert _run_one(sched, runner, "h", PROMPT_H) == expected_output(PROMPT_H, 2)
    # "g" takes the slot pool's 5 slots (its live one and three checkpoints): "h"'s checkpoints
    # are handed out again, saved under their state keys first; its pages stay in the pool.
    assert _run_one(sched, runner, "g", PROMPT_G) == expected_output(PROMPT_G, 2)
    hashes = hash_full_blocks(PROMPT_H, BS)
    assert [k for _, k in runner.saved] == [state_tier_key(hashes[i]) for i in (1, 3, 4)]
    assert runner.tier[state_tier_key(hashes[4])] == tuple(PROMPT_H[:20])
    sched.add_request(make_request(sched, "h2", PROMPT_H, max_tokens=2))
    out = sched.schedule()
    assert out.kv_loads == {"h2": [(out.kv_loads["h2"][0][0], state_tier_key(hashes[4]))]}  # the state, no page
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("h2", 20)]
    assert out.state_steps["h2"].restore_from is not None  # resumed from the loaded state, as from any checkpoint
    tokens, tier = _finish_h2(sched, runner, out)
    assert tokens == expected_output(PROMPT_H, 2)[1:]
    # h's three, and g's first, whose slot the loaded state took.
    assert runner.saved[3][1] == state_tier_key(hash_full_blocks(PROMPT_G, BS)[1])
    assert (tier.num_state_saves, tier.num_states_loaded, tier.num_blocks_loaded, tier.num_hit_tokens) == (4, 1, 0, 20)


def test_a_hybrid_prefix_evicted_from_memory_loads_its_pages_and_state():
    # 7 blocks: "g" (6 blocks) evicts "h"'s full blocks 1-4; block 0 stays in the pool.
    sched, runner, hashes = _h_then_g(num_blocks=7)
    sched.add_request(make_request(sched, "h2", PROMPT_H, max_tokens=2))
    out = sched.schedule()
    assert [k for _, k in out.kv_loads["h2"]] == [state_tier_key(hashes[4]), *hashes[1:5]]  # the state first
    sched.update_from_output(out, runner.execute(out, sched.requests))
    sched.kv_cache_manager.check_integrity()
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("h2", 20)]
    tokens, tier = _finish_h2(sched, runner, out)
    assert tokens == expected_output(PROMPT_H, 2)[1:]
    assert (tier.num_blocks_loaded, tier.num_states_loaded, tier.num_hit_tokens, tier.num_blocks_failed) == (4, 1, 20, 0)


def test_a_damaged_state_recomputes_the_prefix_and_is_forgotten():
    sched, runner, hashes = _h_then_g(num_blocks=7)
    runner.fail_keys = {state_tier_key(hashes[4])}
    sched.add_request(make_request(sched, "h2", PROMPT_H, max_tokens=2))
    out = sched.schedule()
    assert "h2" in out.kv_loads
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()  # no state for any prefix the pool now holds: the whole prompt runs
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("h2", 0)] and not out.kv_loads
    tokens, tier = _finish_h2(sched, runner, out)
    assert tokens == expected_output(PROMPT_H, 2)[1:]
    assert (tier.num_states_failed, tier.num_blocks_failed, tier.num_hit_tokens) == (1, 4, 0)
    assert state_tier_key(hashes[4]) not in sched.kv_cache_manager.tier.keys


def test_after_a_restart_a_hybrid_prefix_loads_from_the_tier_and_a_flush_saved_its_states():
    sched, runner = _hybrid_tiered(num_blocks=64), PagedRunner(BS)
    _run_one(sched, runner, "h", PROMPT_H)
    flushed = sched.kv_cache_manager.tier_flush_orders()
    runner.execute(SchedulerOutput([], [], {}, 0, set(), set(), kv_saves=flushed), sched.requests)
    hashes = hash_full_blocks(PROMPT_H, BS)
    assert {k for _, k in flushed} == {*hashes[:5], *(state_tier_key(hashes[i]) for i in (1, 3, 4))}
    # A new engine on the same tier: cold pools, the tier's keys.
    sched2, runner2 = _hybrid_tiered(num_blocks=64, keys=list(runner.tier)), PagedRunner(BS, dict(runner.tier))
    sched2.add_request(make_request(sched2, "h", PROMPT_H, max_tokens=2))
    out = sched2.schedule()
    assert [k for _, k in out.kv_loads["h"]] == [state_tier_key(hashes[4]), *hashes[:5]]
    sched2.update_from_output(out, runner2.execute(out, sched2.requests))
    assert run_to_completion(sched2, runner2)["h"] == expected_output(PROMPT_H, 2)
    assert sched2.stats().kv_tier.num_hit_tokens == 20


def test_pages_from_the_tier_lead_up_to_a_checkpoint_still_in_memory_which_is_held_meanwhile():
    # 7 blocks but 16 slots: "g" evicts "h"'s pages 1-4, "h"'s checkpoints stay in the slot pool.
    sched, runner, hashes = _h_then_g(num_blocks=7, num_slots=16, hold=True)
    state = sched.kv_cache_manager.state_cache
    checkpoint = state.pool.get_cached_block(hashes[4])
    sched.add_request(make_request(sched, "h2", PROMPT_H, max_tokens=2))
    out = sched.schedule()
    assert [k for _, k in out.kv_loads["h2"]] == hashes[1:5]  # pages only: the state is in memory
    assert checkpoint.ref_cnt == 1 and checkpoint in state.tier_held  # not handed out while the pages load
    sched.update_from_output(out, runner.execute(out, sched.requests))
    sched.kv_cache_manager.check_integrity()
    out = sched.schedule()
    res = runner.execute(out, sched.requests)
    res.kv_loads_done = runner.release()
    sched.update_from_output(out, res)
    assert checkpoint.ref_cnt == 0 and not state.tier_held
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.new_reqs] == [("h2", 20)]
    assert out.state_steps["h2"].restore_from == checkpoint.block_id
    tokens, tier = _finish_h2(sched, runner, out)
    assert tokens == expected_output(PROMPT_H, 2)[1:]
    assert (tier.num_blocks_loaded, tier.num_states_loaded, tier.num_hit_tokens) == (4, 0, 20)
