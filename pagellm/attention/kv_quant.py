"""The KV cache's element formats: 32- and 16-bit floats kept as they are, 8-bit ones quantized
on their way into the cache and widened to float32 inside attention.

- ``fp8`` / ``fp8_e4m3`` and ``fp8_e5m2`` (vLLM's ``--kv-cache-dtype``): each element is divided by
  its layer's ``k_scale`` / ``v_scale`` (:class:`KVScales`: 1.0 unless the checkpoint ships scales or
  ``--calculate-kv-scales`` measures them), saturated to the format's range and rounded to
  nearest even, as torch's ``.to()`` rounds.
- ``int8``: llama.cpp's q8_0 idea with one scale per token and kv head. A head's ``head_dim``
  values are stored as int8 times a float16 scale (absmax / 127) held in the row's last two
  bytes, so a cache row is ``head_dim + 2`` bytes and needs no second tensor; every backend reads
  the same layout.

Every backend writes through :func:`quantize` (or a kernel that matches it byte for byte) and
reads through :func:`dequantize` (or the same arithmetic in registers).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_DTYPES = FP8_DTYPES + (torch.int8,)
INT8_SCALE_ELEMS = 2  # int8 elements at the end of each head row that hold its float16 scale
INT8_MAX = 127
_FLOAT16_MAX = torch.finfo(torch.float16).max
# vLLM's --calculate-kv-scales: scale = amax / constant, so the largest key seen maps to 200 and
# the largest value to 100 of fp8_e4m3's 448, leaving room for later, larger ones.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one (token, kv head) row of the cache: the head's values, then an int8 row's scale."""
    return head_dim + INT8_SCALE_ELEMS if dtype == torch.int8 else head_dim


def cache_head_dim(kv_cache: torch.Tensor) -> int:
    """The model's head_dim behind a cache ``[2, blocks, block_size, kv_heads, row_width]``."""
    width = kv_cache.shape[-1]
    return width - INT8_SCALE_ELEMS if kv_cache.dtype == torch.int8 else width


def has_padded_rows(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` ``[2, blocks, block_size, kv_heads, row_width]`` is contiguous, or a
    narrower layer's view into a wider layer's contiguous tensor (:func:`narrow_kv_view`): each
    token's heads dense, tokens ``kv_cache.stride(2)`` elements apart. Every backend reads both."""
    if kv_cache.is_contiguous():
        return True
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    kv, block, token, head, element = kv_cache.stride()
    return element == 1 and head == width and token >= num_kv_heads * width and block == block_size * token and kv == num_blocks * block


def narrow_kv_view(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """A layer's cache ``[2, blocks, block_size, num_kv_heads, row_width(head_dim)]`` inside a
    contiguous cache of rows at least as wide: its rows fill the first part of each token's row,
    tokens as far apart as the wider cache's (padded rows; pagellm.worker.kv_cache)."""
    if not kv_cache.is_contiguous():
        raise ValueError("a narrow layer's KV cache is a view into a contiguous one")
    _, num_blocks, block_size, heads, width = kv_cache.shape
    row = row_width(head_dim, kv_cache.dtype)
    token = heads * width
    if num_kv_heads * row > token:
        raise ValueError(f"{num_kv_heads} KV heads of {head_dim} do not fit a token row of {heads} x {width} {kv_cache.dtype} elements")
    if num_kv_heads * row == token:
        return kv_cache.view(2, num_blocks, block_size, num_kv_heads, row)
    shape = (2, num_blocks, block_size, num_kv_heads, row)
    return kv_cache.as_strided(shape, (num_blocks * block_size * token, block_size * token, token, row, 1))


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's key (or value) of one kv head takes in the cache."""
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def kv_cache_dtype_name(dtype: torch.dtype) -> str:
    """The name ``--kv-cache-dtype`` takes for ``dtype`` (``fp8_e4m3``, ``int8``, ``bfloat16``, ...)."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class KVScales:
    """One attention layer's fp8 scales: the cache stores ``key / k_scale`` and ``value / v_scale``.

    Host kernels read the floats; device kernels read :meth:`device_tensor`, updated in place when
    the scales change, so CUDA graphs captured before a measurement replay with the measured scales.
    ``calculate`` (vLLM's ``--calculate-kv-scales``) measures them from the first step that runs.
    """

    k_scale: float = 1.0
    v_scale: float = 1.0
    calculate: bool = False
    _tensor: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def set(self, k_scale: float, v_scale: float) -> None:
        for label, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not s > 0 or s == float("inf"):
                raise ValueError(f"a KV cache {label} must be a positive finite number, got {s}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)
        if self._tensor is not None:
            self._tensor.copy_(torch.tensor([self.k_scale, self.v_scale]))

    def device_tensor(self, device: torch.device) -> torch.Tensor:
        """``[k_scale, v_scale]`` as float32 on ``device``; the same tensor every call."""
        if self._tensor is None or self._tensor.device != device:
            self._tensor = torch.tensor([self.k_scale, self.v_scale], dtype=torch.float32, device=device)
        return self._tensor

    def measure(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Sets the scales from this step's keys and values (vLLM's amax / constant) and stops measuring."""
        if key.numel() == 0:
            return
        k_amax = float(key.detach().abs().amax())
        v_amax = float(value.detach().abs().amax())
        # An all-zero step (padding) says nothing: keep 1.0 for that side.
        self.set(k_amax / K_SCALE_CONSTANT if k_amax > 0 else 1.0, v_amax / V_SCALE_CONSTANT if v_amax > 0 else 1.0)
        self.calculate = False


UNIT_SCALES = KVScales()


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Rows ``[..., head_dim]`` as the cache stores them: ``[..., row_width(head_dim, dtype)]`` of ``dtype``."""
    if dtype == torch.int8:
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)
        row_scale = (amax / INT8_MAX).clamp(max=_FLOAT16_MAX).to(torch.float16)
        s = row_scale.float()
        q = torch.where(s > 0, torch.round(x / s), torch.zeros_like(x)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return torch.cat([q, row_scale.view(torch.int8)], dim=-1)
    if dtype in FP8_DTYPES:
        x = x.float()
        if scale != 1.0:
            x = x / scale
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize(rows: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cache rows ``[..., row_width]`` as values ``[..., head_dim]`` of ``dtype``."""
    if rows.dtype == torch.int8:
        values = rows[..., :-INT8_SCALE_ELEMS]
        row_scale = rows[..., -INT8_SCALE_ELEMS:].contiguous().view(torch.float16)
        return values.to(dtype) * row_scale.to(dtype)
    if rows.dtype in FP8_DTYPES:
        x = rows.to(torch.float32)
        return (x * scale if scale != 1.0 else x).to(dtype)
    return rows.to(dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: Optional[KVScales] = None,
) -> None:
    """Scatters this step's keys and values ``[T, kv_heads, head_dim]`` into their slots, quantized
    as the cache's dtype stores them (torch's path; the kernels match it). ``kv_cache`` may have
    padded rows (:func:`has_padded_rows`): its token stride is read from the view."""
    scales = scales or UNIT_SCALES
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    k, v = quantize(key, kv_cache.dtype, scales.k_scale), quantize(value, kv_cache.dtype, scales.v_scale)
    if kv_cache.dtype in FP8_DTYPES:  # index_copy_ has no float8 kernels; the bytes are the same
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
