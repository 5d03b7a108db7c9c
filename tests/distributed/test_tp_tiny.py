"""Tensor parallelism on a tiny random Llama with every awkward split: 3 KV heads over 2 ranks,
an odd intermediate size, a vocabulary that pads the last rank's rows, and biases on q/k/v, o
and the MLP (row-parallel biases must be added once). Small enough to run in seconds."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path

VOCAB = 49155  # the packaged tokenizer's 49152 ids, plus 3 rows that only pad
HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 96, 6, 3, 101, 2


@pytest.fixture(scope="module")
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


def _run(model: str, **kwargs):
    llm = LLM(model=model, tokenizer=default_model_path(), num_kv_blocks=64, max_num_seqs=4, max_model_len=128, **kwargs)
    try:
        prompts = [{"prompt_token_ids": [5 + 7 * i + j for j in range(3 + 9 * i)]} for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_tiny_tp2_matches_tp1(tiny_model):
    ref = _run(tiny_model)
    tp2 = _run(tiny_model, tensor_parallel_size=2)
    for r, t in zip(ref, tp2):
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, t.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a)
        for a, b in zip(r.prompt_logprobs[1:], t.prompt_logprobs[1:]):
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a.keys() & b.keys())
