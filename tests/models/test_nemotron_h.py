"""Nemotron-H beyond tests/models/test_hybrid_models.py's engine runs: the config of a GGUF file as
llama.cpp's converter writes it (block kinds from the per-layer arrays, the Mamba dims, the routing),
a checkpoint with an MTP head and the routing bias under the router's name, and what is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writer import write_gguf
from model_utils import make_random_hf_model
from safetensors.torch import load_file, save_file
from test_hybrid_models import CONFIGS

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.models.gguf_config import load_gguf_config
from pagellm.models.loader import load_model
from pagellm.models.nemotron_h import NemotronHForCausalLM
from pagellm.models.shape import ModelShape

_FIELDS = (
    "layers_block_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_num_heads",
    "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "tie_word_embeddings", "architectures",
)
_MOE_FIELDS = (
    "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_shared_experts",
    "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
)


@pytest.mark.parametrize("name", ["nemotron-h", "nemotron-h-moe"])
def test_gguf_config_states_the_blocks_dims_and_routing(name: str, tmp_path: Path) -> None:
    config = CONFIGS[name]()
    make_random_hf_model(config, seed=0).save_pretrained(tmp_path / "hf")
    ours = load_gguf_config(str(write_gguf(tmp_path / "hf", config, tmp_path / "model.gguf")))
    moe = "moe" in config.layers_block_type
    for field in _FIELDS + (_MOE_FIELDS if moe else ("intermediate_size",)):
        assert getattr(ours, field) == getattr(config, field), field
    assert ours.layer_norm_epsilon == pytest.approx(config.layer_norm_epsilon)  # a float32 in the file
    shape = ModelShape.from_hf_config(ours)
    assert shape.state_layer_ids == tuple(i for i, t in enumerate(config.layers_block_type) if t == "linear_attention")
    assert shape.no_cache_layer_ids == tuple(i for i, t in enumerate(config.layers_block_type) if t in ("mlp", "moe"))
    assert shape.kv_layer_ids == (config.layers_block_type.index("full_attention"),)


def test_checkpoint_with_an_mtp_head_loads_the_trunk_and_the_routing_bias(tmp_path: Path) -> None:
    config = CONFIGS["nemotron-h-moe"]()
    hf_model = make_random_hf_model(config, seed=0)
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    bias = torch.linspace(-0.2, 0.2, config.n_routed_experts)
    tensors["backbone.layers.1.mixer.gate.e_score_correction_bias"] = bias
    tensors["mtp.layers.0.eh_proj.weight"] = torch.zeros(config.hidden_size, 2 * config.hidden_size)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(str(tmp_path), config, torch.float32, torch.device("cpu"), TorchReferenceBackend())
    assert torch.equal(model.model.layers[1].mixer.e_score_correction_bias, bias)
    assert torch.equal(model.model.embed_tokens.weight, tensors["backbone.embeddings.weight"])


def test_unsupported_blocks_and_latent_experts_are_refused() -> None:
    config = CONFIGS["nemotron-h-moe"]()
    config.moe_latent_size = 16
    with pytest.raises(ValueError, match="latent"):
        NemotronHForCausalLM(config, TorchReferenceBackend())
    config = CONFIGS["nemotron-h"]()
    config.layers_block_type = ["linear_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="sliding_attention"):
        NemotronHForCausalLM(config, TorchReferenceBackend())
