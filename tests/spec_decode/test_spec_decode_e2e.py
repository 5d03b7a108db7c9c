"""Speculative decoding through the engine: greedy output token for token what plain decoding
gives (the 14 prompts of tests/engine/test_llm_vs_hf.py, float32 path, under chunked prefill and
preemption), for n-gram lookup and a draft model; the features that ride along (structured
output, logprobs, stop strings, seeds); and on the default int8 path vLLM's rule.

The int8 path is not batch-invariant with or without speculation: its activations are rounded to
int8 per row, so the last-bit differences between the decode and the multi-token attention
kernels can flip a rounding and move a logprob by a tenth of a nat (docs/speculative_decoding.md),
as a different prefill chunking does. There a near-tie may break the other way.
"""
from __future__ import annotations

import json
import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path
from pagellm.tokenizer import apply_chat_template, load_tokenizer
from tests.engine.test_llm_vs_hf import CHATS, TEXT_PROMPTS, TOKEN_PROMPT_LENGTHS, _long_prompt

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
EXACT = dict(dtype="float32")
# Draft for every request at every step, wherever a draft exists: the verification path is what is tested.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None, "adaptive": False}
DRAFT = {"model": default_model_path(), "num_speculative_tokens": 3, "disable_by_batch_size": None, "adaptive": False}
# Too small for all 14 at once (the long prompt alone needs ~100 blocks), and chunked prefill.
PRESSURE = dict(num_kv_blocks=150, max_num_batched_tokens=96)
REPEAT_TEXT = "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. " * 3


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """The 14 prompts of tests/engine/test_llm_vs_hf.py, built with pagellm's tokenizer alone."""
    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    items = [{"prompt_token_ids": tokenizer.encode(p)} for p in TEXT_PROMPTS + [_long_prompt()]]
    for n in TOKEN_PROMPT_LENGTHS:
        ids: list[int] = []
        while len(ids) < n:
            t = rng.randrange(100, tokenizer.vocab_size)
            if t not in special:
                ids.append(t)
        items.append({"prompt_token_ids": ids})
    items += [{"prompt_token_ids": apply_chat_template(tokenizer, chat)} for chat in CHATS]
    assert len(items) == 14
    return items


@pytest.fixture(scope="module")
def plain_outputs(prompts) -> list[list[int]]:
    llm = LLM(**EXACT)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


CONFIGS = {
    "ngram": dict(EXACT, speculative_config=NGRAM),
    "ngram_pressure": dict(EXACT, speculative_config=NGRAM, **PRESSURE),
    "draft_model_pressure": dict(EXACT, speculative_config=DRAFT, **PRESSURE),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_with_speculation_equals_plain_greedy(name, prompts, plain_outputs):
    llm = LLM(**CONFIGS[name])
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    for i, (ours, plain) in enumerate(zip(outputs, plain_outputs)):
        assert ours == plain, f"prompt {i}"
    stats = llm.llm_engine.core.scheduler.stats()
    spec = stats.spec_decoding
    assert spec.num_drafts > 20 and spec.num_accepted_tokens > 0, spec
    if name.endswith("pressure"):
        assert stats.num_preemptions > 0
    print(f"{name}: {spec.num_drafts} verifications, acceptance {spec.acceptance_rate:.2f}, "
          f"{spec.mean_acceptance_length:.2f} tokens each, {stats.num_preemptions} preemptions")


def test_default_path_meets_vllms_rule_against_plain_decoding(prompts):
    """int8 linear layers: at the first difference, each side's token is in the other's top 5."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    plain = LLM().generate(prompts, params, use_tqdm=False)
    spec = LLM(speculative_config=NGRAM).generate(prompts, params, use_tqdm=False)
    num_identical = 0
    for i, (a, b) in enumerate(zip(plain, spec)):
        a, b = a.outputs[0], b.outputs[0]
        first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is None:
            assert len(a.token_ids) == len(b.token_ids), f"prompt {i}"
            num_identical += 1
            continue
        assert a.token_ids[first] in b.logprobs[first] and b.token_ids[first] in a.logprobs[first], f"prompt {i} at {first}"
    print(f"default path: {num_identical}/{len(prompts)} identical to plain decoding")


@pytest.fixture(scope="module")
def default_pair():
    """The exact (float32) path with and without n-gram speculation."""
    spec = dict(NGRAM, prompt_lookup_min=2)
    return LLM(**EXACT), LLM(**EXACT, speculative_config=spec)


def _repeat_prompt(llm: LLM) -> dict:
    messages = [{"role": "user", "content": f"Repeat exactly: {REPEAT_TEXT}"}]
    return {"prompt_token_ids": apply_chat_template(llm.get_tokenizer(), messages)}


def test_stop_strings_and_logprobs_match_plain_decoding(default_pair):
    plain, spec = default_pair
    prompt = _repeat_prompt(plain)
    # Far enough in that drafts were accepted before the stop string shows up.
    params = SamplingParams(temperature=0.0, max_tokens=80, logprobs=3, stop=["dog. The quick brown fox jumps over the lazy"])
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for llm in default_pair)
    assert a.text == b.text and a.token_ids == b.token_ids
    assert a.text.count("fox") == 1  # cut at the stop string, which the second repetition completes
    assert a.finish_reason == b.finish_reason == "stop" and b.stop_reason.startswith("dog.")
    assert len(b.logprobs) == len(b.token_ids)
    for pos, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
        assert set(x) == set(y), pos
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-3, pos
    assert spec.llm_engine.core.scheduler.stats().spec_decoding.num_accepted_tokens > 10


def test_structured_output_with_speculation(default_pair):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
    from pagellm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))
    plain, spec = default_pair
    messages = [{"role": "user", "content": 'Give me JSON like {"name": "Ann", "age": 30} for Bob who is 41: {"name": "Bob", "age": 41}'}]
    prompt = {"prompt_token_ids": apply_chat_template(plain.get_tokenizer(), messages)}
    a, b = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0] for llm in default_pair)
    assert a.token_ids == b.token_ids
    assert set(json.loads(b.text)) == {"name", "age"}


def test_seeded_sampling_repeats_under_speculation(default_pair):
    _, spec = default_pair
    prompt = _repeat_prompt(spec)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=123)
    first = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    again = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert first == again
