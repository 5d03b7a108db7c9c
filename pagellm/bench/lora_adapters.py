"""Random PEFT LoRA adapters for a model's shapes, written in peft's own layout, for benchmarks and
tests that need many adapters without training (or loading) anything."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pagellm.lora.peft_adapter import CONFIG_FILE, SUPPORTED_TARGETS, WEIGHTS_FILE


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of each module an adapter can target in one Llama-family decoder layer."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def write_random_adapter(
    out_dir: Path | str, hf_config, rank: int, targets: tuple[str, ...] = SUPPORTED_TARGETS, seed: int = 0, std: float = 0.02, **config
) -> str:
    """A PEFT directory with random A and B (normal, ``std``) for every layer's ``targets``; extra
    ``config`` keys go into adapter_config.json (``use_rslora``, ...). Returns its path."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (fan_in, fan_out) in module_shapes(hf_config).items():
            if module.rsplit(".", 1)[-1] not in targets:
                continue
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none", **config}
    (out_dir / CONFIG_FILE).write_text(json.dumps(meta))
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    return str(out_dir)
