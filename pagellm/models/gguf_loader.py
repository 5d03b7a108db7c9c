"""Reading GGUF files: metadata and Hugging Face-named weights as stored (the config: gguf_config).

``gguf.GGUFReader`` turns every vocabulary string into numpy views, slow on a vocabulary of tens of
thousands of tokens, so the header is parsed here directly (strings arrays are skipped unless asked for).
Tensor data is read as stored (GGUF blocks stay blocks), and llama.cpp's Q/K row permutation is
undone on rows of blocks exactly as transformers does on values, so dequantized weights are
bit-identical to transformers' GGUF load.
"""
from __future__ import annotations

import functools
import mmap
import os
import re
import struct
import warnings
from collections.abc import Container, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from pagellm.layers.gguf_types import GGUFWeight
from pagellm.models.gguf_arch import LLAMA_BLOCK_NAMES, SUFFIXLESS, GGUFArch, arch_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

WeightSource = GGUFWeight | torch.Tensor
_FLOAT_DTYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_U64 = struct.Struct("<Q")
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

# llama.cpp permutes Q/K rows only when converting these architectures (transformers'
# TENSOR_PROCESSORS applies the inverse for the same set).
_PERMUTED_QK_ARCHITECTURES = ("llama",)

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
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

    @classmethod
    def cached(cls, path: str) -> "GGUFFile":
        """The file's table without its string arrays, parsed once per version of the file: the
        config, the memory plan, the loader and the EOS lookup all read it at start-up, and
        each would otherwise walk past a large vocabulary again."""
        stat = os.stat(path)
        return _cached_gguf_file(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)

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
        # A vocabulary is ~50-150k strings: the loop is kept to a length read and a slice each.
        buf, read_length = self._buf, _U64.unpack_from
        spans = []
        for _ in range(count):
            (length,) = read_length(buf, pos)
            if keep_strings:
                spans.append((pos + 8, pos + 8 + length))
            pos += 8 + length
        if keep_strings:
            self.metadata[key] = [buf[start:end].decode("utf-8", errors="replace") for start, end in spans]
        return pos

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def read(self, name: str) -> GGUFWeight | torch.Tensor:
        """The tensor as stored, a read-only view of the map: a float tensor for F32/F16/BF16, a
        :class:`GGUFWeight` of its blocks otherwise. Packing reads it in place; a form that keeps
        the view keeps file pages, which :meth:`release` drops from this process between uses."""
        info = self.tensors[name]
        if info.offset + info.num_bytes > len(self._buf):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        with warnings.catch_warnings():
            # The map is read-only on purpose: a write into a checkpoint view is a bug, and faults.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            data = torch.frombuffer(self._buf, dtype=torch.uint8, count=info.num_bytes, offset=info.offset)
        if info.ggml_type in _FLOAT_DTYPES:
            return data.view(_FLOAT_DTYPES[info.ggml_type]).reshape(info.shape)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return GGUFWeight(info.ggml_type, data.view(rows, -1), info.shape[-1])

    def release(self, name: str | None = None) -> None:
        """Drops the file pages of one tensor (or of the whole file) from this process's resident
        set: a packed weight's source then costs nothing, and a kept view faults its pages back
        from the page cache when read. The data is the file's, so nothing is lost."""
        if name is None:
            start, end = 0, len(self._buf)
        else:
            info = self.tensors[name]
            start, end = info.offset, info.offset + info.num_bytes
        start -= start % mmap.PAGESIZE
        end = min(len(self._buf), end)
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            self._buf.madvise(mmap.MADV_DONTNEED, start, end - start)

    def dequantized(self, name: str) -> torch.Tensor:
        """The tensor as float32, exactly as ``gguf.quants.dequantize`` computes it."""
        tensor = self.read(name)
        if isinstance(tensor, GGUFWeight):
            return tensor.dequantize().reshape(self.tensors[name].shape)
        return tensor.float()


