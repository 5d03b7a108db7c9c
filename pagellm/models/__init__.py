"""Model definitions, the architecture registry, and checkpoint loading."""
from pagellm.models.loader import (
    default_model_path,
    eos_token_ids,
    get_eos_token_ids,
    get_max_model_len,
    load_hf_config,
    load_model,
    resolve_model_path,
)
from pagellm.models.registry import MODEL_REGISTRY, get_model_class, supported_architectures

__all__ = [
    "MODEL_REGISTRY",
    "default_model_path",
    "eos_token_ids",
    "get_eos_token_ids",
    "get_max_model_len",
    "get_model_class",
    "load_hf_config",
    "load_model",
    "resolve_model_path",
    "supported_architectures",
]
