"""Random PEFT adapters on the default model, made with peft itself, and their merged oracles."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from hf_oracle import hf_model_and_tokenizer

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Adapter:
    path: str
    merged: torch.nn.Module  # transformers' model with the adapter merged in (merge_and_unload)


def make_adapter(out_dir: Path, rank: int, targets: list[str], seed: int, b_scale: float = 1.0, **config) -> Adapter:
    """A random LoRA (A and B both random: ``init_lora_weights=False``) on a copy of transformers'
    float32 load of the default GGUF, saved as a PEFT directory; B times ``b_scale``."""
    from peft import LoraConfig, get_peft_model

    base, _ = hf_model_and_tokenizer()
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config)
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft_model.save_pretrained(str(out_dir))
    return Adapter(str(out_dir), peft_model.merge_and_unload().eval())


def module_shapes() -> dict[str, tuple[int, int]]:
    """(in, out) of each targetable module of the default model, from its config."""
    from pagellm.models.loader import default_model_path, load_hf_config

    cfg = load_hf_config(default_model_path())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    hidden, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * head_dim, cfg.intermediate_size
    return {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def write_random_adapter(out_dir: Path, rank: int, targets: list[str], seed: int, std: float = 0.02, **config) -> str:
    """A PEFT directory written by hand (no model needed): random A and B of the default model's
    shapes for every layer, as peft names and stores them."""
    import json

    from safetensors.torch import save_file

    from pagellm.models.loader import default_model_path, load_hf_config

    num_layers = load_hf_config(default_model_path()).num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (fan_in, fan_out) in module_shapes().items():
            if module.rsplit(".", 1)[-1] not in targets:
                continue
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none", **config}
    (out_dir / "adapter_config.json").write_text(json.dumps(meta))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return str(out_dir)
