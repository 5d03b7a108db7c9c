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



def write_random_adapter(out_dir: Path, rank: int, targets: list[str], seed: int, std: float = 0.02, **config) -> str:
    """A PEFT directory written directly (no model copy): random A and B of the default model's shapes."""
    from pagellm.bench.lora_adapters import write_random_adapter as write
    from pagellm.models.loader import default_model_path, load_hf_config

    return write(out_dir, load_hf_config(default_model_path()), rank, tuple(targets), seed, std, **config)
