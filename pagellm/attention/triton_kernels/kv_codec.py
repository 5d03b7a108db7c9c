"""The KV cache formats' in-register codecs, shared by the Triton kernels (see kv_quant).

An 8-bit cache reaches the kernels as its ``torch.uint8`` view and is encoded and decoded with
integer arithmetic: Triton's interpreter rounds float32 -> fp8 casts wrongly (not to nearest
even), and GPUs before sm_89 have no fp8 conversions at all, while the bit arithmetic is exact
everywhere. The encoders follow torch's (c10's) conversions, so the written bytes equal
``kv_quant.quantize``'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# KV_FORMAT, how the kernels read a cache's elements; constexpr, as the kernels compare against them.
FORMAT_FLOAT = tl.constexpr(0)  # float32 / float16 / bfloat16, loaded as they are
FORMAT_E4M3 = tl.constexpr(1)
FORMAT_E5M2 = tl.constexpr(2)
FORMAT_INT8 = tl.constexpr(3)
# The e4m3 decoder moves the bits into a float16 2^8 times too small; callers scale by this.
E4M3_UNIT = 256.0


def kv_format(dtype: torch.dtype) -> int:
    formats = {torch.float8_e4m3fn: FORMAT_E4M3, torch.float8_e5m2: FORMAT_E5M2, torch.int8: FORMAT_INT8}
    return formats.get(dtype, FORMAT_FLOAT).value


def kernel_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: an 8-bit one as its bytes."""
    return kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache


def fp8_unit(dtype: torch.dtype) -> float:
    """What a decoded fp8 element is multiplied by (besides its layer's scale) to be its value."""
    return E4M3_UNIT if dtype == torch.float8_e4m3fn else 1.0


@triton.jit
def decode_fp8(b, E5M2: tl.constexpr):
    """fp8 bytes (uint8) as float16, exactly; an e4m3 value comes out 2^-8 times its value (E4M3_UNIT)."""
    h = b.to(tl.uint16)
    if E5M2:
        h = h << 8  # e5m2 is float16's top byte
    else:
        # Exponent and mantissa land in float16's low exponent bits; the 7-vs-15 bias gap is the 2^-8.
        h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        h = tl.where((b & 0x7F) == 0x7F, h | 0x7E00, h)  # e4m3fn's only NaN; it has no infinity
    return h.to(tl.float16, bitcast=True)


@triton.jit
def load_int8_row_scale(row_ptr, mask, HEAD_DIM: tl.constexpr):
    """The float16 scale after each int8 row's HEAD_DIM values (little endian), as float32."""
    lo = tl.load(row_ptr + HEAD_DIM, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(row_ptr + HEAD_DIM + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_kv(ptrs, mask, dtype, KV_FORMAT: tl.constexpr):
    """Cache elements as ``dtype``: floats as stored, fp8 as decode_fp8 gives them, int8 as integers."""
    if KV_FORMAT == FORMAT_FLOAT:
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif KV_FORMAT == FORMAT_INT8:
        x = tl.load(ptrs, mask=mask, other=0).to(tl.int8, bitcast=True)
    else:
        x = decode_fp8(tl.load(ptrs, mask=mask, other=0), KV_FORMAT == FORMAT_E5M2)
    return x.to(dtype)


@triton.jit
def _encode_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr):
    """float32 -> fp8 bits as torch's ``.clamp(-max, max).to(fp8)``: saturating, round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(mag, MAX_BITS)  # saturate (infinities too)
    # Below the smallest normal: adding 2^(24 - BIAS - MANT), whose float32 ulp is the fp8 subnormal
    # step, rounds to even; the sum's low bits are then the fp8 code.
    magic_bits: tl.constexpr = (151 - BIAS - MANT) << 23
    magic = tl.full(mag.shape, magic_bits, tl.int32).to(tl.float32, bitcast=True)
    sub = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - magic_bits
    # Normals: rebias the exponent and round the dropped mantissa bits to even (a carry bumps the exponent).
    shift: tl.constexpr = 23 - MANT
    normal = (mag + (((BIAS - 127) << 23) + (1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift
    code = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
    code = tl.where(is_nan, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _quantize_int8(x):
    """Rows [R, D] of float32 as (int8 values, float16 scales [R]), as kv_quant.quantize does."""
    amax = tl.max(tl.abs(x), 1)
    # The default float16 cast rounds to nearest even (the interpreter's explicit "rtne" does not).
    row_scale = tl.minimum(tl.math.div_rn(amax, 127.0), 65504.0).to(tl.float16)
    s = row_scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.where(s > 0.0, s, 1.0)[:, None])
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    # Round half to even as torch.round: 1.5 * 2^23 + y has an ulp of 1, so the (IEEE, never
    # reassociated) sum rounds y; the interpreter has no rint.
    y = (y + 12582912.0) - 12582912.0
    q = tl.where((s > 0.0)[:, None], y, 0.0).to(tl.int8)
    return q, row_scale


@triton.jit
def store_rows(x, row, dims, mask, head_mask, scale, HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr,
                FP8_MANT: tl.constexpr, FP8_BIAS: tl.constexpr, FP8_MAX_BITS: tl.constexpr):
    """Rows [heads, HEAD_DIM_PAD] of x into the cache rows starting at ``row`` [heads], in the cache's format."""
    dst = row[:, None] + dims[None, :]
    if KV_FORMAT == FORMAT_FLOAT:
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    elif KV_FORMAT == FORMAT_INT8:
        q, row_scale = _quantize_int8(x.to(tl.float32))
        tl.store(dst, q.to(tl.uint8, bitcast=True), mask=mask)
        bits = row_scale.to(tl.uint16, bitcast=True)
        tl.store(row + HEAD_DIM, (bits & 0xFF).to(tl.uint8), mask=head_mask)
        tl.store(row + HEAD_DIM + 1, (bits >> 8).to(tl.uint8), mask=head_mask)
    else:
        y = tl.math.div_rn(x.to(tl.float32), scale)  # correctly rounded, as torch's x / scale
        tl.store(dst, _encode_fp8(y, FP8_MANT, FP8_BIAS, FP8_MAX_BITS), mask=mask)
