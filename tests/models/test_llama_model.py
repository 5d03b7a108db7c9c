"""Our Llama-family models against transformers, through the paged cache, for each architecture."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from model_utils import PagedDriver, make_random_hf_model
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagellm.models.loader import load_hf_config, load_model

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256)


def _configs() -> dict[str, PretrainedConfig]:
    return {
        "llama-tied-default": LlamaConfig(**_TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "llama-untied-linear-bias": LlamaConfig(
            **_TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        "llama3-rope-head-dim": LlamaConfig(
            **_TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # q width 128 != hidden 64
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 500000.0,
            },
        ),
        "llama-yarn": LlamaConfig(
            **_TINY,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        ),
        "mistral-mha": MistralConfig(
            **_TINY, num_attention_heads=4, num_key_value_heads=4, head_dim=16, sliding_window=None, tie_word_embeddings=False
        ),
        "qwen2-mqa-bias": Qwen2Config(**_TINY, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    }


_EXPECTED_CLASS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


@pytest.mark.parametrize("name", list(_configs()))
def test_paged_prefill_and_decode_match_transformers(name: str, tmp_path: Path) -> None:
    config = _configs()[name]
    hf_model = make_random_hf_model(config, seed=1)
    hf_model.save_pretrained(tmp_path)

    loaded_config = load_hf_config(str(tmp_path))
    model = load_model(str(tmp_path), loaded_config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    assert type(model) is _EXPECTED_CLASS[config.model_type]
    assert model.tie_word_embeddings == config.tie_word_embeddings
    if config.tie_word_embeddings:  # the head multiplies by the embedding table itself, no copy
        assert model.lm_head.weight is model.model.embed_tokens.dense

    rng = random.Random(0)
    seqs = {0: [rng.randrange(128) for _ in range(13)], 1: [rng.randrange(128) for _ in range(16)]}
    with torch.no_grad():
        reference = {i: hf_model(torch.tensor([toks])).logits[0] for i, toks in seqs.items()}

    driver = PagedDriver(model, loaded_config, block_size=4, seed=3)
    # (seq, start, end) per step: a full prefill next to a chunked one, then a chunk next to a
    # decode, then pure decodes, so prefill, chunked prefill and decode all read the paged cache.
    schedule = [
        [(0, 0, 9), (1, 0, 6)],
        [(0, 9, 10), (1, 6, 12)],
        [(1, 12, 13), (0, 10, 11)],
        [(0, 11, 12), (1, 13, 14)],
        [(0, 12, 13), (1, 14, 15)],
        [(1, 15, 16)],
    ]
    for step in schedule:
        logits = driver.step([(seq, seqs[seq][start:end]) for seq, start, end in step])
        offset = 0
        for seq, start, end in step:
            ours = logits[offset : offset + end - start]
            offset += end - start
            torch.testing.assert_close(ours, reference[seq][start:end], atol=1e-4, rtol=1e-4)
    # The scattered block tables really were non-trivial.
    assert driver.blocks[0] != sorted(driver.blocks[0]) or driver.blocks[1] != sorted(driver.blocks[1])


def test_bf16_model_runs_close_to_fp32(tmp_path: Path) -> None:
    config = _configs()["llama-tied-default"]
    make_random_hf_model(config, seed=2).save_pretrained(tmp_path)
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), dtype, torch.device("cpu"), TorchReferenceBackend())
        assert all(p.dtype == dtype for p in model.parameters())
        logits = PagedDriver(model, config).step([(0, list(range(10)))])
        assert logits.dtype == torch.float32
        outputs[dtype] = logits
    torch.testing.assert_close(outputs[torch.bfloat16], outputs[torch.float32], atol=0.15, rtol=0.05)


def test_forward_rejects_wrong_number_of_kv_caches(tmp_path: Path) -> None:
    config = _configs()["llama-tied-default"]
    make_random_hf_model(config).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), torch.float32, torch.device("cpu"), TorchReferenceBackend())
    driver = PagedDriver(model, config)
    driver.kv_caches = driver.kv_caches[:1]
    with pytest.raises(ValueError, match="one KV cache per layer"):
        driver.step([(0, [1, 2, 3])])


def test_load_weights_reports_missing_unknown_and_misshapen() -> None:
    config = _configs()["llama-untied-linear-bias"]
    config.architectures = ["LlamaForCausalLM"]
    hf_state = make_random_hf_model(config).state_dict()
    backend = TorchReferenceBackend()

    loaded = LlamaForCausalLM(config, backend).load_weights(hf_state.items())
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded and "lm_head.weight" in loaded

    partial = {k: v for k, v in hf_state.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        LlamaForCausalLM(config, backend).load_weights(partial.items())
    with pytest.raises(ValueError, match="no matching parameter"):
        LlamaForCausalLM(config, backend).load_weights([*hf_state.items(), ("model.layers.0.extra.weight", torch.zeros(1))])
    bad = dict(hf_state)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="has shape"):
        LlamaForCausalLM(config, backend).load_weights(bad.items())


def test_load_weights_takes_an_fp8_checkpoints_kv_scales() -> None:
    # The names fp8 quantizers write (compressed-tensors, AutoFP8, the old shared kv_scale).
    config = _configs()["llama-untied-linear-bias"]
    hf_state = make_random_hf_model(config).state_dict()
    model = LlamaForCausalLM(config, TorchReferenceBackend())
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16),
    }
    model.load_weights([*hf_state.items(), *scales.items()])
    assert [(s.k_scale, s.v_scale) for s in model.kv_scales()] == [(0.5, 0.25), (2.0, 2.0)]
    with pytest.raises(ValueError, match="one number"):
        LlamaForCausalLM(config, TorchReferenceBackend()).load_weights(
            [*hf_state.items(), ("model.layers.0.self_attn.k_scale", torch.ones(2))]
        )


def test_fused_projections_hold_the_checkpoint_rows() -> None:
    config = _configs()["qwen2-mqa-bias"]
    hf_state = make_random_hf_model(config).state_dict()
    model = Qwen2ForCausalLM(config, TorchReferenceBackend())
    model.load_weights(hf_state.items())
    attn = model.model.layers[1].self_attn
    qkv_bias = torch.cat([hf_state[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, qkv_bias)
    assert attn.o_proj.bias is None
    gate_up = torch.cat([hf_state["model.layers.1.mlp.gate_proj.weight"], hf_state["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight, gate_up)
