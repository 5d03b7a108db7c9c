"""Reading GGUF files: metadata and Hugging Face-named weights as stored (the config: gguf_config).

``gguf.GGUFReader`` turns every vocabulary string into numpy views, slow on a vocabulary of tens of
thousands of tokens, so the header is parsed here directly (strings arrays are skipped unless asked for).
Tensor data is read as stored (GGUF blocks stay blocks), and llama.cpp's Q/K row permutation is
undone on rows of blocks exactly as transformers does on values, so dequantized weights are
bit-identical to transformers' GGUF load. The linear-attention layers of Qwen3-Next / Qwen3.5 are
given back as their Hugging Face checkpoint stores them (:class:`_LinearAttentionLayout`): row
reorders move whole rows of blocks, and only a column reorder that cuts blocks dequantizes.
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

from pagellm.layers.gguf_types import GGUFWeight, block_shape
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
_PERMUTED_QK_ARCHITECTURES = ("llama", "granitehybrid", "nemotron_h", "nemotron_h_moe")

_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# ssm_a has no suffix; LFM2's shortconv.conv has a dot in its kind.
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_.]+?)(?:\.(weight|bias))?$")


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
    top_level = {**_TOP_LEVEL_NAMES, **arch.top_level_names}
    if base in top_level:
        return f"{top_level[base]}.{suffix}"
    match = _BLOCK_TENSOR.match(gguf_name)
    names = {**LLAMA_BLOCK_NAMES, **arch.block_names}
    if match and match.group(2) in names:
        kind = {**SUFFIXLESS, **arch.suffixless}.get(match.group(2), match.group(3))
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{kind}" if kind else None
    return None  # e.g. rope_freqs.weight, which transformers ignores too


def _expert_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """The HF name pattern (``...experts.{}.proj.kind``) of a stacked ``blk.N.ffn_*_exps`` tensor,
    or None for any other tensor."""
    match = _BLOCK_TENSOR.match(gguf_name)
    if match and match.group(2) == "ffn_gate_up_exps" and "ffn_gate_exps" in arch.expert_names:
        gate, up = arch.expert_names["ffn_gate_exps"], arch.expert_names["ffn_up_exps"]
        if (gate, up) == ("gate_proj", "up_proj"):
            return f"model.layers.{match.group(1)}.{arch.moe_module}.experts.{{}}.{{gate_up}}_proj.{match.group(3)}"
    if not match or match.group(2) not in arch.expert_names:
        return None
    return f"model.layers.{match.group(1)}.{arch.moe_module}.experts.{{}}.{arch.expert_names[match.group(2)]}.{match.group(3)}"


def _split_experts(name: str, shape: tuple[int, ...], tensor: WeightSource) -> Iterator[tuple[str, WeightSource]]:
    """Each expert's rows of a stacked tensor (``[experts, rows, cols]``) under its HF name, as views."""
    num_experts, rows = shape[0], shape[1]
    if "{gate_up}" in name:
        return _split_gate_up_experts(name, num_experts, rows, tensor)
    if len(shape) == 2:  # gpt-oss's expert biases, [experts, rows]
        dense = tensor.dequantize().reshape(shape) if isinstance(tensor, GGUFWeight) else tensor
        return ((name.format(e), dense[e]) for e in range(num_experts))
    if isinstance(tensor, GGUFWeight):
        return ((name.format(e), tensor.narrow_rows(e * rows, rows)) for e in range(num_experts))
    return ((name.format(e), tensor[e]) for e in range(num_experts))


def _split_gate_up_experts(name: str, num_experts: int, rows: int, tensor: WeightSource) -> Iterator[tuple[str, WeightSource]]:
    """``ffn_gate_up_exps`` (the converter's ``--fuse-gate-up-exps``): each expert's gate rows, then its up rows."""
    half = rows // 2
    for e in range(num_experts):
        for i, proj in enumerate(("gate", "up")):
            part = tensor.narrow_rows(e * rows + i * half, half) if isinstance(tensor, GGUFWeight) else tensor[e, i * half : (i + 1) * half]
            yield name.format(e, gate_up=proj), part


