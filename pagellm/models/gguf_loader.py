"""Reading GGUF files: metadata, a transformers config, and dequantized Hugging Face-named weights.

``gguf.GGUFReader`` turns every vocabulary string into numpy views and takes seconds on a 49k-token
vocabulary, so the header is parsed here directly (strings arrays are skipped unless asked for).
Tensor data is memory-mapped and dequantized with ``gguf.quants.dequantize``, and llama.cpp's
Q/K row permutation is undone exactly as transformers does, so the weights are bit-identical to
transformers' GGUF load.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from collections import deque
from collections.abc import Container, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}

# GGUF architecture -> (transformers model_type, architectures[0]) for the models we serve.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}
# llama.cpp permutes Q/K rows only when converting these architectures (transformers'
# TENSOR_PROCESSORS applies the inverse for the same set).
_PERMUTED_QK_ARCHITECTURES = ("llama",)

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: rows first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """A GGUF file's metadata and tensor table, with its data memory-mapped.

    String-array metadata (the vocabulary, the merges) is kept only for the keys in
    ``string_arrays``; for the others only the length is recorded in ``array_lengths``.
    """

    def __init__(self, path: str, string_arrays: Container[str] = ()) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._buf[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic bytes).")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported.")
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        pos = 24
        for _ in range(num_kv):
            key, pos = self._read_str(pos)
            (value_type,) = struct.unpack_from("<I", self._buf, pos)
            pos = self._read_value(key, value_type, pos + 4, key in string_arrays)
        entries = []
        for _ in range(num_tensors):
            name, pos = self._read_str(pos)
            (num_dims,) = struct.unpack_from("<I", self._buf, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", self._buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", self._buf, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            entries.append((name, tuple(reversed(dims)), GGMLQuantizationType(ggml_type), offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, ggml_type, offset in entries:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            num_elements = int(np.prod(shape))
            self.tensors[name] = GGUFTensorInfo(
                name, shape, ggml_type, data_start + offset, num_elements // block_size * type_size
            )

    def _read_str(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._buf, pos)
        pos += 8
        return self._buf[pos : pos + length].decode("utf-8", errors="replace"), pos + length

    def _read_value(self, key: str, value_type: int, pos: int, keep_strings: bool) -> int:
        if value_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[value_type]
            (self.metadata[key],) = struct.unpack_from(fmt, self._buf, pos)
            return pos + struct.calcsize(fmt)
        if value_type == GGUFValueType.STRING:
            self.metadata[key], pos = self._read_str(pos)
            return pos
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: metadata {key!r} has unknown value type {value_type}.")
        item_type, count = struct.unpack_from("<IQ", self._buf, pos)
        pos += 12
        self.array_lengths[key] = count
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            self.metadata[key] = list(struct.unpack_from(f"<{count}{fmt[1]}", self._buf, pos))
            return pos + count * struct.calcsize(fmt)
        if item_type != GGUFValueType.STRING:
            raise ValueError(f"{self.path}: metadata {key!r} is an array of unsupported type {item_type}.")
        strings = []
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self._buf, pos)
            if keep_strings:
                strings.append(self._buf[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        if keep_strings:
            self.metadata[key] = strings
        return pos

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored: float values for F32/F16, ``uint8`` blocks ``[rows, bytes]`` otherwise."""
        info = self.tensors[name]
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        if info.ggml_type == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if info.ggml_type == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(info.shape)
        return data.reshape(*info.shape[:-1], -1)

    def dequantized(self, name: str) -> torch.Tensor:
        """The tensor as float32, exactly as ``gguf.quants.dequantize`` computes it."""
        info = self.tensors[name]
        values = dequantize(self.raw(name), info.ggml_type)
        if not values.flags.writeable:
            values = values.copy()  # F32 tensors come straight from the read-only map
        return torch.from_numpy(values).reshape(info.shape)


def gguf_config_dict(gguf_file: GGUFFile) -> dict[str, Any]:
    """A transformers config dict from GGUF metadata, mirroring transformers' own GGUF config read."""
    arch = gguf_file.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}."
        )
    model_type, architecture_name = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [architecture_name],
        # llama.cpp only writes an output matrix when it differs from the embeddings.
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
    }
    arch_keys = GGUF_CONFIG_MAPPING[model_type]
    tokenizer_keys = GGUF_CONFIG_MAPPING["tokenizer"]
    for key, value in gguf_file.metadata.items():
        prefix, _, rest = key.partition(".")
        target = arch_keys.get(rest) if prefix == arch else tokenizer_keys.get(rest) if prefix == "tokenizer" else None
        if target:
            config[target] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in gguf_file.array_lengths:
        config["vocab_size"] = gguf_file.array_lengths["tokenizer.ggml.tokens"]
    return config


def load_gguf_config(path: str) -> PretrainedConfig:
    config = gguf_config_dict(GGUFFile(path))
    return AutoConfig.for_model(config.pop("model_type"), **config)


def _hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor, or None for tensors we do not load."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    match = _BLOCK_TENSOR.match(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    return None  # e.g. rope_freqs.weight, which transformers ignores too


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves (transformers' reverse permute)."""
    dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, dim, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(path: str, hf_config: PretrainedConfig, num_threads: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight in the file, dequantized.

    Dequantization runs on a few threads (numpy releases the GIL inside its kernels), a bounded
    number of tensors ahead of the consumer so memory stays near one model copy; tensors are
    yielded in file order.
    """
    gguf_file = GGUFFile(path)
    permute = gguf_file.architecture in _PERMUTED_QK_ARCHITECTURES
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    names = [(name, hf) for name in gguf_file.tensors if (hf := _hf_name(name)) is not None]

    def load(item: tuple[str, str]) -> tuple[str, torch.Tensor]:
        gguf_name, hf_name = item
        tensor = gguf_file.dequantized(gguf_name)
        if permute and ".attn_q." in gguf_name:
            tensor = _unpermute_qk(tensor, num_heads)
        elif permute and ".attn_k." in gguf_name:
            tensor = _unpermute_qk(tensor, num_kv_heads)
        return hf_name, tensor

    num_threads = num_threads or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=num_threads) as pool:
        pending: deque[Future[tuple[str, torch.Tensor]]] = deque()
        for item in names:
            pending.append(pool.submit(load, item))
            if len(pending) > 2 * num_threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
