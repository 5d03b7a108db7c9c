"""The default model re-quantized as llama.cpp's ``llama-quantize`` recipes would, without llama.cpp.

``gguf`` can quantize only the legacy types, so Q4_K, Q5_K and Q6_K blocks come from a small numpy
round-to-nearest quantizer here (per-sub-block scales and mins from each sub-block's range, the
super-block's fp16 scales from the largest of them): valid blocks that ``gguf.quants.dequantize``
reads back, a usable model, but not llama.cpp's exact bits (it searches for better scales).
Types follow ``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``: the recipe's base
type, Q6_K for attn_v / ffn_down where ``use_more_bits`` says so, Q6_K for the output (here the tied
token embedding), and, for a row width that is not a multiple of 256, the legacy fallback
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). In SmolLM2-135M (hidden 576) that leaves only ffn_down
(1536 inputs) in K-quant blocks, as in real llama-quantize output. 1-D tensors (norms) stay F32.
"""
from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
from gguf import QK_K, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagellm.models.loader import default_model_path

RECIPES: dict[str, tuple[T, LlamaFileType]] = {
    "Q4_K_M": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
}
# llama.cpp's convert_incompatible_tensor: K-quants need rows of whole 256-value super-blocks.
K_QUANT_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get more bits: the first and last
    eighth, and every third one in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, shape: tuple[int, ...], recipe: str, n_layers: int, has_output: bool) -> T:
    """The type llama-quantize gives tensor ``name`` (``shape`` in torch order: rows first)."""
    base = RECIPES[recipe][0]
    if len(shape) < 2 or not name.endswith(".weight"):
        return T.F32
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        # The output matrix keeps more bits; a non-256 row width takes Q8_0 rather than Q6_K's fallback.
        return T.Q6_K if shape[-1] % QK_K == 0 else T.Q8_0
    new_type = base
    match = _BLOCK_TENSOR.match(name)
    if match and recipe in ("Q4_K_M", "Q5_K_M") and (".attn_v." in name or ".ffn_down." in name):
        if use_more_bits(int(match.group(1)), n_layers):
            new_type = T.Q6_K
    if shape[-1] % QK_K != 0:
        new_type = K_QUANT_FALLBACK[new_type]
    return new_type


# --- K-quant blocks (layouts as gguf.quants' dequantize_blocks reads them) ----------------------


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to fp16: (its float32 value, its two bytes per entry)."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*x.shape, 2)


def _inverse(x: np.ndarray) -> np.ndarray:
    return np.divide(1.0, x, out=np.zeros_like(x), where=x != 0)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins into Q4_K/Q5_K's 12 bytes (the inverse of Q4_K.get_scale_min)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _affine_superblocks(rows: np.ndarray, nmax: int):
    """Q4_K/Q5_K's x ~= d*sc[j]*q - dmin*m[j] over 8 sub-blocks of 32, q in [0, nmax]."""
    x = rows.astype(np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=-1), 0.0)  # llama.cpp keeps the min <= 0 (m >= 0)
    scale = (x.max(axis=-1) - lo) / nmax
    d, d_bytes = _f16(scale.max(axis=-1) / 63)
    dmin, dmin_bytes = _f16((-lo).max(axis=-1) / 63)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo * _inverse(dmin)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * mn
    q = np.clip(np.rint((x + offset[..., None]) * _inverse(step)[..., None]), 0, nmax).astype(np.uint8)
    return q, d_bytes, dmin_bytes, _pack_scale_min(sc, mn)


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _affine_superblocks(rows, 15)
    qs = q[:, 0::2] | (q[:, 1::2] << 4)  # sub-blocks 2i / 2i+1 in the low / high nibbles of 32 bytes
    return np.concatenate([d, dmin, scales, qs.reshape(-1, 128)], axis=1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    q, d, dmin, scales = _affine_superblocks(rows, 31)
    low = q & 0x0F
    qs = low[:, 0::2] | (low[:, 1::2] << 4)
    high = (q >> 4).astype(np.uint8)  # bit j of qh[k]: the 5th bit of sub-block j's value k
    qh = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([d, dmin, scales, qh, qs.reshape(-1, 128)], axis=1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """x ~= d*sc[j]*(q-32) over 16 sub-blocks of 16, sc int8, q in [0, 63] (llama.cpp's signed
    scales: each sub-block's largest-magnitude value lands on -32)."""
    x = rows.astype(np.float32).reshape(-1, 16, 16)
    n = x.shape[0]
    extreme = np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = extreme / -32
    largest = np.take_along_axis(scale, np.abs(scale).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    d, d_bytes = _f16(largest / -128)
    sc = np.clip(np.rint(scale * _inverse(d)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = (np.clip(np.rint(x * _inverse(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    low = (q & 0x0F).reshape(n, 2, 2, 64)  # [half, nibble, 64 bytes]
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = q >> 4  # [half, 2-bit field, 32 bytes]
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


_K_QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize_tensor(weight: np.ndarray, ggml_type: T) -> np.ndarray:
    """``weight`` (float32, rows first) as ``ggml_type``: float32 itself, or uint8 [rows, row_bytes]."""
    if ggml_type == T.F32:
        return weight.astype(np.float32)
    if ggml_type in _K_QUANTIZERS:
        rows = weight.reshape(-1, weight.shape[-1])
        blocks = _K_QUANTIZERS[ggml_type](rows.reshape(-1, QK_K))
        return blocks.reshape(rows.shape[0], -1)
    return quantize(weight, ggml_type)


# --- the file ----------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def _reader(path: str) -> GGUFReader:
    return GGUFReader(path)  # seconds on the 49k vocabulary: once per session


def requantize_default_model(out_path: str, recipe: str, source: str | None = None) -> dict[str, T]:
    """Writes ``source`` (the default model) re-quantized by ``recipe`` to ``out_path``: all its
    metadata copied (general.file_type set to the recipe's), tensors in the same order. Returns
    each tensor's new type."""
    reader = _reader(source or default_model_path())
    fields = reader.fields
    arch = fields[Keys.General.ARCHITECTURE].contents()
    n_layers = int(fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    writer = GGUFWriter(out_path, arch)
    for field in fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = field.contents()
        if field.name == Keys.General.FILE_TYPE:
            value = int(RECIPES[recipe][1])
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    types: dict[str, T] = {}
    for tensor in reader.tensors:
        # Rows first, as the data's numpy shape; GGUF's own dims are the reverse.
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(s) for s in reversed(tensor.shape))
        weight = weight.reshape(shape)
        new_type = tensor_type(tensor.name, shape, recipe, n_layers, "output.weight" in names)
        data = quantize_tensor(weight, new_type)
        # uint8 rows of blocks: GGUFWriter recovers the element shape from the byte shape.
        writer.add_tensor(tensor.name, data, raw_dtype=None if new_type == T.F32 else new_type)
        types[tensor.name] = new_type
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


if __name__ == "__main__":
    import sys
    from collections import Counter

    if len(sys.argv) != 3 or sys.argv[2] not in RECIPES:
        sys.exit(f"usage: {sys.argv[0]} OUT.gguf {{{','.join(RECIPES)}}}")
    written = requantize_default_model(sys.argv[1], sys.argv[2])
    print(sys.argv[1], dict(Counter(t.name for t in written.values())))
