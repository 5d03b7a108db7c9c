"""Prompt logprobs (vLLM's ``SamplingParams(prompt_logprobs=k)``) equal transformers' float32 ones.

Computed during prefill, they must come out whole and in order whatever the prefill looks like:
one pass, chunks of a tiny token budget, a prompt whose prefix sits in the prefix cache, and a
request preempted (its prompt recomputed) after its prompt logprobs were sent. ``max_tokens=0``
scores the prompt without generating.
"""
from __future__ import annotations

import pytest
import torch
from hf_oracle import hf_model_and_tokenizer, logprob_close

from pagellm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def add(a, b):\n    return a + b\n",
    "请用中文介绍一下长城。",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read books about the sea.",
]


@torch.inference_mode()
def hf_prompt_logprobs(token_ids: list[int]) -> torch.Tensor:
    """log p(token[i] | token[:i]) for i >= 1, from transformers in float32."""
    model, _ = hf_model_and_tokenizer()
    logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0]


def check(output, k: int) -> None:
    ids = output.prompt_token_ids
    plp = output.prompt_logprobs
    assert plp is not None and len(plp) == len(ids), (len(plp or []), len(ids))
    assert plp[0] is None
    ref = hf_prompt_logprobs(ids)
    for pos in range(1, len(ids)):
        step = plp[pos]
        assert ids[pos] in step
        assert len(step) in (k, k + 1)  # the prompt token, plus the top-k (which may include it)
        assert logprob_close(step[ids[pos]].logprob, float(ref[pos - 1])), (pos, step[ids[pos]].logprob, float(ref[pos - 1]))


def token_prompts(llm: LLM) -> list[dict]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 8, "block_size": 8}], ids=["one-pass", "chunked"])
def test_prompt_logprobs_scoring_only(engine_kwargs):
    llm = LLM(max_model_len=256, dtype="float32", **engine_kwargs)
    outs = llm.generate(token_prompts(llm), SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == [] and out.outputs[0].text == ""
        assert out.outputs[0].finish_reason == "length"
        check(out, 2)


def test_prompt_logprobs_with_cached_prefix_and_generation():
    llm = LLM(max_model_len=256, block_size=8, enable_prefix_caching=True, dtype="float32")
    tok = llm.get_tokenizer()
    prefix = tok.encode(PROMPTS[3])
    # Fill the prefix cache, then score a prompt that starts with the cached blocks.
    llm.generate({"prompt_token_ids": prefix}, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    ids = prefix + tok.encode(" The dragon's name was Ember.")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    check(out, 0)


def test_prompt_logprobs_survive_preemption():
    # 10 blocks of 8 tokens for 4 requests of ~25 prompt + 24 output tokens: preemptions happen.
    llm = LLM(max_model_len=80, block_size=8, num_kv_blocks=10, enable_prefix_caching=False, dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(token_prompts(llm), params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for out in outs:
        check(out, 1)


def test_max_tokens_zero_is_validated():
    assert SamplingParams(max_tokens=0).max_tokens == 0
    with pytest.raises(ValueError, match="at least 0"):
        SamplingParams(max_tokens=-1)
