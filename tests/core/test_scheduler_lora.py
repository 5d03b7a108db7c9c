"""The scheduler with LoRA adapters, without a model: at most ``max_loras`` distinct adapters run
in one batch, the rest wait and still finish with the right tokens; the prefix cache never hands
one adapter's KV to another."""
from __future__ import annotations

from sched_utils import FakeRunner, expected_output, make_request, make_scheduler, run_to_completion

from pagellm.lora.request import LoRARequest

LORAS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 6)]


def test_distinct_adapters_in_the_batch_never_exceed_max_loras():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2)
    prompts = {}
    # Five adapters, two requests each, and two base-model requests, all arriving at once.
    for i in range(12):
        lora = LORAS[i % 5] if i < 10 else None
        prompts[f"r{i}"] = [i + 1] * (3 + i)
        sched.add_request(make_request(sched, f"r{i}", prompts[f"r{i}"], max_tokens=3, lora_request=lora))
    runner = FakeRunner(4)
    outputs: dict[str, list[int]] = {}
    widest = 0
    first = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if first is None:
            first = out
        adapters = {sched.requests[r].lora_int_id for r in out.num_scheduled_tokens} - {0}
        assert len(adapters) <= 2
        widest = max(widest, len(adapters))
        for o in sched.update_from_output(out, runner.execute(out, sched.requests)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    # The first step admits adapters 1 and 2 (two requests each) and both base requests; 3-5 wait.
    assert sorted(first.num_scheduled_tokens) == ["r0", "r1", "r10", "r11", "r5", "r6"]
    assert {n.req_id: n.lora_request for n in first.new_reqs} == {
        "r0": LORAS[0], "r5": LORAS[0], "r1": LORAS[1], "r6": LORAS[1], "r10": None, "r11": None,
    }
    assert widest == 2
    assert outputs == {r: expected_output(p, 3) for r, p in prompts.items()}
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 64


def test_without_lora_the_scheduler_admits_as_before():
    sched = make_scheduler(max_num_seqs=8, max_loras=0)
    for i in range(4):
        sched.add_request(make_request(sched, f"r{i}", [i + 1] * 5))
    assert len(sched.schedule().num_scheduled_tokens) == 4


def test_one_prompt_under_two_adapters_shares_no_blocks():
    sched = make_scheduler(num_blocks=64, block_size=4, max_loras=4)
    prompt = list(range(1, 18))  # four full blocks
    sched.add_request(make_request(sched, "base", prompt, max_tokens=1))
    sched.add_request(make_request(sched, "a1", prompt, max_tokens=1, lora_request=LORAS[0]))
    run_to_completion(sched)
    kv = sched.kv_cache_manager
    for req_id, lora, hit in [("a1-again", LORAS[0], 16), ("a2", LORAS[1], 0), ("base-again", None, 16)]:
        request = make_request(sched, req_id, prompt, max_tokens=1, lora_request=lora)
        assert kv.get_computed_blocks(request)[1] == hit, req_id
    base, a1 = (make_request(sched, r, prompt, lora_request=lora) for r, lora in [("x", None), ("y", LORAS[0])])
    assert not set(base.block_hashes) & set(a1.block_hashes)
