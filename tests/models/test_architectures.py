"""Every architecture beyond Llama's family against transformers on the same random weights:
through the paged cache (chunked prefill beside decodes, scattered blocks, prompts longer than
the sliding window), from safetensors and from a GGUF file written as llama.cpp writes it."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_writer import write_gguf
from model_utils import PagedDriver, make_random_hf_model
from transformers import AutoConfig, PretrainedConfig

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.config import LinearPrecision
from pagellm.layers.linear_method import GGUFInt8Method
from pagellm.layers.moe import FusedMoE
from pagellm.models.loader import load_hf_config, load_model
from pagellm.models.shape import ModelShape

_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
_WINDOW = 7  # shorter than the prompts and not a multiple of the block size
_SLIDING, _FULL = "sliding_attention", "full_attention"
_GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
}


def _config(model_type: str, **fields) -> Callable[[], PretrainedConfig]:
    return lambda: AutoConfig.for_model(model_type, **{**_TINY, "num_hidden_layers": 3, **fields})


# name -> (config, whether llama.cpp's GGUF form can state it). GGUF has no field for Gemma's
# query scale or a free layer pattern (llama.cpp assumes 1/sqrt(head_dim), five sliding to one).
CONFIGS: dict[str, tuple[Callable[[], PretrainedConfig], bool]] = {
    "qwen3": (_config("qwen3", tie_word_embeddings=True), True),
    "qwen3-moe": (
        _config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1),
        True,
    ),
    "qwen3-moe-dense-layer-unnormed": (
        _config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1]),
        False,
    ),
    "mixtral": (_config("mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None), True),
    "gemma3": (
        _config(
            "gemma3_text",
            num_hidden_layers=6,
            sliding_window=_WINDOW,
            query_pre_attn_scalar=16,
            rope_parameters={**_GEMMA_ROPE, "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        ),
        True,
    ),
    "gemma3-free-pattern-scaled": (
        _config(
            "gemma3_text",
            num_hidden_layers=4,
            sliding_window=_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            rope_parameters=_GEMMA_ROPE,
            final_logit_softcapping=5.0,
        ),
        False,
    ),
    # Gemma 4: a wider-head full layer with proportional RoPE, per-layer inputs, the last two
    # layers reading the KV of layers 1 and 2.
    "gemma4": (
        _config(
            "gemma4_text",
            num_hidden_layers=6,
            layer_types=[_SLIDING, _SLIDING, _FULL, _SLIDING, _SLIDING, _FULL],
            sliding_window=_WINDOW,
            global_head_dim=32,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=128,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            final_logit_softcapping=30.0,
        ),
        True,
    ),
    # Gemma 4 26B-A4B-style: full layers with fewer, wider KV heads whose values are the keys'
    # projection; experts beside every dense MLP; no per-layer inputs, no KV sharing.
    "gemma4-moe-k-eq-v": (
        _config(
            "gemma4_text",
            num_hidden_layers=4,
            num_key_value_heads=4,
            layer_types=[_SLIDING, _FULL, _SLIDING, _FULL],
            sliding_window=_WINDOW,
            global_head_dim=32,
            attention_k_eq_v=True,
            num_global_key_value_heads=2,
            hidden_size_per_layer_input=0,
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
        True,
    ),
    "phi3-partial-rotary": (
        _config("phi3", pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        True,
    ),
    "phi3-window-longrope": (
        _config(
            "phi3",
            pad_token_id=0,
            sliding_window=_WINDOW,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [2.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 64,
            },
        ),
        True,
    ),
    # Sinks, a window on every other layer, router and expert biases, YaRN.
    "gpt-oss": (
        _config(
            "gpt_oss",
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=_WINDOW,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
        True,
    ),
}
GGUF_CONFIGS = [name for name, (_, in_gguf) in CONFIGS.items() if in_gguf]


def _checkpoint(name: str, tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    config = CONFIGS[name][0]()
    hf_model = make_random_hf_model(config, seed=1)
    hf_model.save_pretrained(tmp_path)
    return hf_model, tmp_path


def _assert_exact(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def _assert_quantized_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """8-bit weights and inputs: each side's best token in the other's top-5 (vLLM's rule), and
    the same direction (0.9995 typically; a token whose top-k experts flip moves further)."""
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cosine.min() > 0.9
    for a, b in zip(ours, ref):
        assert int(a.argmax()) in b.topk(5).indices.tolist() and int(b.argmax()) in a.topk(5).indices.tolist()


def _check_paged_logits(
    model: torch.nn.Module, hf_model: torch.nn.Module, compare: Callable[[torch.Tensor, torch.Tensor], None] = _assert_exact
) -> None:
    rng = random.Random(0)
    seqs = {0: [rng.randrange(128) for _ in range(21)], 1: [rng.randrange(128) for _ in range(26)]}
    with torch.no_grad():
        reference = {i: hf_model(torch.tensor([toks])).logits[0] for i, toks in seqs.items()}
    driver = PagedDriver(model, model.config, block_size=4, seed=3)
    # A full prefill beside a chunked one, chunks beside decodes, then decodes past the window.
    schedule = [[(0, 0, 9), (1, 0, 6)], [(0, 9, 10), (1, 6, 15)], [(1, 15, 20), (0, 10, 11)]]
    schedule += [[(0, 11 + i, 12 + i), (1, 20 + i, 21 + i)] for i in range(6)] + [[(0, 17, 21)]]
    for step in schedule:
        logits = driver.step([(seq, seqs[seq][start:end]) for seq, start, end in step])
        offset = 0
        for seq, start, end in step:
            compare(logits[offset : offset + end - start], reference[seq][start:end])
            offset += end - start


@pytest.mark.parametrize("name", list(CONFIGS))
def test_safetensors_checkpoint_matches_transformers(name: str, tmp_path: Path) -> None:
    hf_model, path = _checkpoint(name, tmp_path)
    config = load_hf_config(str(path))
    model = load_model(str(path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    assert type(model).__name__ == hf_model.config.architectures[0]
    _check_paged_logits(model, hf_model)


@pytest.mark.parametrize("name", GGUF_CONFIGS)
def test_gguf_file_matches_transformers(name: str, tmp_path: Path) -> None:
    hf_model, path = _checkpoint(name, tmp_path / "hf")
    gguf_path = write_gguf(path, hf_model.config, tmp_path / "model.gguf")
    config = load_hf_config(str(gguf_path))
    assert config.architectures == hf_model.config.architectures
    assert ModelShape.from_hf_config(config) == ModelShape.from_hf_config(hf_model.config)
    model = load_model(str(gguf_path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    _check_paged_logits(model, hf_model)


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_gguf_experts_stay_in_their_blocks_on_the_int8_path(name: str, tmp_path: Path) -> None:
    """Q8_0 experts are repacked for the int8 kernels like any dense layer's weight, and the
    model stays close to its float32 reference."""
    hf_model, path = _checkpoint(name, tmp_path / "hf")
    gguf_path = write_gguf(path, hf_model.config, tmp_path / "model.gguf", GGMLQuantizationType.Q8_0)
    config = load_hf_config(str(gguf_path))
    int8 = LinearPrecision("int8", "float32")
    model = load_model(str(gguf_path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend(), int8)
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == hf_model.config.num_hidden_layers
    for moe in moes:
        for expert in moe.experts:
            assert isinstance(expert.gate_up_proj.method, GGUFInt8Method)
            assert isinstance(expert.down_proj.method, GGUFInt8Method)
    _check_paged_logits(model, hf_model, _assert_quantized_close)


def test_gemma3_image_text_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration: the decoder loads as Gemma3ForCausalLM
    under its text names, and the vision tower is left unread."""
    from transformers import Gemma3Config

    text = dict(_TINY, num_hidden_layers=3, sliding_window=_WINDOW, query_pre_attn_scalar=16, vocab_size=128)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    hf_model = make_random_hf_model(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4), seed=1)
    hf_model.save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config.architectures == ["Gemma3ForCausalLM"] and config.tie_word_embeddings
    model = load_model(str(tmp_path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    _check_paged_logits(model, hf_model)


def test_gemma4_image_text_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 4 ships as Gemma4ForConditionalGeneration: the decoder loads as Gemma4ForCausalLM under
    its text names; the vision tower and the image embedder are left unread."""
    from transformers import Gemma4Config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    hf_model = make_random_hf_model(Gemma4Config(text_config=CONFIGS["gemma4"][0]().to_dict(), vision_config=vision), seed=1)
    hf_model.save_pretrained(tmp_path)
    config = load_hf_config(str(tmp_path))
    assert config.architectures == ["Gemma4ForCausalLM"] and config.tie_word_embeddings
    model = load_model(str(tmp_path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    _check_paged_logits(model, hf_model)
