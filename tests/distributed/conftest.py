"""Distributed tests reuse the server helpers of the entrypoint tests, and share a tiny model."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "entrypoints"))

VOCAB = 49155  # the packaged tokenizer's 49152 ids, plus 3 rows that only pad
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 96, 6, 3, 101, 2


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    head_dim = HIDDEN // HEADS

    def w(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0), "lm_head.weight": w(VOCAB, HIDDEN, scale=0.5)}
    tensors["model.norm.weight"] = 1 + w(HIDDEN, scale=0.1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, rows in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = w(rows, HIDDEN)
            tensors[f"{p}self_attn.{name}_proj.bias"] = w(rows, scale=0.1)
        tensors[f"{p}self_attn.o_proj.weight"] = w(HIDDEN, HEADS * head_dim)
        tensors[f"{p}self_attn.o_proj.bias"] = w(HIDDEN, scale=0.1)
        for name in ("gate", "up"):
            tensors[f"{p}mlp.{name}_proj.weight"] = w(INTER, HIDDEN)
            tensors[f"{p}mlp.{name}_proj.bias"] = w(INTER, scale=0.1)
        tensors[f"{p}mlp.down_proj.weight"] = w(HIDDEN, INTER)
        tensors[f"{p}mlp.down_proj.bias"] = w(HIDDEN, scale=0.1)
        tensors[f"{p}input_layernorm.weight"] = 1 + w(HIDDEN, scale=0.1)
        tensors[f"{p}post_attention_layernorm.weight"] = 1 + w(HIDDEN, scale=0.1)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)
