"""A hybrid model's recurrent state slots and the checkpoints prefix caching resumes from, without
a model: a fake runner keeps, per slot, the tokens its state has summarised, so a request resumed
from the wrong checkpoint (or a checkpoint saved at the wrong point) shows as the wrong tokens."""
from __future__ import annotations

import random

import pytest
from sched_utils import FakeRunner, expected_output, fake_token, make_hybrid_scheduler, make_request, step

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.core.state_cache import StateCacheManager, StateStep
from pagellm.request import Request
from pagellm.speculative_config import SpeculativeConfig

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


def _run(sched: Scheduler, runner: "FakeStateRunner | FakeSpecStateRunner") -> dict[str, list[int]]:
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


# ---- speculative decoding: draft slots and the rollback to the accepted drafts -------------------


class FakeSpecStateRunner:
    """Verifies drafts as the engine does, with each slot holding the tokens its state summarises:
    a step computes the known token and its drafts, saves the state after each prefix of them where
    its checkpoints say, and the fake model's tokens decide how many drafts hold. Each proposal is
    right except at one position, which moves on every time, so every depth of acceptance occurs."""

    def __init__(self) -> None:
        self.slots: dict[int, tuple[int, ...]] = {}
        self.state: dict[str, dict] = {}
        self.num_proposals = 0
        self.accepted_depths: set[int] = set()

    def _draft(self, tokens: list[int], k: int) -> list[int]:
        drafts = expected_output(tokens, k)
        spoilt = self.num_proposals % (k + 1)
        self.num_proposals += 1
        if spoilt < k:
            drafts[spoilt] = 7  # the fake model never makes a token below 1000
        return drafts

    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_reqs:
            state_step = out.state_steps[new.req_id]
            if state_step.restore_from is not None:
                self.slots[state_step.slot] = self.slots[state_step.restore_from]
            start = new.num_computed_tokens
            if not start:
                self.slots[state_step.slot] = ()
            self.state[new.req_id] = {"tokens": list(new.token_ids), "computed": start}
        for cached in out.cached_reqs:
            assert self.state[cached.req_id]["computed"] == cached.num_computed_tokens
        sampled, drafts = {}, {}
        for req_id, n in out.num_scheduled_tokens.items():
            st, state_step = self.state[req_id], out.state_steps[req_id]
            spec = out.scheduled_spec_decode_tokens.get(req_id, [])
            start, inputs = st["computed"], st["tokens"] + spec
            assert self.slots[state_step.slot] == tuple(inputs[:start]), f"{req_id}'s live state is not at its computed tokens"
            assert [p for p, _ in state_step.checkpoints] == sorted(p for p, _ in state_step.checkpoints)
            for p, slot in state_step.checkpoints:
                assert start < p <= start + n
                self.slots[slot] = tuple(inputs[:p])
            self.slots[state_step.slot] = tuple(inputs[: start + n])
            st["computed"] = start + n
            if st["computed"] - len(spec) != len(st["tokens"]):
                continue  # a prefill chunk short of the prompt's end
            accepted: list[int] = []
            for d in spec:
                if d != fake_token(st["tokens"] + accepted):
                    break
                accepted.append(d)
            if spec:
                self.accepted_depths.add(len(accepted))
            st["computed"] -= len(spec) - len(accepted)
            st["tokens"] += accepted + [fake_token(st["tokens"] + accepted)]
            sampled[req_id] = accepted + [st["tokens"][-1]]
            k = out.num_draft_tokens_to_propose.get(req_id, 0)
            if k:
                drafts[req_id] = self._draft(st["tokens"], k)
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=drafts)


def _spec_config(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)


def test_draft_slots_hold_the_states_a_step_rolls_back_to():
    state = StateCacheManager(num_slots=8, block_size=4, checkpoint_interval=8, enable_caching=False, num_draft_slots=2)
    sched = make_hybrid_scheduler(enable_caching=False)
    request = make_request(sched, "a", [1, 2, 3, 4, 5], max_tokens=8)
    assert state.can_admit(request, 0)
    state.allocate(request, 0, 0, 5)
    assert state.take_steps()["a"] == StateStep(0)
    assert [b.block_id for b in state.drafts["a"]] == [1, 2]
    # A decode step: the sampled token (the request's 6th) and two drafts; states saved after 6 and 7 tokens.
    request.append_output_token_ids([9])
    state.allocate(request, 0, 5, 8, num_drafts=2)
    assert state.take_steps()["a"] == StateStep(0, None, ((6, 1), (7, 2)))
    state.accept_drafts("a", 2, 1)  # one draft held: the state after 7 tokens is live
    assert state.live["a"].block_id == 2 and [b.block_id for b in state.drafts["a"]] == [1, 0]
    state.accept_drafts("a", 2, 2)  # all held: the live slot already has them
    assert state.live["a"].block_id == 2
    state.accept_drafts("a", 1, 0)
    assert state.live["a"].block_id == 1 and [b.block_id for b in state.drafts["a"]] == [2, 0]
    assert state.stats().num_live == 3
    state.free("a")
    assert state.pool.num_free_blocks == 8 and not state.drafts


def test_a_request_starts_only_with_its_draft_slots_free():
    state = StateCacheManager(num_slots=5, block_size=4, checkpoint_interval=8, enable_caching=True, num_draft_slots=2)
    sched = make_hybrid_scheduler()
    first, second = (make_request(sched, r, [1, 2, 3], max_tokens=4) for r in ("a", "b"))
    state.allocate(first, 0, 0, 3)
    assert not state.can_admit(second, 0)  # 2 free of the 3 it needs
    with pytest.raises(ValueError, match="3 drafts, but a request holds 2 draft slots"):
        state.allocate(first, 0, 3, 7, num_drafts=3)
    with pytest.raises(ValueError, match="needs one state slot and 2 for its drafts; the pool has 2 slots"):
        StateCacheManager(num_slots=2, block_size=4, checkpoint_interval=8, enable_caching=True, num_draft_slots=2)


@pytest.mark.parametrize("enable_caching", [True, False])
def test_speculation_keeps_every_live_state_at_its_accepted_tokens(enable_caching: bool):
    # 14 blocks cannot hold three requests of 26 tokens with their drafts: some are preempted.
    sched = make_hybrid_scheduler(
        num_blocks=14, num_slots=12, max_num_batched_tokens=12, enable_caching=enable_caching, speculative_config=_spec_config(3)
    )
    runner = FakeSpecStateRunner()
    prompts = {f"r{i}": [7 * i + j for j in range(1, 15)] for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(sched, req_id, prompt, max_tokens=12))
    outputs = _run(sched, runner)
    assert sched.num_preemptions > 0 and runner.accepted_depths == {0, 1, 2, 3}
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == expected_output(prompt, 12)
    state = sched.kv_cache_manager.state_cache
    assert not state.live and not state.drafts and state.pool.num_used_blocks == 0
