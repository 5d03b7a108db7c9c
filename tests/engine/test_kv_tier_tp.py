"""The disk tier under two tensor-parallel ranks (CPU, float32): each rank keeps its share of every
page in its own directory; the scheduler sees one tier. Evicted prefixes come back from both ranks
with the output of a run without a tier; a clean shutdown leaves every page on both ranks, which a
restart finds; a file damaged on one rank only is a recompute on all, and a counter."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine.kv_tier_utils import random_docs, run_each, tier_args, tier_stats
from models.model_utils import make_random_hf_model
from transformers import LlamaConfig

from pagellm import LLM, SamplingParams
from pagellm.core.block_hash import hash_full_blocks
from pagellm.models.loader import default_model_path

pytestmark = pytest.mark.slow

NUM_DOCS, DOC_LEN, BLOCK = 4, 50, 16
NUM_FULL = (DOC_LEN - 1) // BLOCK  # blocks a repeat of a document can take from the cache
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _docs() -> list[list[int]]:
    return random_docs(NUM_DOCS, DOC_LEN, 3, 256)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, max_position_embeddings=256,
    )
    make_random_hf_model(config, seed=0).save_pretrained(path)
    return str(path)


def _llm(model: str, tier_dir: Path | None) -> LLM:
    # 5 blocks of 16 tokens: one document (and its output) at a time, so each evicts the one before.
    return LLM(
        model=model, tokenizer=default_model_path(), dtype="float32", tensor_parallel_size=2, num_kv_blocks=5, max_model_len=64,
        **tier_args(tier_dir, 0.01),
    )


def _rank_dirs(tier_dir: Path) -> dict[int, Path]:
    """Each rank's directory, by the rank its identity names."""
    dirs = {}
    for ident in tier_dir.glob("*/identity.json"):
        tp_size, rank = json.loads(ident.read_text())["identity"]["tensor_parallel"]
        assert tp_size == 2
        dirs[rank] = ident.parent
    return dirs


@pytest.fixture(scope="module")
def cold(model) -> list[list[int]]:
    llm = _llm(model, None)
    try:
        return [tokens for tokens, _ in run_each(llm, _docs(), PARAMS)]
    finally:
        llm.shutdown()


def test_two_ranks_serve_evicted_prefixes_keep_them_across_a_restart_and_recompute_a_page_damaged_on_one(model, cold, tmp_path):
    tier_dir, docs = tmp_path / "tier", _docs()
    llm = _llm(model, tier_dir)
    try:
        first, again = run_each(llm, docs, PARAMS), run_each(llm, docs, PARAMS)
        assert [t for t, _ in first] == cold and [t for t, _ in again] == cold
        assert [hit for _, hit in first] == [0] * NUM_DOCS
        assert [hit for _, hit in again] == [NUM_FULL * BLOCK] * NUM_DOCS  # doc 0 from the tier, the others too
        core, worker = tier_stats(llm)
        assert core.num_blocks_loaded >= NUM_DOCS * NUM_FULL - 1 and core.num_blocks_failed == 0
        assert core.num_hit_tokens == core.num_blocks_loaded * BLOCK and worker.bytes_read > 0
    finally:
        llm.shutdown()  # writes what is still cached, on both ranks
    dirs = _rank_dirs(tier_dir)
    names = {rank: sorted(p.name for p in d.rglob("*.kv")) for rank, d in dirs.items()}
    assert sorted(names) == [0, 1] and names[0] == names[1]
    assert set(names[0]) == {f"{h.hex()}.kv" for doc in docs for h in hash_full_blocks(doc, BLOCK)}

    # Doc 0's first page, damaged on rank 1 only: a flipped payload byte, which only the load finds.
    (damaged,) = dirs[1].rglob(f"{hash_full_blocks(docs[0], BLOCK)[0].hex()}.kv")
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    llm = _llm(model, tier_dir)
    try:
        core, _ = tier_stats(llm)
        assert core.num_keys == NUM_DOCS * (DOC_LEN // BLOCK)  # found on both ranks
        result = run_each(llm, docs, PARAMS)
        assert [t for t, _ in result] == cold
        assert [hit for _, hit in result] == [0] + [NUM_FULL * BLOCK] * (NUM_DOCS - 1)
        core, worker = tier_stats(llm)
        assert worker.num_corrupt == 1
        assert (core.num_blocks_failed, core.num_blocks_loaded) == (NUM_FULL, NUM_FULL * (NUM_DOCS - 1))
    finally:
        llm.shutdown()
