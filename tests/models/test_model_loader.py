"""Model path resolution, config-derived limits, EOS ids, sharded safetensors and the registry."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_utils import make_random_hf_model
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from pagellm.attention.torch_ref import TorchReferenceBackend
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.loader import (
    default_model_path,
    eos_token_ids,
    get_max_model_len,
    iter_safetensors_weights,
    load_hf_config,
    load_model,
    resolve_model_path,
)
from pagellm.models.registry import get_model_class, supported_architectures

_TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


class _Tok:
    eos_token_id = 9


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(path) == path


def test_bad_paths_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        resolve_model_path(str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_TINY}))
    with pytest.raises(ValueError, match="no safetensors"):
        list(iter_safetensors_weights(str(tmp_path)))


def test_sharded_safetensors_load_completely(tmp_path: Path) -> None:
    config = LlamaConfig(**_TINY, tie_word_embeddings=False)
    hf_model = make_random_hf_model(config)
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    names = [name for name, _ in iter_safetensors_weights(str(tmp_path))]
    assert sorted(names) == sorted(hf_model.state_dict())
    model = load_model(str(tmp_path), load_hf_config(str(tmp_path)), torch.float32, torch.device("cpu"), TorchReferenceBackend())
    assert torch.equal(model.lm_head.weight, hf_model.lm_head.weight)
    assert torch.equal(model.model.norm.weight, hf_model.model.norm.weight)


def test_eos_token_ids_sources(tmp_path: Path) -> None:
    config = LlamaConfig(**_TINY, eos_token_id=3)
    config.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    assert eos_token_ids(str(tmp_path), config) == {3}
    assert eos_token_ids(str(tmp_path), config, _Tok()) == {3, 9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert eos_token_ids(str(tmp_path), config) == {5, 7}
    assert eos_token_ids(str(tmp_path), config, _Tok()) == {5, 7, 9}


def test_max_model_len() -> None:
    assert get_max_model_len(LlamaConfig(**_TINY, max_position_embeddings=2048)) == 2048
    linear = LlamaConfig(**_TINY, max_position_embeddings=2048, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4})
    assert get_max_model_len(linear) == 8192
    # A sliding window no longer caps the context: the backends apply it, the KV cache frees behind it.
    assert get_max_model_len(MistralConfig(**_TINY, max_position_embeddings=32768, sliding_window=4096)) == 32768
    assert get_max_model_len(MistralConfig(**_TINY, max_position_embeddings=32768, sliding_window=None)) == 32768
    assert get_max_model_len(Qwen2Config(**_TINY, max_position_embeddings=32768)) == 32768  # window off by default


def test_rope_table_covers_max_model_len_and_rejects_dynamic() -> None:
    linear = LlamaConfig(**_TINY, max_position_embeddings=64, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    cos, sin = RotaryEmbedding(linear).cos_sin(torch.tensor([0, 127]), torch.float32)
    assert cos.shape == (2, 1, 8) and torch.allclose(cos[0], torch.ones(1, 8)) and torch.allclose(sin[0], torch.zeros(1, 8))
    dynamic = LlamaConfig(**_TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        RotaryEmbedding(dynamic)


def test_registry() -> None:
    assert supported_architectures() == [
        "Gemma3ForCausalLM",
        "Gemma4ForCausalLM",
        "GptOssForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "Lfm2ForCausalLM",
        "Lfm2MoeForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MixtralForCausalLM",
        "NemotronHForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    ]
    for arch in supported_architectures():
        assert get_model_class(LlamaConfig(architectures=[arch])).__name__ == arch
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*Gemma3ForCausalLM.*Qwen3_5MoeForCausalLM"):
        get_model_class(LlamaConfig(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="names no architecture"):
        get_model_class(LlamaConfig())


# The config fields the engine reads (models, rope, loader, executor).
_ENGINE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    "tie_word_embeddings", "sliding_window", "use_sliding_window", "bos_token_id", "eos_token_id", "architectures",
)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("left_out", [(), ("head_dim", "num_key_value_heads", "rope_theta", "max_position_embeddings",
                                           "vocab_size", "rms_norm_eps", "bos_token_id", "eos_token_id")])
def test_gguf_config_has_what_transformers_class_gives(model_type: str, left_out: tuple[str, ...], monkeypatch) -> None:
    """A GGUF file's config is built without importing the architecture's config class; every field
    the engine reads must still come out as that class makes it, defaults included."""
    from transformers import AutoConfig

    from pagellm.layers.rotary import get_rope_parameters, head_dim_of
    from pagellm.models import gguf_config, gguf_loader

    metadata = {"model_type": model_type, "architectures": ["X"], "tie_word_embeddings": True, "num_hidden_layers": 3,
                "max_position_embeddings": 4096, "hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 6,
                "num_key_value_heads": 2, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "vocab_size": 300,
                "head_dim": 16, "bos_token_id": 5, "eos_token_id": 7}
    if model_type == "qwen2":
        del metadata["head_dim"]  # transformers' GGUF mapping drops qwen2's rope.dimension_count
    metadata = {k: v for k, v in metadata.items() if k not in left_out}
    monkeypatch.setattr(gguf_loader.GGUFFile, "cached", classmethod(lambda cls, path: path))
    monkeypatch.setattr(gguf_config, "gguf_config_dict", lambda _: dict(metadata))
    ours = gguf_config.load_gguf_config("model.gguf")
    fields = dict(metadata)
    theirs = AutoConfig.for_model(fields.pop("model_type"), **fields)
    for name in _ENGINE_FIELDS:
        assert getattr(ours, name, None) == getattr(theirs, name, None), name
    assert head_dim_of(ours) == head_dim_of(theirs)
    assert get_rope_parameters(ours) == get_rope_parameters(theirs)
    assert get_max_model_len(ours) == get_max_model_len(theirs)


def test_gguf_key_table_is_transformers_own() -> None:
    """The GGUF metadata keys are read without importing transformers, from a copy of its table."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from pagellm.models.gguf_config import GGUF_CONFIG_KEYS

    assert GGUF_CONFIG_KEYS == {key: GGUF_CONFIG_MAPPING[key] for key in GGUF_CONFIG_KEYS}
