"""A GGUF file's model config, in transformers' field names, built without importing transformers.

``import transformers`` alone reads the ``__all__`` of every model file it ships, a noticeable share
of a server's start-up, so the architectures whose config class adds nothing but defaults (Llama,
Mistral, Qwen2) get a plain :class:`GGUFConfig` holding the file's metadata over those defaults.
The newer architectures derive fields in their config classes (layer types, rotary per layer kind)
and are still built through them. The tests hold the key table and the defaults to transformers'
own (``GGUF_CONFIG_MAPPING`` and the config classes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagellm.models.gguf_arch import arch_of, finish_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagellm.models.gguf_loader import GGUFFile

# GGUF metadata key (after the architecture's prefix) -> config field, per key of transformers'
# GGUF_CONFIG_MAPPING; None: a key transformers reads but drops.
_COMMON_KEYS: dict[str, str | None] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": None,
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
GGUF_CONFIG_KEYS: dict[str, dict[str, str | None]] = {
    "llama": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "mistral": {**_COMMON_KEYS, "rope.dimension_count": "head_dim"},
    "qwen2": _COMMON_KEYS,
    "qwen3": _COMMON_KEYS,
    "qwen3_moe": {
        **_COMMON_KEYS,
        "attention.key_length": "head_dim",
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
    },
    "gemma3": {**_COMMON_KEYS, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
    "phi3": _COMMON_KEYS,
    "gpt_oss": {
        **_COMMON_KEYS,
        "expert_count": "num_local_experts",
        "expert_used_count": "num_experts_per_tok",
        "sliding_window": "sliding_window",
    },
    "lfm2": {**_COMMON_KEYS, "shortconv.l_cache": "conv_L_cache"},
    "tokenizer": {
        "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id",
        "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id",
    },
}

# What transformers' config class of each architecture gives the fields the engine reads when a
# GGUF file leaves them out (tests/models/test_model_loader.py holds these to the classes).
_TRAINING_DEFAULTS: dict[str, Any] = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              "pretraining_tp": 1},
    "mistral": {"vocab_size": 32000, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "hidden_act": "silu", "num_key_value_heads": 8, "sliding_window": 4096, "bos_token_id": 1,
                "eos_token_id": 2},
    "qwen2": {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "hidden_act": "silu", "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": None,
              "max_window_layers": 28, "bos_token_id": None, "eos_token_id": None},
}
# PretrainedConfig's own defaults among the fields the engine reads with getattr.
_BASE_DEFAULTS: dict[str, Any] = {"pad_token_id": None, "dtype": None}


class GGUFConfig:
    """A model config as plain attributes, in transformers' names (what the engine reads of a
    ``PretrainedConfig``, with ``model_type`` and ``get_text_config`` as it has them)."""

    def __init__(self, model_type: str, **fields: Any) -> None:
        self.model_type = model_type
        self.__dict__.update(fields)

    def get_text_config(self, decoder: bool | None = None) -> GGUFConfig:
        del decoder  # a text model's config is its own text config
        return self

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"GGUFConfig({self.__dict__!r})"


def gguf_config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    """A transformers config dict from GGUF metadata, mirroring transformers' own GGUF config read."""
    arch = gguf_file.architecture
    spec = arch_of(arch, gguf_file.metadata)
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.architecture],
        # llama.cpp only writes an output matrix when it differs from the embeddings.
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
    }
    arch_keys = {**GGUF_CONFIG_KEYS[spec.mapping_key], **spec.extra_keys}
    tokenizer_keys = GGUF_CONFIG_KEYS["tokenizer"]
    for key, value in gguf_file.metadata.items():
        prefix, _, rest = key.partition(".")
        target = arch_keys.get(rest) if prefix == arch else tokenizer_keys.get(rest) if prefix == "tokenizer" else None
        if target:
            config[target] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf_file.array_lengths:
        config["vocab_size"] = gguf_file.array_lengths["tokenizer.ggml.tokens"]
    return config


def _gemma4_tensor_fields(gguf_file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma 4 file states in tensors: proportional RoPE's rotated share (rope_freqs: 1 for a
    rotated pair, 1e30 for the rest), the per-layer embedding's rows, and K=V full layers (no attn_v)."""
    fields: dict[str, Any] = {"rope_partial_rotary_factor": 1.0}
    if "rope_freqs.weight" in gguf_file.tensors:
        freqs = gguf_file.dequantized("rope_freqs.weight")
        fields["rope_partial_rotary_factor"] = float((freqs < 1e20).sum()) / freqs.numel()
    if "per_layer_token_embd.weight" in gguf_file.tensors:
        fields["vocab_size_per_layer_input"] = gguf_file.tensors["per_layer_token_embd.weight"].shape[0]
    pattern = values.get("sliding_window_pattern") or []
    full = [i for i, swa in enumerate(pattern) if not swa]
    if full and f"blk.{full[0]}.attn_v.weight" not in gguf_file.tensors:
        fields["attention_k_eq_v"] = True
    return fields


def load_gguf_config(path: str) -> GGUFConfig | PretrainedConfig:
    """The config of a GGUF file: its metadata over the defaults of the architecture's config class
    (:data:`_CONFIG_DEFAULTS`), RoPE settings as transformers 5 keeps them."""
    from pagellm.models.gguf_loader import GGUFFile

    gguf_file = GGUFFile.cached(path)
    values = gguf_config_dict(gguf_file)
    model_type = values.pop("model_type")
    if "hidden_size" not in values or "num_attention_heads" not in values:
        raise ValueError(f"{path}: the GGUF metadata gives no embedding length or attention head count")
    if model_type not in _CONFIG_DEFAULTS:
        from transformers import CONFIG_MAPPING

        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        for factors, name in (("rope_long_factor", "rope_factors_long.weight"), ("rope_short_factor", "rope_factors_short.weight")):
            if name in gguf_file.tensors:
                values[factors] = gguf_file.dequantized(name).tolist()
        if gguf_file.architecture == "gemma4":
            values.update(_gemma4_tensor_fields(gguf_file, values))
        values = finish_config(arch_of(gguf_file.architecture, gguf_file.metadata), values)
        return CONFIG_MAPPING[model_type](**values)
    values = {**_BASE_DEFAULTS, **_TRAINING_DEFAULTS, **_CONFIG_DEFAULTS[model_type], **values}
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    if model_type != "qwen2":  # Qwen2's class has no head_dim; its layers divide hidden_size
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta"))}
    return GGUFConfig(model_type, **values)
