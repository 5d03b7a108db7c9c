"""PEFT adapter directories: what is read, how it is scaled, and what is refused with a reason."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from pagellm.lora.peft_adapter import SUPPORTED_TARGETS, load_peft_adapter, parse_peft_config

PREFIX = "base_model.model.model.layers.0"


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


def test_loads_modules_with_the_scaling_folded_into_b(tmp_path):
    a, b = torch.randn(4, 16), torch.randn(8, 4)
    path = write_adapter(
        tmp_path / "a",
        {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]},
        {
            f"{PREFIX}.self_attn.q_proj.lora_A.weight": a,
            f"{PREFIX}.self_attn.q_proj.lora_B.weight": b,
            f"{PREFIX}.mlp.down_proj.lora_A.weight": a.clone(),
            f"{PREFIX}.mlp.down_proj.lora_B.weight": b.clone(),
        },
    )
    adapter = load_peft_adapter(path, max_lora_rank=16)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert sorted(adapter.modules) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    weights = adapter.modules["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(weights.lora_a, a)
    torch.testing.assert_close(weights.lora_b, 2.0 * b)


def test_scaling_rules():
    assert parse_peft_config({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, 16)[1] == 2.0
    assert parse_peft_config({"r": 16, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj"]}, 16)[1] == 16 / math.sqrt(16)
    assert parse_peft_config({"r": 8, "lora_alpha": 8, "target_modules": "all-linear"}, 16)[2] == SUPPORTED_TARGETS


@pytest.mark.parametrize(
    "config, message",
    [
        ({"r": 32, "target_modules": ["q_proj"]}, "greater than max_lora_rank=16"),
        ({"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 8, "target_modules": ["q_proj"], "bias": "all"}, "bias"),
        ({"r": 8, "target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
        ({"r": 8, "target_modules": ["embed_tokens"]}, "not supported"),
        ({"r": 8, "target_modules": ".*proj"}, "only a list"),
        ({"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"r": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}, "not LoRA"),
    ],
)
def test_refused_configs(config, message):
    with pytest.raises(ValueError, match=message):
        parse_peft_config({"lora_alpha": 16, **config}, max_lora_rank=16)


def test_refused_tensors_and_directories(tmp_path):
    with pytest.raises(ValueError, match="PEFT directory"):
        load_peft_adapter(str(tmp_path / "missing"), 16)
    config = {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]}
    embed = write_adapter(tmp_path / "e", config, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(2, 4)})
    with pytest.raises(ValueError, match="not a lora_A / lora_B"):
        load_peft_adapter(embed, 16)
    half = write_adapter(tmp_path / "h", config, {f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(2, 4)})
    with pytest.raises(ValueError, match="lacks lora_B"):
        load_peft_adapter(half, 16)
    wrong_rank = write_adapter(
        tmp_path / "w",
        config,
        {f"{PREFIX}.self_attn.q_proj.lora_A.weight": torch.randn(3, 4), f"{PREFIX}.self_attn.q_proj.lora_B.weight": torch.randn(4, 3)},
    )
    with pytest.raises(ValueError, match="not of rank 2"):
        load_peft_adapter(wrong_rank, 16)