def _unpermute_qk(weight: WeightSource, num_heads: int) -> WeightSource:
    """Undo llama.cpp's interleaving of each head's rotary halves (transformers' reverse permute);
    a row permutation, so blocks move whole."""
    rows = weight.shape[0]
    dim = rows // num_heads // 2
    order = torch.arange(rows).reshape(num_heads, dim, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, GGUFWeight):
        return weight.permute_rows(order)
    return weight.index_select(0, order)


def _select_rows(weight: WeightSource, order: torch.Tensor) -> WeightSource:
    """Rows of ``weight`` in ``order`` (row i is row ``order[i]``): whole rows of blocks, nothing dequantized."""
    if isinstance(weight, GGUFWeight):
        return weight.permute_rows(order)
    return weight.index_select(0, order)


def _cat_rows(parts: list[WeightSource]) -> WeightSource:
    """Tensors stacked by rows: blocks stay blocks where all are of one type, float32 otherwise."""
    if all(isinstance(p, GGUFWeight) for p in parts) and len({(p.ggml_type, p.cols) for p in parts}) == 1:  # type: ignore[union-attr]
        first = parts[0]
        return GGUFWeight(first.ggml_type, torch.cat([p.data for p in parts]), first.cols)  # type: ignore[union-attr]
    dense = [p.dequantize() if isinstance(p, GGUFWeight) else p for p in parts]
    if len({d.dtype for d in dense}) > 1:
        dense = [d.float() for d in dense]
    return torch.cat(dense)


