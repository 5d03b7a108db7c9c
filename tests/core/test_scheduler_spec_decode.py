"""The scheduler under speculative decoding, without a model: a fake runner verifies drafts
against the fake model's next tokens and proposes drafts right or wrong on purpose."""
from __future__ import annotations

from typing import Callable

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.speculative_config import SpeculativeConfig
from tests.sched_utils import expected_output, fake_token, make_request

# How the fake drafter proposes: (request's tokens, k) -> drafts.
Drafter = Callable[[list[int], int], list[int]]


def right_drafts(tokens: list[int], k: int) -> list[int]:
    return expected_output(tokens, k)  # what the fake model will make next


def wrong_drafts(tokens: list[int], k: int) -> list[int]:
    return [7] * k  # the fake model never makes a token below 1000


def half_right(tokens: list[int], k: int) -> list[int]:
    drafts = right_drafts(tokens, k)
    return drafts[: k // 2] + [7] * (k - k // 2)


class FakeSpecRunner:
    def __init__(self, block_size: int, drafter: Drafter) -> None:
        self.block_size = block_size
        self.drafter = drafter
        self.state: dict[str, dict] = {}
        self.verified: list[tuple[str, list[int], int]] = []  # (req, drafts, accepted)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_reqs:
            self.state[new.req_id] = {"tokens": list(new.token_ids), "computed": new.num_computed_tokens, "blocks": list(new.block_ids)}
        for cached in out.cached_reqs:
            st = self.state[cached.req_id]
            st["blocks"].extend(cached.new_block_ids)
            assert st["computed"] == cached.num_computed_tokens, "the scheduler's computed count disagrees with the runner's"
        sampled, drafts = {}, {}
        for req_id, n in out.num_scheduled_tokens.items():
            st = self.state[req_id]
            spec = out.scheduled_spec_decode_tokens.get(req_id, [])
            assert len(spec) < n or not spec
            st["computed"] += n
            assert len(st["blocks"]) * self.block_size >= st["computed"], "no KV slot for a scheduled token"
            if st["computed"] - len(spec) != len(st["tokens"]):
                assert not spec
                continue
            accepted = []
            for d in spec:
                t = fake_token(st["tokens"] + accepted)
                if d != t:
                    break
                accepted.append(d)
            tokens = accepted + [fake_token(st["tokens"] + accepted)]
            if spec:
                self.verified.append((req_id, list(spec), len(accepted)))
            st["computed"] -= len(spec) - len(accepted)
            st["tokens"].extend(tokens)
            sampled[req_id] = tokens
            k = out.num_draft_tokens_to_propose.get(req_id, 0)
            if k:
                drafts[req_id] = self.drafter(st["tokens"], k)
        return ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=drafts)


def make_spec_scheduler(
    k: int = 4,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 256,
    **spec_kwargs,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, enable_caching=True)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, **spec_kwargs)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, speculative_config=config)


def cpu_like_cost(num_tokens: int) -> float:
    """A step's seconds as on a CPU: a fixed part (weights streamed once), then a cost per row."""
    return 1.0 + 0.3 * num_tokens


def run(
    sched: Scheduler,
    runner: FakeSpecRunner,
    requests: list[Request],
    max_steps: int = 2000,
    step_cost: Callable[[int], float] = cpu_like_cost,
) -> tuple[dict[str, list[int]], int]:
    for r in requests:
        sched.add_request(r)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while sched.has_unfinished_requests() and steps < max_steps:
        out = sched.schedule()
        res = runner.execute(out)
        sched.observe_step_cost(out.total_num_scheduled_tokens, step_cost(out.total_num_scheduled_tokens))
        for o in sched.update_from_output(out, res):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv_cache_manager.check_integrity()
        steps += 1
    assert not sched.has_unfinished_requests()
    return outputs, steps


def test_right_drafts_give_k_plus_one_tokens_a_step():
    sched = make_spec_scheduler(k=4, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, right_drafts)
    prompt = list(range(1, 11))
    outputs, steps = run(sched, runner, [make_request(sched, "a", prompt, max_tokens=21)])
    assert outputs["a"] == expected_output(prompt, 21)
    # Prefill samples 1 and proposes 4; then 4 verifications of 5 tokens each: 1 + 20 = 21.
    assert steps == 5
    stats = sched.stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 16, 16)
    assert stats.num_accepted_tokens_per_pos == [4, 4, 4, 4]


def test_drafts_are_capped_by_max_tokens_and_max_model_len():
    sched = make_spec_scheduler(k=4, max_model_len=20, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, right_drafts)
    prompt = list(range(1, 11))
    outputs, _ = run(sched, runner, [make_request(sched, "a", prompt, max_tokens=7), make_request(sched, "b", prompt, max_tokens=50)])
    assert outputs["a"] == expected_output(prompt, 7)
    assert outputs["b"] == expected_output(prompt, 10)  # stopped by max_model_len = 20
    # a: 1 token from prefill, then 4 + 1, then only 1 left: no drafts for it (room for none).
    assert [len(s) for r, s, _ in runner.verified if r == "a"] == [4]


