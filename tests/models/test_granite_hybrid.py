"""Granite 4.0-H beyond tests/models/test_hybrid_models.py's configs (which are NoPE, as the released
models): a checkpoint whose attention rotates (``position_embedding_type: rope``, which llama.cpp's
converter cannot state), greedy against transformers under chunked prefill with logprobs to float32
noise; and the config of a GGUF file as the converter writes it."""
from __future__ import annotations

from pathlib import Path

import pytest
from gguf_writer import write_gguf
from hf_oracle import hf_greedy_uncached
from model_utils import make_random_hf_model
from test_hybrid_models import _GRANITE, _prompts
from transformers import AutoConfig

from pagellm import LLM, SamplingParams
from pagellm.models.gguf_config import load_gguf_config
from pagellm.models.loader import default_model_path


def test_rotary_attention_matches_transformers(tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        "granitemoehybrid", **{**_GRANITE, "position_embedding_type": "rope"}, num_local_experts=0, shared_intermediate_size=96,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
    )
    hf_model = make_random_hf_model(config, seed=2)
    hf_model.save_pretrained(tmp_path)
    prompts = _prompts()[:2]
    reference = [hf_greedy_uncached(hf_model, p, 6) for p in prompts]
    llm = LLM(model=str(tmp_path), tokenizer=default_model_path(), dtype="float32", max_model_len=96, block_size=4,
              max_num_batched_tokens=16, num_kv_blocks=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for ours, ref in zip(outputs, reference):
        assert ours.outputs[0].token_ids == ref.token_ids
        for got, want in zip(ours.outputs[0].logprobs, ref.top_logprobs):
            assert max(abs(got[k].logprob - want[k]) for k in got.keys() & want.keys()) < 1e-4


def test_gguf_config_states_the_layers_dims_and_multipliers(tmp_path: Path) -> None:
    config = AutoConfig.for_model("granitemoehybrid", **_GRANITE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                  shared_intermediate_size=48)
    model_dir = tmp_path / "hf"
    make_random_hf_model(config, seed=0).save_pretrained(model_dir)
    ours = load_gguf_config(str(write_gguf(model_dir, config, tmp_path / "model.gguf")))
    for field in ("layer_types", "num_key_value_heads", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                  "mamba_d_conv", "mamba_expand", "num_local_experts", "num_experts_per_tok", "intermediate_size",
                  "shared_intermediate_size", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                  "logits_scaling", "position_embedding_type", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(config, field), field
    assert ours.rms_norm_eps == pytest.approx(config.rms_norm_eps)  # a float32 in the file
    assert ours.architectures == ["GraniteMoeHybridForCausalLM"]
