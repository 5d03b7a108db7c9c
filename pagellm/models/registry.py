"""Which model class serves which Hugging Face architecture name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.models.gemma3 import Gemma3ForCausalLM
from pagellm.models.gemma4 import Gemma4ForCausalLM
from pagellm.models.gpt_oss import GptOssForCausalLM
from pagellm.models.granite_hybrid import GraniteMoeHybridForCausalLM
from pagellm.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from pagellm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagellm.models.mixtral import MixtralForCausalLM
from pagellm.models.nemotron_h import NemotronHForCausalLM
from pagellm.models.phi3 import Phi3ForCausalLM
from pagellm.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from pagellm.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Keyed by ``config.architectures[0]``, the class name transformers would instantiate.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
}

# Image-and-text checkpoints whose language model is served as this text-only architecture.
TEXT_ARCHITECTURE_OF: dict[str, str] = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def _layer_roles_hook(hf_config: PretrainedConfig, name: str, default: tuple) -> tuple:
    """What the model class's ``name`` classmethod says of the config's layers; ``default`` when
    the class has none (and for architectures not served here, which fail later with the list of
    supported ones)."""
    architectures = getattr(hf_config, "architectures", None) or []
    model_cls = MODEL_REGISTRY.get(architectures[0]) if architectures else None
    hook = getattr(model_cls, name, None)
    return hook(hf_config) if hook is not None else default


def recurrent_state_of(hf_config: PretrainedConfig) -> tuple[tuple[int, ...], tuple]:
    """A hybrid model's recurrent layers and their state tensors (empty for attention-only models)."""
    return _layer_roles_hook(hf_config, "recurrent_state", ((), ()))


def no_cache_layers_of(hf_config: PretrainedConfig) -> tuple[int, ...]:
    """Layers that hold neither KV nor state (a block that is only an MLP)."""
    return tuple(_layer_roles_hook(hf_config, "no_cache_layers", ()))


def kv_shared_layers_of(hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
    """(layer, source) for each layer that attends over an earlier layer's KV instead of its own."""
    return tuple((int(a), int(b)) for a, b in _layer_roles_hook(hf_config, "kv_shared_layers", ()))


def layer_kv_heads_of(hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
    """Per layer (KV heads, head size) where layers differ (Gemma 4's wider full layers); empty
    when every layer has the config's one."""
    return tuple((int(h), int(d)) for h, d in _layer_roles_hook(hf_config, "layer_kv_heads", ()))


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for this config's architecture; ValueError naming the supported ones otherwise."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(
            "model config names no architecture (config.architectures is empty); "
            f"supported architectures: {', '.join(supported_architectures())}."
        )
    model_cls = MODEL_REGISTRY.get(architectures[0])
    if model_cls is None:
        raise ValueError(
            f"model architecture {architectures[0]!r} is not supported; "
            f"supported architectures: {', '.join(supported_architectures())}."
        )
    return model_cls
