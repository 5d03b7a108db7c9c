"""Qwen3-Next and Qwen3.5 (dense and MoE) GGUF files, as llama.cpp's converter writes them (here
tests/models/gguf_writer.py), read back as the Hugging Face checkpoint: every tensor under its HF
name with its HF value (linear attention's split, reordered and transformed tensors included) and
the transformers config's fields, from tiny random checkpoints. The model classes are not needed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from gguf_writer import write_gguf
from model_utils import make_random_hf_model
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig

from pagellm.layers.gguf_types import GGUFWeight
from pagellm.models.gguf_config import load_gguf_config
from pagellm.models.gguf_loader import iter_gguf_weights

_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5},
)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
# name -> (model_type, fields): value heads outnumber key heads (Qwen3.5 then tiles them) and span
# whole Q8_0 blocks (32) or cut them (16: out_proj's columns cannot move as blocks); one layer pattern
# is not the every-4th default.
CONFIGS = {
    "qwen35": ("qwen3_5_text", dict(_COMMON, intermediate_size=96, linear_value_head_dim=32)),
    "qwen35-kv-equal": (
        "qwen3_5_text",
        dict(_COMMON, intermediate_size=96, linear_value_head_dim=16, linear_num_value_heads=2,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    ),
    "qwen35moe": ("qwen3_5_moe_text", dict(_COMMON, **_MOE, linear_value_head_dim=16)),
    "qwen3next": ("qwen3_next", dict(_COMMON, **_MOE, intermediate_size=96, linear_value_head_dim=32)),
}
_CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "layer_types", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings",
)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PretrainedConfig]:
    model_type, fields = CONFIGS[request.param]
    config = AutoConfig.for_model(model_type, **fields)
    path = tmp_path_factory.mktemp(request.param)
    make_random_hf_model(config, seed=3).save_pretrained(path)
    return path, AutoConfig.from_pretrained(path)


def _assert_value(name: str, tensor: torch.Tensor, original: torch.Tensor) -> None:
    """Equal, but for what the converter rounds: A_log stored as -exp(A_log) and the RMSNorms but
    the gated one as 1 + w, in float32 (exact for a bfloat16 checkpoint's norms; here float32's)."""
    if name.endswith("A_log") or (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")):
        torch.testing.assert_close(tensor, original, rtol=2e-7, atol=2 ** -24)
    else:
        assert torch.equal(tensor, original), name


def _qdq(t: torch.Tensor) -> torch.Tensor:
    """The tensor through Q8_0 blocks and back, as the file holds it."""
    q = quantize(t.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(dequantize(q, GGMLQuantizationType.Q8_0))).reshape(t.shape)


def test_config_matches_the_checkpoint(checkpoint: tuple[Path, PretrainedConfig], tmp_path: Path) -> None:
    path, hf_config = checkpoint
    ours = load_gguf_config(str(write_gguf(path, hf_config, tmp_path / "model.gguf")))
    assert type(ours) is type(hf_config) and ours.architectures == hf_config.architectures
    for field in _CONFIG_FIELDS:
        if hasattr(hf_config, field):
            assert getattr(ours, field) == getattr(hf_config, field), field
    assert ours.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    rope = {k: ours.rope_parameters[k] for k in ("rope_type", "rope_theta", "partial_rotary_factor")}
    assert rope == {k: hf_config.rope_parameters[k] for k in rope}


def test_f32_file_gives_the_checkpoint_tensors(checkpoint: tuple[Path, PretrainedConfig], tmp_path: Path) -> None:
    path, hf_config = checkpoint
    gguf_path = str(write_gguf(path, hf_config, tmp_path / "model.gguf"))
    original = load_file(str(path / "model.safetensors"))
    ours = list(iter_gguf_weights(gguf_path, load_gguf_config(gguf_path)))
    assert len({name for name, _ in ours}) == len(ours)
    assert {name for name, _ in ours} == set(original)
    for name, tensor in ours:
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32, name
        assert tensor.shape == original[name].shape, name
        _assert_value(name, tensor, original[name])


def test_q8_file_keeps_linear_weights_in_blocks(checkpoint: tuple[Path, PretrainedConfig], tmp_path: Path) -> None:
    path, hf_config = checkpoint
    gguf_path = str(write_gguf(path, hf_config, tmp_path / "model.gguf", GGMLQuantizationType.Q8_0))
    original = load_file(str(path / "model.safetensors"))
    ours = dict(iter_gguf_weights(gguf_path, load_gguf_config(gguf_path)))
    assert set(ours) == set(original)
    blocks_cut = hf_config.linear_value_head_dim % 32 != 0
    for name, tensor in ours.items():
        if blocks_cut and name.endswith("linear_attn.out_proj.weight") and hf_config.model_type != "qwen3_next" and (
            hf_config.linear_num_value_heads != hf_config.linear_num_key_heads
        ):
            # value heads reordered across Q8_0 blocks: dequantized, the quantization's error only
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
            torch.testing.assert_close(tensor, original[name], rtol=0, atol=4e-3)
            continue
        if name.endswith("proj.weight") and original[name].shape[-1] % 32 == 0:  # linear weights (the file quantized them) stay in blocks
            assert isinstance(tensor, GGUFWeight), name
        if isinstance(tensor, GGUFWeight):
            assert torch.equal(tensor.dequantize().reshape(original[name].shape), _qdq(original[name])), name
        else:
            _assert_value(name, tensor.float(), original[name])


def test_mtp_blocks_and_fused_gguf_variants(tmp_path: Path) -> None:
    """The converter's options: --fuse-qkv (a full-attention layer's q/k/v as one attn_qkv) and
    --fuse-gate-up-exps; MTP blocks appended after the trunk's are skipped, and their count is
    taken off the layer count."""
    model_type, fields = CONFIGS["qwen35moe"]
    config = AutoConfig.for_model(model_type, **fields)
    make_random_hf_model(config, seed=5).save_pretrained(tmp_path / "hf")
    gguf_path = str(write_gguf(tmp_path / "hf", config, tmp_path / "model.gguf", fuse_qkv=True, fuse_gate_up_exps=True, mtp_layers=1))
    ours_config = load_gguf_config(gguf_path)
    assert ours_config.num_hidden_layers == 4 and ours_config.layer_types == config.layer_types
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ours = dict(iter_gguf_weights(gguf_path, ours_config))
    assert set(ours) == set(original)
    for name, tensor in ours.items():
        _assert_value(name, tensor, original[name])
