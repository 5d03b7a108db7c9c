"""A PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``): parsed, checked
against what the engine serves, and loaded as per-module ``(A, B)`` pairs with the scaling folded
into B. Anything that would change the model in a way the delta cannot express is refused."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

# Linear modules an adapter may target, as Hugging Face names them in a Llama-family decoder.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One targeted module: ``lora_a [r, in]`` and ``lora_b [out, r]`` times the adapter's scaling."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass(frozen=True)
class PEFTAdapter:
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    # Checkpoint module name ("model.layers.3.self_attn.q_proj") -> its weights.
    modules: dict[str, LoRAModuleWeights]

    @property
    def nbytes(self) -> int:
        return sum(m.lora_a.nbytes + m.lora_b.nbytes for m in self.modules.values())


def _config_targets(config: dict[str, Any]) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if targets == "all-linear":
        return SUPPORTED_TARGETS
    if isinstance(targets, str):
        raise ValueError(f"LoRA target_modules {targets!r}: only a list of module names or 'all-linear' is supported")
    if not targets:
        raise ValueError("LoRA adapter_config.json names no target_modules")
    names = tuple(t.rsplit(".", 1)[-1] for t in targets)
    unsupported = sorted(set(names) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise ValueError(f"LoRA target modules {unsupported} are not supported; supported: {', '.join(SUPPORTED_TARGETS)}")
    return names


def parse_peft_config(config: dict[str, Any], max_lora_rank: int) -> tuple[int, float, tuple[str, ...]]:
    """``(rank, scaling, targets)`` of a PEFT LoRA config; ValueError for what pagellm cannot serve."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"peft_type {config.get('peft_type')!r} is not LoRA")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA modules_to_save {config['modules_to_save']} is not supported (it replaces whole layers)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA bias={config['bias']!r} is not supported; only 'none'")
    if config.get("use_dora"):
        raise ValueError("DoRA adapters (use_dora) are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("LoRA rank_pattern / alpha_pattern (per-module ranks) are not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank={max_lora_rank}; start the engine with a larger --max-lora-rank")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling, _config_targets(config)


def _module_and_kind(key: str) -> tuple[str, str]:
    """``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> (``model.layers.0.self_attn.q_proj``, ``lora_A``)."""
    parts = key.removeprefix(_KEY_PREFIX).split(".")
    for kind in ("lora_A", "lora_B"):
        if kind in parts:
            return ".".join(parts[: parts.index(kind)]), kind
    raise ValueError(f"LoRA tensor {key!r} is not a lora_A / lora_B weight (embeddings, biases and DoRA are not supported)")


def load_peft_adapter(path: str, max_lora_rank: int) -> PEFTAdapter:
    """Reads and checks the adapter at ``path``; ValueError with the reason for anything refused."""
    from safetensors.torch import load_file

    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path) or not os.path.isfile(weights_path):
        raise ValueError(f"LoRA adapter {path!r} must be a PEFT directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    with open(config_path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
    rank, scaling, targets = parse_peft_config(config, max_lora_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(weights_path).items():
        module, kind = _module_and_kind(key)
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in SUPPORTED_TARGETS:
            raise ValueError(f"LoRA tensor {key!r} targets {leaf!r}; supported: {', '.join(SUPPORTED_TARGETS)}")
        pairs.setdefault(module, {})[kind] = tensor.float()
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no lora_A / lora_B tensors")
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA module {module!r} lacks {'lora_B' if 'lora_A' in pair else 'lora_A'}")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA module {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} are not of rank {rank}")
        modules[module] = LoRAModuleWeights(a.contiguous(), (b * scaling).contiguous())
    return PEFTAdapter(path, rank, scaling, targets, modules)
