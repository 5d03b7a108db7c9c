"""A hybrid model's recurrent state slots and the checkpoints prefix caching resumes from, without
a model: a fake runner keeps, per slot, the tokens its state has summarised, so a request resumed
from the wrong checkpoint (or a checkpoint saved at the wrong point) shows as the wrong tokens."""
from __future__ import annotations

import random

import pytest
from sched_utils import FakeRunner, expected_output, make_hybrid_scheduler, make_request, step

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request

BLOCK = 4


class FakeStateRunner(FakeRunner):
    """Each slot's state is the tuple of tokens it has consumed: a perfect summary of the prefix."""

    def __init__(self) -> None:
        super().__init__(BLOCK)
        self.slots: dict[int, tuple[int, ...]] = {}
        self.num_restored = 0

    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        for new in out.new_reqs:
            state_step = out.state_steps[new.req_id]
            if state_step.restore_from is not None:
                self.slots[state_step.slot] = self.slots[state_step.restore_from]
                self.num_restored += 1
            start = new.num_computed_tokens
            state = self.slots.get(state_step.slot, ()) if start else ()
            assert state == tuple(new.token_ids[:start]), f"{new.req_id} resumes from a state of other tokens"
            self.slots[state_step.slot] = state
        computed = {r: self.state[r]["computed"] for r in out.num_scheduled_tokens if r in self.state}
        computed.update({n.req_id: n.num_computed_tokens for n in out.new_reqs})
        result = super().execute(out, requests)
        for req_id, n in out.num_scheduled_tokens.items():
            state_step = out.state_steps[req_id]
            tokens = self.state[req_id]["tokens"]
            start = computed[req_id]
            assert self.slots[state_step.slot] == tuple(tokens[:start]), f"{req_id}'s live state lost its place"
            for p, slot in state_step.checkpoints:
                assert start < p <= start + n and p % BLOCK == 0
                self.slots[slot] = tuple(tokens[:p])
            self.slots[state_step.slot] = tuple(tokens[: start + n])
        return result


def _run(sched: Scheduler, runner: FakeStateRunner) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(1000):
        if not sched.has_unfinished_requests():
            return outputs
        out = sched.schedule()
        for o in sched.update_from_output(out, runner.execute(out, sched.requests)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv_cache_manager.check_integrity()
    raise AssertionError("the scheduler did not finish")


def test_checkpoints_every_interval_and_at_the_prompt_end():
    sched, runner = make_hybrid_scheduler(), FakeStateRunner()
    prompt = list(range(1, 22))  # 21 tokens: boundaries 8 and 16 (interval), 20 (last full block)
    sched.add_request(make_request(sched, "a", prompt, max_tokens=2))
    out = step(sched, runner)
    state_step = out.state_steps["a"]
    assert (state_step.slot, state_step.restore_from) == (0, None)
    assert state_step.checkpoints == ((8, 1), (16, 2), (20, 3))
    state = sched.kv_cache_manager.state_cache
    assert state.num_checkpoints == 3 and state.pool.num_used_blocks == 1  # published, only the live slot held
    assert _run(sched, runner)["a"] == expected_output(prompt, 2)[1:]


def test_a_hit_resumes_from_the_deepest_checkpoint_and_saves_where_its_kv_hit_ended():
    sched, runner = make_hybrid_scheduler(), FakeStateRunner()
    prompt = list(range(1, 22))
    sched.add_request(make_request(sched, "a", prompt, max_tokens=1))
    _run(sched, runner)
    # Shares 14 tokens: KV hits 3 blocks (12 tokens), but a state is saved only at 8.
    sched.add_request(make_request(sched, "b", prompt[:14] + [90, 91, 92], max_tokens=1))
    out = step(sched, runner)
    assert out.new_reqs[0].num_computed_tokens == 8
    state_step = out.state_steps["b"]
    assert state_step.restore_from == 1  # the checkpoint at 8
    assert [p for p, _ in state_step.checkpoints] == [12, 16]  # where the KV hit ended, and the prompt's last full block
    _run(sched, runner)
    # The next request with that prefix resumes at 12, the deepest shared point.
    sched.add_request(make_request(sched, "c", prompt[:14] + [70, 71], max_tokens=1))
    out = step(sched, runner)
    assert out.new_reqs[0].num_computed_tokens == 12
    assert runner.num_restored == 2


def test_a_request_waits_for_a_checkpoint_another_is_writing():
    sched, runner = make_hybrid_scheduler(), FakeStateRunner()
    prefix = list(range(1, 17))
    sched.add_request(make_request(sched, "a", prefix + [50, 51], max_tokens=1))
    sched.add_request(make_request(sched, "b", prefix + [60, 61], max_tokens=1))
    out = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["a"]  # b's prefix state is being saved by this step
    out = step(sched, runner)
    assert out.new_reqs[0].req_id == "b" and out.new_reqs[0].num_computed_tokens == 16
    assert out.state_steps["b"].restore_from is not None


def test_without_prefix_caching_no_checkpoints():
    sched, runner = make_hybrid_scheduler(enable_caching=False), FakeStateRunner()
    sched.add_request(make_request(sched, "a", list(range(1, 30)), max_tokens=3))
    out = step(sched, runner)
    assert out.state_steps["a"].checkpoints == ()
    _run(sched, runner)
    assert sched.kv_cache_manager.state_cache.pool.num_free_blocks == 16


def test_a_new_request_waits_for_a_slot_and_checkpoints_give_way():
    sched, runner = make_hybrid_scheduler(num_slots=3, max_num_seqs=4), FakeStateRunner()
    for i in range(4):
        sched.add_request(make_request(sched, f"r{i}", [100 * i + j for j in range(1, 10)], max_tokens=3))
    out = step(sched, runner)
    # Three slots: two requests start; a checkpoint is skipped rather than take the last free slot.
    assert len(out.new_reqs) == 2
    outputs = _run(sched, runner)
    assert all(outputs[f"r{i}"] for i in range(4))
    state = sched.kv_cache_manager.state_cache
    assert state.pool.num_used_blocks == 0 and not state.live


def test_preemption_frees_the_slot_and_the_request_resumes_correctly():
    # 12 blocks of 4 tokens cannot hold three 20-token requests: some are preempted and recomputed.
    sched, runner = make_hybrid_scheduler(num_blocks=12, num_slots=8, max_num_batched_tokens=12), FakeStateRunner()
    prompts = {f"r{i}": [7 * i + j for j in range(1, 17)] for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(sched, req_id, prompt, max_tokens=6))
    outputs = _run(sched, runner)
    assert sched.num_preemptions > 0
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == expected_output(prompt, 6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shared_prefixes_resume_only_from_their_own_states(seed: int):
    rng = random.Random(seed)
    sched, runner = make_hybrid_scheduler(num_blocks=40, num_slots=6, max_num_batched_tokens=24), FakeStateRunner()
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    prompts, outputs = {}, {}
    for i in range(24):
        stem = rng.choice(stems)
        prompts[f"r{i}"] = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(50, 99) for _ in range(rng.randrange(1, 6))]
        sched.add_request(make_request(sched, f"r{i}", prompts[f"r{i}"], max_tokens=rng.randrange(1, 6)))
        if rng.random() < 0.5:
            out = sched.schedule()
            for o in sched.update_from_output(out, runner.execute(out, sched.requests)):
                outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    for req_id, tokens in _run(sched, runner).items():
        outputs.setdefault(req_id, []).extend(tokens)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == expected_output(prompt, len(outputs[req_id]))
    assert runner.num_restored > 0
    assert sched.kv_cache_manager.prefix_cache_stats.num_hits > 0
