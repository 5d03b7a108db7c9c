"""The disk tier with a hybrid model (the tiny Qwen3.5 of tests/models/model_utils.py, float32):
a prefix's recurrent state checkpoints go to the tier when the slot pool hands them out again (or at
a clean shutdown), beside its pages, and a prefix evicted from memory resumes from them, in the same
run and after a restart, with the greedy output of a run without a tier and of one without prefix
caching. A damaged state file is a recompute and a counter."""
from __future__ import annotations

from pathlib import Path

import pytest
from engine.kv_tier_utils import random_docs, run_each, tier_args, tier_stats
from models.model_utils import TINY_QWEN3_5, make_random_hf_model
from transformers import AutoConfig

from pagellm import LLM, SamplingParams
from pagellm.core.block_hash import hash_full_blocks
from pagellm.core.kv_tier import state_tier_key
from pagellm.models.loader import default_model_path

pytestmark = pytest.mark.slow

NUM_DOCS, DOC_LEN, BLOCK = 3, 41, 4
HIT = (DOC_LEN - 1) // BLOCK * BLOCK  # 40: the last full prompt block, where a checkpoint is saved
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _docs() -> list[list[int]]:
    return random_docs(NUM_DOCS, DOC_LEN, 3, 128)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3.5")
    make_random_hf_model(AutoConfig.for_model("qwen3_5_text", **TINY_QWEN3_5), seed=1).save_pretrained(path)
    return str(path)


def _llm(model: str, tier_dir: Path | None, **kwargs) -> LLM:
    # 14 blocks of 4 tokens hold one document and its output: each evicts the one before. 5 state
    # slots: a live one and a document's three checkpoints (16, 32 and 40 tokens).
    return LLM(
        model=model, tokenizer=default_model_path(), dtype="float32", block_size=BLOCK, num_kv_blocks=14, num_state_slots=5,
        state_checkpoint_interval=16, max_model_len=56, **tier_args(tier_dir, 0.01), **kwargs,
    )


@pytest.fixture(scope="module")
def uncached(model) -> list[list[int]]:
    llm = _llm(model, None, enable_prefix_caching=False)
    try:
        return [tokens for tokens, _ in run_each(llm, _docs(), PARAMS)]
    finally:
        llm.shutdown()


def test_a_hybrid_prefix_resumes_from_its_state_in_the_tier_in_the_run_and_after_a_restart(model, uncached, tmp_path):
    docs, tier_dir = _docs(), tmp_path / "tier"
    llm = _llm(model, None)  # prefix caching in memory only: each document evicts the one before
    try:
        no_tier = run_each(llm, docs + docs, PARAMS)
        assert [t for t, _ in no_tier] == uncached + uncached and [hit for _, hit in no_tier[NUM_DOCS:]] == [0] * NUM_DOCS
    finally:
        llm.shutdown()

    llm = _llm(model, tier_dir)
    try:
        first, again = run_each(llm, docs, PARAMS), run_each(llm, docs, PARAMS)
        assert [t for t, _ in first] == uncached and [t for t, _ in again] == uncached
        assert [hit for _, hit in again] == [HIT] * NUM_DOCS  # pages and the state at 40 tokens, from the tier
        core, worker = tier_stats(llm)
        assert core.num_state_saves >= 3 * (NUM_DOCS - 1) and core.num_states_loaded == NUM_DOCS and core.num_states_failed == 0
        assert core.num_hit_tokens == NUM_DOCS * HIT and worker.num_corrupt == 0
    finally:
        llm.shutdown()  # writes the cached pages and checkpoints the tier lacks

    # Doc 0's state at 40 tokens damaged (a flipped payload byte, found when it loads).
    damaged_key = state_tier_key(hash_full_blocks(docs[0], BLOCK)[HIT // BLOCK - 1])
    (damaged,) = tier_dir.rglob(f"{damaged_key.hex()}.kv")
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    llm = _llm(model, tier_dir)
    try:
        assert damaged_key in llm.llm_engine.core.kv_cache_manager.tier.keys  # the start reads headers only
        result = run_each(llm, docs[:1], PARAMS)
        assert damaged_key not in llm.llm_engine.core.kv_cache_manager.tier.keys  # dropped when it failed to load
        result += run_each(llm, docs[1:], PARAMS)
        assert [t for t, _ in result] == uncached
        assert [hit for _, hit in result] == [0] + [HIT] * (NUM_DOCS - 1)  # doc 0 recomputed, the others from disk
        core, worker = tier_stats(llm)
        assert (core.num_states_failed, core.num_states_loaded, worker.num_corrupt) == (1, NUM_DOCS - 1, 1)
    finally:
        llm.shutdown()


def test_two_tensor_parallel_ranks_keep_their_share_of_each_state(model, uncached, tmp_path):
    docs, tier_dir = _docs(), tmp_path / "tier"
    llm = _llm(model, tier_dir, tensor_parallel_size=2)
    try:
        result = run_each(llm, docs + docs, PARAMS)
        assert [t for t, _ in result] == uncached + uncached
        assert [hit for _, hit in result[NUM_DOCS:]] == [HIT] * NUM_DOCS
    finally:
        llm.shutdown()
    llm = _llm(model, tier_dir, tensor_parallel_size=2)
    try:
        result = run_each(llm, docs, PARAMS)
        assert [t for t, _ in result] == uncached and [hit for _, hit in result] == [HIT] * NUM_DOCS
        assert tier_stats(llm)[0].num_states_loaded == NUM_DOCS
    finally:
        llm.shutdown()