def test_rejected_drafts_roll_back_computed_tokens_and_outputs_stay_exact():
    sched = make_spec_scheduler(k=4, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, half_right)
    prompts = {f"r{i}": [i + 1] * (5 + 3 * i) for i in range(4)}
    outputs, _ = run(sched, runner, [make_request(sched, r, p, max_tokens=17) for r, p in prompts.items()])
    for r, p in prompts.items():
        assert outputs[r] == expected_output(p, 17)
    assert all(acc == min(2, len(spec)) for _, spec, acc in runner.verified)
    stats = sched.stats().spec_decoding
    assert stats.num_accepted_tokens == sum(acc for _, _, acc in runner.verified)
    assert stats.num_draft_tokens == sum(len(s) for _, s, _ in runner.verified)
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0


def test_prefix_cache_only_indexes_accepted_tokens():
    """A request whose drafts were all wrong leaves no cached block for a sequence it never had."""
    sched = make_spec_scheduler(k=4, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, wrong_drafts)
    prompt = list(range(1, 9))
    outputs, _ = run(sched, runner, [make_request(sched, "a", prompt, max_tokens=9)])
    assert outputs["a"] == expected_output(prompt, 9)
    kv = sched.kv_cache_manager
    seq = prompt + outputs["a"]
    probe = make_request(sched, "probe", seq + [1])
    _, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == (len(seq) // sched.block_size) * sched.block_size
    wrong = make_request(sched, "wrong", prompt + outputs["a"][:1] + [7, 7, 7, 7, 7, 7, 7])
    _, num_hit = kv.get_computed_blocks(wrong)
    assert num_hit == 8  # only the prompt's two blocks: no block of drafts was ever indexed


def test_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched = make_spec_scheduler(k=4, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, right_drafts)
    prompt = list(range(1, 11))
    full = expected_output(prompt, 12)
    stop = full[3]  # accepted as a draft in the first verification
    req = make_request(sched, "a", prompt, max_tokens=12, stop_token_ids=[stop])
    outputs, _ = run(sched, runner, [req])
    assert outputs["a"] == full[:4]
    assert req.stop_reason == stop


def test_disable_by_batch_size():
    sched = make_spec_scheduler(k=2, disable_by_batch_size=3, max_num_batched_tokens=64)
    runner = FakeSpecRunner(sched.block_size, right_drafts)
    requests = [make_request(sched, f"r{i}", [i + 1] * 6, max_tokens=6) for i in range(5)]
    outputs, _ = run(sched, runner, requests)
    assert runner.verified == []  # five running all along: more than 3, never drafted
    for i in range(5):
        assert outputs[f"r{i}"] == expected_output([i + 1] * 6, 6)


def test_requests_whose_drafts_fail_stop_drafting():
    sched = make_spec_scheduler(k=2)
    runner = FakeSpecRunner(sched.block_size, wrong_drafts)
    prompt = list(range(1, 6))
    outputs, steps = run(sched, runner, [make_request(sched, "a", prompt, max_tokens=80)])
    assert outputs["a"] == expected_output(prompt, 80)
    # Every draft fails: after a few tries the acceptance estimate is too low to pay for a row;
    # drifting back to its prior, it tries again now and then.
    assert 3 <= len(runner.verified) <= 12, len(runner.verified)
    assert steps == 80
    without = make_spec_scheduler(k=2, adaptive=False)
    runner2 = FakeSpecRunner(without.block_size, wrong_drafts)
    run(without, runner2, [make_request(without, "a", prompt, max_tokens=80)])
    assert len(runner2.verified) == 78  # every decode but the last, which has room for no draft


def test_accepted_drafts_run_long_while_rows_are_cheap():
    sched = make_spec_scheduler(k=8, max_num_batched_tokens=64)
    runner = FakeSpecRunner(sched.block_size, right_drafts)
    outputs, _ = run(sched, runner, [make_request(sched, "a", list(range(1, 9)), max_tokens=60)])
    assert outputs["a"] == expected_output(list(range(1, 9)), 60)
    lengths = [len(s) for _, s, _ in runner.verified]
    assert len(lengths) >= 5 and sum(lengths[:-2]) / len(lengths[:-2]) >= 7, lengths  # all accepted: long drafts


def test_a_wide_batch_on_compute_bound_steps_drafts_nothing():
    """When every row costs as much as the step's fixed part, no acceptance below 1 pays a row."""
    sched = make_spec_scheduler(k=4, num_blocks=256, max_num_batched_tokens=256, max_num_seqs=32)
    runner = FakeSpecRunner(sched.block_size, half_right)
    requests = [make_request(sched, f"r{i}", [i + 1] * 5, max_tokens=20) for i in range(24)]
    outputs, _ = run(sched, runner, requests, step_cost=lambda n: 0.01 + 1.0 * n)
    for i in range(24):
        assert outputs[f"r{i}"] == expected_output([i + 1] * 5, 20)
    # Priced from the first plain decode step on, no draft ever pays for its row.
    assert runner.verified == []


def test_preemption_under_speculation_keeps_outputs_exact():
    sched = make_spec_scheduler(k=3, num_blocks=14, block_size=4, max_num_batched_tokens=16, adaptive=False)
    runner = FakeSpecRunner(sched.block_size, half_right)
    prompts = {f"r{i}": [i + 1] * (6 + i) for i in range(4)}
    outputs, _ = run(sched, runner, [make_request(sched, r, p, max_tokens=14) for r, p in prompts.items()])
    assert sched.num_preemptions > 0
    for r, p in prompts.items():
        assert outputs[r] == expected_output(p, 14)