@functools.lru_cache(maxsize=4)
def _cached_gguf_file(path: str, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # the cache key: a rewritten file is parsed again
    return GGUFFile(path)


def _hf_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """The Hugging Face parameter name for a GGUF tensor, or None for tensors we do not load."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[base]}.{suffix}"
    match = _BLOCK_TENSOR.match(gguf_name)
    names = {**LLAMA_BLOCK_NAMES, **arch.block_names}
    if match and match.group(2) in names:
        kind = SUFFIXLESS.get(match.group(2), match.group(3))
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{kind}"
    return None  # e.g. rope_freqs.weight, which transformers ignores too


def _expert_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """The HF name pattern (``...experts.{}.proj.kind``) of a stacked ``blk.N.ffn_*_exps`` tensor,
    or None for any other tensor."""
    match = _BLOCK_TENSOR.match(gguf_name)
    if not match or match.group(2) not in arch.expert_names:
        return None
    return f"model.layers.{match.group(1)}.{arch.moe_module}.experts.{{}}.{arch.expert_names[match.group(2)]}.{match.group(3)}"


def _split_experts(name: str, shape: tuple[int, ...], tensor: WeightSource) -> Iterator[tuple[str, WeightSource]]:
    """Each expert's rows of a stacked tensor (``[experts, rows, cols]``) under its HF name, as views."""
    num_experts, rows = shape[0], shape[1]
    if len(shape) == 2:  # gpt-oss's expert biases, [experts, rows]
        dense = tensor.dequantize().reshape(shape) if isinstance(tensor, GGUFWeight) else tensor
        return ((name.format(e), dense[e]) for e in range(num_experts))
    if isinstance(tensor, GGUFWeight):
        return ((name.format(e), tensor.narrow_rows(e * rows, rows)) for e in range(num_experts))
    return ((name.format(e), tensor[e]) for e in range(num_experts))


def _unpermute_qk(weight: WeightSource, num_heads: int) -> WeightSource:
    """Undo llama.cpp's interleaving of each head's rotary halves (transformers' reverse permute);
    a row permutation, so blocks move whole."""
    rows = weight.shape[0]
    dim = rows // num_heads // 2
    order = torch.arange(rows).reshape(num_heads, dim, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, GGUFWeight):
        return weight.permute_rows(order)
    return weight.index_select(0, order)


def iter_gguf_weights(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, WeightSource]]:
    """(Hugging Face name, tensor as stored) for every weight in the file, in file order: blocks
    as :class:`GGUFWeight`, float tensors in their own dtype. Nothing is dequantized here: each
    linear layer's method decides (pagellm.layers.linear_method)."""
    gguf_file = GGUFFile.cached(path)
    arch = arch_of(gguf_file.architecture, gguf_file.metadata)
    permute = gguf_file.architecture in _PERMUTED_QK_ARCHITECTURES
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    # A layer is packed once its last shard is in, so a block's file pages are dropped when the
    # next block begins; they stay mapped while its fused shards wait for one another.
    block, block_names = None, []
    try:
        for gguf_name, info in gguf_file.tensors.items():
            match = _BLOCK_TENSOR.match(gguf_name)
            if (match.group(1) if match else gguf_name) != block:
                for name in block_names:
                    gguf_file.release(name)
                block, block_names = match.group(1) if match else gguf_name, []
            block_names.append(gguf_name)
            expert_name = _expert_name(gguf_name, arch)
            if expert_name is not None:
                yield from _split_experts(expert_name, info.shape, gguf_file.read(gguf_name))
                continue
            hf_name = _hf_name(gguf_name, arch)
            if hf_name is None:
                continue
            tensor = gguf_file.read(gguf_name)
            if arch.norm_shift and hf_name.endswith("norm.weight"):
                tensor = tensor.float() - arch.norm_shift
            if permute and ".attn_q." in gguf_name:
                tensor = _unpermute_qk(tensor, num_heads)
            elif permute and ".attn_k." in gguf_name:
                tensor = _unpermute_qk(tensor, num_kv_heads)
            yield hf_name, tensor
    finally:
        gguf_file.release()


def iter_dequantized_gguf_weights(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`iter_gguf_weights` with every tensor as float32, as transformers' GGUF load gives them."""
    for name, tensor in iter_gguf_weights(path, hf_config):
        yield name, tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor.float()