class _LinearAttentionLayout:
    """The inverse of llama.cpp's converter on Qwen3-Next / Qwen3.5 linear-attention layers
    (conversion/qwen.py; the transforms are listed in gguf_hybrid_arch's docstring), from the config's
    head counts and dims. :meth:`take` gets each block tensor of the hybrid architectures with its
    HF name as gguf_arch maps it and yields what the HF checkpoint stores."""

    def __init__(self, layout: str, hf_config: PretrainedConfig) -> None:
        self.layout = layout
        self.num_k = hf_config.linear_num_key_heads
        self.num_v = hf_config.linear_num_value_heads
        self.k_dim = hf_config.linear_key_head_dim
        self.v_dim = hf_config.linear_value_head_dim
        self.layer_types = list(hf_config.layer_types)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_rows = hf_config.num_key_value_heads * head_dim
        # A full-attention layer's q_proj holds each head's query and its output gate: twice the rows.
        self.qkv_rows = (2 * hf_config.num_attention_heads * head_dim, kv_rows, kv_rows)
        # Qwen3.5 tiles value heads (v0 of every key head, then v1...) where they outnumber key heads.
        self.tiled = layout == "qwen35" and self.num_k != self.num_v
        self._pending: dict[str, WeightSource] = {}

    def _grouped(self, width: int) -> torch.Tensor:
        """Index of each value head's ``width`` entries in tiled order, in HF's grouped order."""
        per_k = self.num_v // self.num_k
        return torch.arange(self.num_v * width).reshape(per_k, self.num_k, width).transpose(0, 1).reshape(-1)

    def _rows_after(self, prefix: int, width: int) -> torch.Tensor:
        """``prefix`` rows kept in place (q and k), then the value heads' rows back in grouped order."""
        return torch.cat([torch.arange(prefix), prefix + self._grouped(width)])

    def _value_columns(self, weight: WeightSource) -> WeightSource:
        """out_proj's input columns back in grouped order: whole blocks where a value head spans
        whole blocks, else (a K-quant's 256-wide blocks over 128-wide heads) dequantized."""
        if not isinstance(weight, GGUFWeight):
            return weight.index_select(1, self._grouped(self.v_dim))
        per_block, block_bytes = block_shape(weight.ggml_type)
        if self.v_dim % per_block:
            return weight.dequantize().index_select(1, self._grouped(self.v_dim))
        blocks = weight.data.reshape(weight.rows, -1, block_bytes).index_select(1, self._grouped(self.v_dim // per_block))
        return GGUFWeight(weight.ggml_type, blocks.reshape(weight.rows, -1), weight.cols)

    def _qkvz(self, qkv: WeightSource, z: WeightSource) -> WeightSource:
        """Qwen3-Next's in_proj_qkvz from attn_qkv (all q, all k, all v) and attn_gate (z): per key
        head its q, k, v and z rows, as HF's fix_query_key_value_ordering reads them."""
        q_rows, v_rows = self.num_k * self.k_dim, self.num_v // self.num_k * self.v_dim
        z_start = 2 * q_rows + self.num_k * v_rows
        order = torch.cat([
            torch.cat([
                h * self.k_dim + torch.arange(self.k_dim),
                q_rows + h * self.k_dim + torch.arange(self.k_dim),
                2 * q_rows + h * v_rows + torch.arange(v_rows),
                z_start + h * v_rows + torch.arange(v_rows),
            ])
            for h in range(self.num_k)
        ])
        return _select_rows(_cat_rows([qkv, z]), order)

    def take(self, layer: int, kind: str, hf_name: str, tensor: WeightSource) -> Iterator[tuple[str, WeightSource]]:
        prefix = f"model.layers.{layer}."
        key_rows = 2 * self.num_k * self.k_dim
        if kind == "attn_qkv" and self.layer_types[layer] == "full_attention":  # --fuse-qkv: q (with its gate), k, v
            start = 0
            for proj, rows in zip(("q_proj", "k_proj", "v_proj"), self.qkv_rows):
                part = tensor.narrow_rows(start, rows) if isinstance(tensor, GGUFWeight) else tensor.narrow(0, start, rows)
                yield f"{prefix}self_attn.{proj}.weight", part
                start += rows
            return
        if self.layout == "qwen3next" and kind in ("attn_qkv", "attn_gate"):
            self._pending[f"{layer}.{kind}"] = tensor
            qkv, z = self._pending.get(f"{layer}.attn_qkv"), self._pending.get(f"{layer}.attn_gate")
            if qkv is not None and z is not None:
                del self._pending[f"{layer}.attn_qkv"], self._pending[f"{layer}.attn_gate"]
                yield f"{prefix}linear_attn.in_proj_qkvz.weight", self._qkvz(qkv, z)
            return
        if kind == "ssm_a":  # stored as -exp(A_log)
            tensor = torch.log(-_dense(tensor).double()).float()
        elif kind == "ssm_conv1d":  # [channels, kernel] -> [channels, 1, kernel]
            tensor = _dense(tensor).unsqueeze(1)
        elif kind == "ffn_gate_inp_shexp" and len(tensor.shape) == 1:
            tensor = _dense(tensor).unsqueeze(0)
        if self.tiled:
            if kind == "attn_qkv":
                tensor = _select_rows(tensor, self._rows_after(key_rows, self.v_dim))
            elif kind == "attn_gate":
                tensor = _select_rows(tensor, self._grouped(self.v_dim))
            elif kind in ("ssm_beta", "ssm_alpha", "ssm_a", "ssm_dt"):
                tensor = _select_rows(tensor, self._grouped(1))
            elif kind == "ssm_conv1d":
                tensor = tensor.index_select(0, self._rows_after(key_rows, self.v_dim))
            elif kind == "ssm_out":
                tensor = self._value_columns(tensor)
        yield hf_name, tensor


def _dense(tensor: WeightSource) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor.float()


def iter_gguf_weights(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, WeightSource]]:
    """(Hugging Face name, tensor as stored) for every weight in the file, in file order: blocks
    as :class:`GGUFWeight`, float tensors in their own dtype. Nothing is dequantized here: each
    linear layer's method decides (pagellm.layers.linear_method)."""
    gguf_file = GGUFFile.cached(path)
    arch = arch_of(gguf_file.architecture, gguf_file.metadata)
    permute = gguf_file.architecture in _PERMUTED_QK_ARCHITECTURES
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    linear = _LinearAttentionLayout(arch.linear_attention, hf_config) if arch.linear_attention else None
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
            if match and int(match.group(1)) >= hf_config.num_hidden_layers:
                continue  # a multi-token-prediction block after the trunk's (Qwen3-Next / Qwen3.5), unused here
            expert_name = _expert_name(gguf_name, arch)
            if expert_name is not None:
                yield from _split_experts(expert_name, info.shape, gguf_file.read(gguf_name))
                continue
            hf_name = _hf_name(gguf_name, arch)
            if hf_name is None:
                continue
            tensor = gguf_file.read(gguf_name)
            if arch.norm_shift and hf_name.endswith("norm.weight") and not (match and match.group(2) in arch.plain_norms):
                tensor = tensor.float() - arch.norm_shift
            if linear is not None and match:
                yield from linear.take(int(match.group(1)), match.group(2), hf_name, tensor)
                continue
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
