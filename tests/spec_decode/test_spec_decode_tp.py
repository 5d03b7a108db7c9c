"""n-gram speculation under tensor parallelism (two gloo ranks): rank 0 verifies, every rank takes
its tokens, and greedy output equals plain decoding on the float32 path, on two ranks and on one."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat: one two three four five six seven eight. Repeat: one two three four five six seven eight. Repeat:",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=32)
ENGINE = dict(num_kv_blocks=256, max_num_seqs=8, max_model_len=512, dtype="float32", tensor_parallel_size=2)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}


def _generate(**kwargs):
    llm = LLM(**{**ENGINE, **kwargs})
    try:
        outputs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        return outputs, llm.llm_engine.core.scheduler.stats().spec_decoding
    finally:
        llm.shutdown()


def test_tp2_speculation_equals_tp2_plain_and_tp1():
    plain, _ = _generate()
    spec, stats = _generate(speculative_config=NGRAM)
    one_rank, _ = _generate(tensor_parallel_size=1)
    assert spec == plain
    assert spec == one_rank
    assert stats.num_drafts > 5 and stats.num_accepted_tokens > 0, stats
