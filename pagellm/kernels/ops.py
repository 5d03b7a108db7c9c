"""pagellm's native CPU ops, one typed function each, and which inputs they take.

The only module that calls ``torch.ops.pagellm_*`` (the library built by
:mod:`pagellm.kernels.build`), so a schema change is one edit here, and the only one that decides
between a kernel and the pure-torch path: the other layers ask :func:`supports` (or an op's own
predicate) or call an op that falls back by itself. Callers reach these functions through the
module (``ops.linear_packed(...)``) so that a test can replace one with ``monkeypatch``.

Ops that write into ``out`` (or update in place) follow the native signature; the elementwise
layer ops return a new tensor and take the torch path for what their kernel does not cover
(another device or dtype, strided rows, or no library).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn import functional as F

from pagellm import envs
from pagellm.kernels.build import load_error as _build_load_error
from pagellm.kernels.build import load_kernels

PAGED_ATTENTION_CACHE_DTYPES = frozenset(
    {torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8}
)
# Caches that take float32 keys and values, converted or quantized as they are written.
_CONVERTING_CACHE_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8})


_amx_switch_read = False
_int8_types: Optional[frozenset[int]] = None  # int8_types(), once known


def available() -> bool:
    """Whether the native library is loaded (built, or loaded from the cache, on the first call)."""
    global _amx_switch_read
    if not load_kernels():
        return False
    if not _amx_switch_read:
        _amx_switch_read = True
        if not envs.amx():
            set_amx(False)
    return True


def load_error() -> Optional[str]:
    """Why the library could not be built or loaded, if it could not."""
    return _build_load_error()


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the float32 CPU kernels take these tensors: all float32 on the CPU, and the library loaded."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


def _rows_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1


# --- attention (paged_attention.cpp) ----------------------------------------------------------


def _padded_rows(kv_cache: torch.Tensor) -> bool:
    """A cache the kernels address by its token stride: contiguous, or a narrow layer's view whose
    token rows are wider than its heads (kv_quant.has_padded_rows; the kernel checks the same)."""
    if kv_cache.is_contiguous():
        return True
    _, num_blocks, block_size, num_kv_heads, width = kv_cache.shape
    kv, block, token, head, element = kv_cache.stride()
    return element == 1 and head == width and token >= num_kv_heads * width and block == block_size * token and kv == num_blocks * block


_head_dims: Optional[frozenset[int]] = None


def paged_attention_head_dims() -> frozenset[int]:
    """The head sizes paged_attention.cpp instantiates its kernel for (its own list); none without the library."""
    global _head_dims
    if _head_dims is None:
        _head_dims = frozenset(torch.ops.pagellm_attn.paged_attention_head_dims()) if available() else frozenset()
    return _head_dims


def paged_attention_supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_attention` covers this query and cache (otherwise attend in torch)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and kv_cache.dtype in PAGED_ATTENTION_CACHE_DTYPES
        and (kv_cache.is_contiguous() or _padded_rows(kv_cache))
        and query.shape[-1] in paged_attention_head_dims()
    )


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    prefetch_to_l2: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: Optional[int] = None,
    logits_soft_cap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> None:
    """Attention of ``query`` ``[T, heads, dim]`` over each sequence's paged context, into ``out``.

    ``prefetch_to_l2``: decode prefetches the next keys and values into L2 only rather than L1;
    which is faster depends on the core (:class:`pagellm.kernels.tuning.CpuTuning`).
    ``k_scale`` / ``v_scale``: an fp8 cache's per-layer scales (pagellm.attention.kv_quant).
    ``sliding_window``, ``logits_soft_cap``, ``sinks``: a layer's AttentionOptions
    (pagellm.attention.backend), already validated; None for off. ``kv_cache`` may be a narrow
    layer's view with padded rows (:func:`_padded_rows`): the kernel reads its token stride.
    """
    if sliding_window is None and logits_soft_cap is None and sinks is None:
        # Plain attention: the schema's defaults for the options, nothing more to convert.
        torch.ops.pagellm_attn.paged_attention(
            out, query, kv_cache, block_table, seq_lens, query_start_loc, float(scale), float(k_scale), float(v_scale), prefetch_to_l2
        )
        return
    torch.ops.pagellm_attn.paged_attention(
        out,
        query,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        float(scale),
        float(k_scale),
        float(v_scale),
        prefetch_to_l2,
        min(int(sliding_window or 0), 2**31 - 1),  # an int32 in the kernel; any window past every context is the same
        float(logits_soft_cap or 0.0),
        None if sinks is None else sinks.to(torch.float32).contiguous(),
    )


def write_kv_cache_supports(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Whether :func:`write_kv_cache` takes these: each token's heads contiguous, int64 slots, and
    keys/values of the cache's dtype, or float32 for a 16- or 8-bit cache (converted or quantized
    as written; an 8-bit cache takes only float32)."""
    converts = kv_cache.dtype in _CONVERTING_CACHE_DTYPES and key.dtype == torch.float32
    same = key.dtype == kv_cache.dtype and kv_cache.element_size() > 1
    return (
        kv_cache.device.type == "cpu"
        and (same or converts)
        and value.dtype == key.dtype
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and key.stride(-2) == key.shape[-1]
        and value.stride(-2) == value.shape[-1]
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and available()
    )


def write_kv_cache(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatters this step's keys and values ``[T, kv_heads, dim]`` into their cache slots: one
    copy (or conversion, or quantization: byte for byte what ``kv_quant.quantize`` gives) per
    token row, spread over the threads, without index_copy_'s generic machinery. The cache may be
    a narrow layer's view with padded rows (kv_quant.narrow_kv_view): tokens at its stride(2)."""
    torch.ops.pagellm_attn.write_kv_cache(kv_cache, key, value, slot_mapping, float(k_scale), float(v_scale))


# --- layer ops (layer_ops.cpp) ----------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension, as a new tensor."""
    if supports(x) and _rows_contiguous(x):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.pagellm_ops.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm`'s torch path, which the kernel must agree with."""
    # Statistics in float32 as transformers does, so half-precision models do not lose range.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def group_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x * silu(z))`` with the norm over each run of ``group_size`` channels
    (Mamba-2's gated norm), as a new tensor in x's dtype."""
    if supports(x, z) and _rows_contiguous(x) and _rows_contiguous(z) and weight.dtype == torch.float32:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.pagellm_ops.group_gated_rms_norm(out, x, z, weight, group_size, eps)
        return out
    return group_gated_rms_norm_torch(x, z, weight, group_size, eps)


def group_gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """:func:`group_gated_rms_norm`'s torch path, transformers' order: the gated value and its
    statistics in float32, cast back, then times the weight."""
    y = x.float() * F.silu(z.float())
    groups = y.view(*y.shape[:-1], -1, group_size)
    y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view_as(y)
    return weight * y.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Adds ``x`` to ``residual`` and normalises the sum: returns ``(normalised, sum)``. Both
    inputs are overwritten (the kernel leaves the normalised sum in ``x``, the sum in ``residual``)."""
    if supports(x) and _rows_contiguous(x) and residual.stride(-1) == 1 and residual.shape == x.shape:
        torch.ops.pagellm_ops.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = residual.add_(x)
    return rms_norm_torch(residual, weight, eps), residual


# The gated activations ``act(gate) * up`` the kernels apply, fused into a gate/up product's epilogue
# or after it (gated_and_mul), with their codes in the C++ kernels (vec.h's GatedAct). Names are
# transformers' ``hidden_act``; swiglu_oai is gpt-oss's clamped SwiGLU with these constants.
FUSED_ACTIVATIONS: dict[str, int] = {"silu": 1, "gelu_pytorch_tanh": 2, "swiglu_oai": 3}
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def activation_code(activation: Optional[str]) -> int:
    """The kernels' code of a gated activation (0: none, a plain product); ValueError for others."""
    if activation is None:
        return 0
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(f"no fused kernel for the activation {activation!r}; fused: {', '.join(FUSED_ACTIVATIONS)}")
    return FUSED_ACTIVATIONS[activation]


def gated_and_mul_torch(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[:, :d]) * x[:, d:]`` in torch, as transformers computes each activation."""
    gate, up = x.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))
    raise ValueError(f"no gated form of {activation!r}")


def gated_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[:, :d]) * x[:, d:]`` for a gate/up projection's output ``[T, 2d]``: the kernel's form
    (the same arithmetic as the fused epilogues) where it runs, else torch's."""
    code = activation_code(activation)
    if supports(x) and _rows_contiguous(x):
        out = torch.empty((x.shape[0], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        torch.ops.pagellm_ops.gated_and_mul(out, x, code)
        return out
    return gated_and_mul_torch(x, activation)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for a gate/up projection's output ``[T, 2d]``."""
    return gated_and_mul(x, "silu")


def rotary_embedding(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Rotates the first ``num_heads`` heads of each row of ``qkv`` (float32 on CPU, rows
    contiguous; check with :func:`supports`) in place. ``cos``/``sin`` are whole tables
    ``[max_positions, head_dim // 2]``, gathered by position inside the kernel."""
    torch.ops.pagellm_ops.rotary_embedding(qkv, positions, cos, sin, num_heads, head_dim)


# --- packed small-batch matmul (gemm.cpp) -----------------------------------------------------


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight ``[N, K]`` as float32 panels for :func:`linear_packed`."""
    return torch.ops.pagellm_gemm.pack_weight(weight)


def pack_weight_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up weight ``[2d, K]`` (gate rows first) as panels for :func:`linear_packed_gated`;
    ValueError when ``d`` is not a whole number of vectors."""
    return torch.ops.pagellm_gemm.pack_weight_gate_up(weight)


def linear_packed(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``out = x @ W.T (+ bias)`` with ``W``'s float32 panels from :func:`pack_weight`."""
    torch.ops.pagellm_gemm.linear_packed(out, x, packed, bias)


def linear_packed_gated(
    out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], activation: str
) -> None:
    """``out = act(x @ gate.T + b_g) * (x @ up.T + b_u)`` with panels from :func:`pack_weight_gate_up`
    (``bias``: gate's then up's, ``2d``), the activation one of :data:`FUSED_ACTIVATIONS`."""
    torch.ops.pagellm_gemm.linear_packed_gated(out, x, packed, bias, activation_code(activation))


# --- int8 dot products for GGUF block weights (gemm_int8.cpp) ----------------------------------


def int8_matmul_available() -> bool:
    """Whether :func:`linear_int8` can run: the library is loaded and was built with int8 dot
    products (AVX2 or AVX512-BW; VNNI's where the CPU has them)."""
    return available() and bool(torch.ops.pagellm_gemm_int8.int8_supported())


def int8_types() -> frozenset[int]:
    """The GGML type ids (``gguf.GGMLQuantizationType``) whose blocks :func:`pack_weight_int8`
    takes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K ... Q6_K; empty without the library or its int8 dot products."""
    global _int8_types
    if _int8_types is None:  # asked per tensor at load, hundreds of times, and each op call crosses into the library
        _int8_types = frozenset(int(t) for t in torch.ops.pagellm_gemm_int8.int8_types()) if available() else frozenset()
    return _int8_types


def int8_activation_span(ggml_type: int) -> int:
    """Inputs of a row that share one activation scale in :func:`linear_int8` for ``ggml_type``:
    256 for a K-quant on a CPU without VNNI (llama.cpp's Q8_K, summed per superblock), 32 otherwise."""
    return int(torch.ops.pagellm_gemm_int8.int8_activation_span(ggml_type))


def pack_weight_int8(
    raw: torch.Tensor | list[torch.Tensor], ggml_type: int, in_features: int, interleave: int = 0
) -> torch.Tensor:
    """A GGUF weight's blocks, uint8 ``[N, row bytes]`` (each row one output's blocks in file order,
    rows contiguous), repacked for :func:`linear_int8`: uint8 panels of 32 outputs holding exactly
    the values gguf dequantizes them to. A list of such tensors is the weight of their rows one
    after another, read in place (a fused projection's shards, never concatenated). For a fused
    gated activation, ``interleave=16`` takes the rows' first half (gate) and second half (up)
    alternately, 16 rows at a time. ValueError for a type not in :func:`int8_types` or
    ``in_features`` not a multiple of its block."""
    parts = [raw] if isinstance(raw, torch.Tensor) else list(raw)
    return torch.ops.pagellm_gemm_int8.pack_weight_int8(parts, ggml_type, in_features, interleave)


def int8_rows(packed: torch.Tensor, ggml_type: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a weight packed by :func:`pack_weight_int8`, as float32 ``[len(ids), in_features]``:
    exactly the values gguf dequantizes the file's blocks to (an embedding table kept only as panels)."""
    return torch.ops.pagellm_gemm_int8.int8_rows(packed, ggml_type, in_features, ids)


def linear_int8(
    out: torch.Tensor,
    x: torch.Tensor,
    packed: torch.Tensor,
    ggml_type: int,
    bias: Optional[torch.Tensor],
    activation: Optional[str] = None,
) -> None:
    """``out = x @ W.T (+ bias)`` on x quantized per 32 inputs (int8 dot products are faster), ``packed``
    from :func:`pack_weight_int8` for ``ggml_type``. ``x`` and ``out`` float32 with contiguous rows
    (``out`` may be a column slice of a wider tensor). With a gated ``activation`` (one of
    :data:`FUSED_ACTIVATIONS`), for rows interleaved in groups of 16, ``out [M, d] = act(x @ gate.T)
    * (x @ up.T)``, ``bias`` then gate's then up's (``2d``, not interleaved); ValueError unless ``d``
    is a multiple of 16."""
    torch.ops.pagellm_gemm_int8.linear_int8(out, x, packed, ggml_type, bias, activation_code(activation))


def moe_int8(
    out: torch.Tensor,
    x: torch.Tensor,
    gate_up: list[torch.Tensor],
    gate_up_type: int,
    down: list[torch.Tensor],
    down_type: int,
    counts: torch.Tensor,
    activation: str = "silu",
) -> None:
    """A mixture-of-experts layer's experts in one call. ``x`` float32 ``[P, H]`` holds the rows sorted
    by expert (``counts``, int64 ``[experts]``, says how many each has, in expert order); expert
    ``e``'s rows go through ``act(x @ gate.T) * (x @ up.T)`` with ``gate_up[e]`` (packed by
    :func:`pack_weight_int8` with ``interleave=16``) and then ``down[e]`` into the same rows of
    ``out`` ``[P, H_out]``. Bit for bit the two :func:`linear_int8` calls per expert; every expert's
    gate_up has one type and width, and so has every down. ValueError for shapes that do not fit."""
    torch.ops.pagellm_gemm_int8.moe_int8(out, x, gate_up, gate_up_type, down, down_type, counts, activation_code(activation))


def moe_int8_available() -> bool:
    """Whether :func:`moe_int8` can run (the loaded library has it, with int8 dot products)."""
    return int8_matmul_available() and hasattr(torch.ops.pagellm_gemm_int8, "moe_int8")


# --- sampling (sampling.cpp) ------------------------------------------------------------------


def sample_from_logits(out: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> None:
    """Per row: the token where the CDF of softmax(``logits / temperature``) first exceeds the
    uniform ``u``, into int64 ``out`` (temperatures below 1e-5 sample at 1, as the torch path's
    greedy rows do); no top-k, top-p or min-p."""
    torch.ops.pagellm_sample.sample_from_logits(out, logits, temperature, u)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, int64 ``[B]``; the kernel follows torch's rule for ties and NaN."""
    if not (supports(logits) and _rows_contiguous(logits)):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    torch.ops.pagellm_sample.argmax_rows(out, logits)
    return out


# --- low-precision matmul (gemm_bf16.cpp, gemm_int8.cpp) ---------------------------------------


def bf16_matmul_available() -> bool:
    """Whether the library has the bfloat16 dot-product matmul (built for a CPU with AVX512_BF16)."""
    return available() and bool(torch.ops.pagellm_gemm_bf16.bf16_supported())


def amx_available() -> bool:
    """Whether products of a few rows or more run on AMX tiles: built for and running on a CPU with
    AMX-BF16 (Sapphire Rapids and later), the tile state granted by the kernel."""
    return available() and bool(torch.ops.pagellm_gemm_bf16.amx_supported())


def set_amx(on: bool) -> bool:
    """Turns the AMX path off (or back on, where available) for the process, for A/B runs and
    tests; returns whether it was on."""
    return bool(torch.ops.pagellm_gemm_bf16.set_amx(on))


def pack_weight_bf16(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """A float32 weight ``[N, K]`` rounded to bfloat16 panels for :func:`linear_bf16`, or a
    bfloat16 one packed as it is (from its own bytes, no float32 copy); the same panels either way
    for the same bfloat16 values. With ``gate_up`` a gate/up weight ``[2d, K]`` for a fused gated
    activation (ValueError unless ``d`` is a multiple of 16)."""
    return torch.ops.pagellm_gemm_bf16.pack_weight_bf16(weight, gate_up)


def linear_bf16(
    out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str] = None
) -> None:
    """``out = x @ W.T (+ bias)`` with ``x`` rounded to bfloat16 and float32 sums; with a gated
    ``activation`` (panels packed with ``gate_up``), ``act(x @ gate.T + b_g) * (x @ up.T + b_u)``
    (``bias``: gate's then up's). ``packed`` from :func:`pack_weight_bf16`."""
    torch.ops.pagellm_gemm_bf16.linear_bf16(out, x, packed, bias, activation_code(activation))


# --- batched multi-LoRA (lora_shrink_expand.cpp) ------------------------------------------------

# A run of at least this many rows of one adapter goes to ATen's matmul inside the kernel rather
# than its own loops (docs/kernels.md has the measurement).
LORA_ATEN_MIN_ROWS = 128


def _check_lora_args(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> None:
    """The shape and dtype rules the kernel enforces, for the torch path (ValueError)."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("lora_shrink_expand: x must be a contiguous float32 [num_tokens, in_features] tensor")
    if y.dim() != 2 or y.dtype != torch.float32 or y.stride(-1) != 1 or y.stride(0) < y.shape[1] or y.shape[0] != x.shape[0]:
        raise ValueError("lora_shrink_expand: y must be a float32 [num_tokens, out_features] tensor with contiguous rows and x's rows")
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("lora_shrink_expand: lora_a and lora_b must both be float32 or both bfloat16")
    if lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError("lora_shrink_expand: lora_a must be [num_slots, max_rank, in_features] with x's in_features")
    if lora_b.dim() != 3 or (lora_b.shape[0], lora_b.shape[1], lora_b.shape[2]) != (lora_a.shape[0], y.shape[1], lora_a.shape[1]):
        raise ValueError("lora_shrink_expand: lora_b must be [num_slots, out_features, max_rank] matching lora_a and y")
    if seg_starts.dtype != torch.int64 or seg_starts.dim() != 1 or seg_starts.numel() < 1:
        raise ValueError("lora_shrink_expand: seg_starts must be a contiguous int64 [num_segments + 1] tensor")
    if seg_slots.dtype != torch.int64 or seg_slots.dim() != 1 or seg_slots.numel() != seg_starts.numel() - 1:
        raise ValueError("lora_shrink_expand: seg_slots must be a contiguous int64 [num_segments] tensor")


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    aten_min_rows: Optional[int] = None,
) -> None:
    """For each segment ``s`` with slot ``k = seg_slots[s] >= 0``, rows ``a, b = seg_starts[s], seg_starts[s + 1]``:
    ``y[a:b] += (x[a:b] @ lora_a[k].T) @ lora_b[k].T``, in place; slot -1 leaves its rows alone.

    ``x`` ``[T, in]`` float32 contiguous and ``y`` ``[T, out]`` float32 with contiguous rows (a column
    slice of a wider product, such as one shard of a fused projection, is updated in place); the adapter pool ``lora_a``
    ``[slots, max_rank, in]`` and ``lora_b`` ``[slots, out, max_rank]`` both float32 or both
    bfloat16 (sums in float32; a smaller rank zero-padded, its scaling folded into ``lora_b``);
    ``seg_starts`` int64 ``[segments + 1]`` ascending, ``seg_slots`` int64 ``[segments]``. The
    kernel reads each used slot's weights once per call (its rows grouped) and hands runs of at
    least ``aten_min_rows`` rows of one slot (default: ``LORA_ATEN_MIN_ROWS`` when called) to ATen's
    matmul. ValueError for inputs that do not fit.
    On another device or without the library: :func:`lora_shrink_expand_reference`.
    """
    tensors = (y, x, lora_a, lora_b, seg_starts, seg_slots)
    if all(t.device.type == "cpu" for t in tensors) and available():
        min_rows = LORA_ATEN_MIN_ROWS if aten_min_rows is None else int(aten_min_rows)
        torch.ops.pagellm_lora.lora_shrink_expand(y, x, lora_a, lora_b, seg_starts, seg_slots, min_rows)
        return
    lora_shrink_expand_reference(y, x, lora_a, lora_b, seg_starts, seg_slots)


def lora_shrink_expand_reference(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> None:
    """:func:`lora_shrink_expand` in plain torch, one pair of matmuls per segment: the kernel's
    oracle and its path on other devices."""
    _check_lora_args(y, x, lora_a, lora_b, seg_starts, seg_slots)
    starts = seg_starts.tolist()
    slots = seg_slots.tolist()
    if starts[0] < 0 or starts[-1] > x.shape[0] or any(a > b for a, b in zip(starts, starts[1:])):
        raise ValueError(f"lora_shrink_expand: seg_starts must be ascending within [0, {x.shape[0]}]")
    for s, slot in enumerate(slots):
        if not -1 <= slot < lora_a.shape[0]:
            raise ValueError(f"lora_shrink_expand: seg_slots[{s}] = {slot} is not -1 or a slot of the pool of {lora_a.shape[0]}")
        a, b = starts[s], starts[s + 1]
        if slot < 0 or a == b:
            continue
        shrunk = x[a:b] @ lora_a[slot].float().T
        y[a:b] += shrunk @ lora_b[slot].float().T


# --- recurrent layers (recurrent.cpp): causal conv1d and the gated delta rule ----------------------


def _recurrent_ops_loaded() -> bool:
    return available() and hasattr(torch.ops.pagellm_recurrent, "gated_delta_rule")


def causal_conv1d_supports(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> bool:
    """Whether :func:`causal_conv1d` covers these tensors: CPU, x and the state each float32 or bfloat16."""
    return (
        all(t.device.type == "cpu" for t in (x, weight, conv_state))
        and x.dtype in (torch.float32, torch.bfloat16)
        and conv_state.dtype in (torch.float32, torch.bfloat16)
        and conv_state.is_contiguous()
        and _recurrent_ops_loaded()
    )


def _conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[C, K]`` as float32 ``[K, C]`` (one row per tap, vectorised over channels),
    made once per weight and kept on it, not once per call."""
    cached = getattr(weight, "_pagellm_conv_taps", None)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    taps = weight.detach().to(torch.float32).t().contiguous()
    weight._pagellm_conv_taps = (weight._version, taps)
    return taps


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: torch.Tensor,
    activation: Optional[str],
) -> torch.Tensor:
    """pagellm.kernels.recurrent.causal_conv1d's C++ kernel (check :func:`causal_conv1d_supports`); returns out."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.pagellm_recurrent.causal_conv1d(
        out,
        # Rows may lie apart (a column slice of a wider projection), each contiguous.
        x if x.stride(-1) == 1 and x.stride(0) >= x.shape[-1] else x.contiguous(),
        _conv_taps(weight),
        None if bias is None else bias.to(torch.float32).contiguous(),
        conv_state,
        query_start_loc.to(torch.int64).contiguous(),
        slot_ids.to(torch.int64).contiguous(),
        has_initial_state.to(torch.bool).contiguous(),
        checkpoints.to(torch.int64).reshape(-1, 3).contiguous(),
        activation is not None,
    )
    return out


def gated_delta_rule_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether :func:`gated_delta_rule` covers these tensors: CPU, q/k/v float32 or bfloat16, a contiguous
    float32 or bfloat16 state."""
    return (
        all(t.device.type == "cpu" for t in (q, k, v, state))
        and all(t.dtype in (torch.float32, torch.bfloat16) for t in (q, k, v))
        and state.dtype in (torch.float32, torch.bfloat16)
        and state.is_contiguous()
        and _recurrent_ops_loaded()
    )


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """pagellm.kernels.recurrent.gated_delta_rule's C++ kernel (check :func:`gated_delta_rule_supports`); returns out."""
    out = torch.empty(v.shape, dtype=v.dtype)
    torch.ops.pagellm_recurrent.gated_delta_rule(
        out,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.to(torch.float32).contiguous(),
        beta.to(torch.float32).contiguous(),
        state,
        query_start_loc.to(torch.int64).contiguous(),
        slot_ids.to(torch.int64).contiguous(),
        has_initial_state.to(torch.bool).contiguous(),
        checkpoints.to(torch.int64).reshape(-1, 3).contiguous(),
        float(scale),
        bool(use_qk_l2norm),
    )
    return out


# --- Mamba-2 selective state scan (mamba.cpp) ----------------------------------------------------------


def _mamba_ops_loaded() -> bool:
    return available() and hasattr(torch.ops.pagellm_mamba, "selective_state_scan")


def selective_state_scan_supports(x: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether :func:`selective_state_scan` covers these tensors: CPU, x float32 or bfloat16, a contiguous
    float32 or bfloat16 state."""
    return (
        x.device.type == "cpu"
        and state.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and state.dtype in (torch.float32, torch.bfloat16)
        and state.is_contiguous()
        and _mamba_ops_loaded()
    )


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[T, a, b]`` as float32 whose ``[a, b]`` part is contiguous; a view of split projections
    (any token stride) is taken as is."""
    t = t.to(torch.float32)
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def selective_state_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: torch.Tensor,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """pagellm.kernels.mamba.selective_state_scan's C++ kernel (check :func:`selective_state_scan_supports`); returns y."""
    if not (x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]):
        x = x.contiguous()
    dt = dt.to(torch.float32)
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    B, C = _rows_of(B), _rows_of(C)
    if B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.pagellm_mamba.selective_state_scan(
        out,
        x,
        dt,
        A.to(torch.float32).contiguous(),
        B,
        C,
        D.to(torch.float32).contiguous(),
        dt_bias.to(torch.float32).contiguous(),
        state,
        query_start_loc.to(torch.int64).contiguous(),
        slot_ids.to(torch.int64).contiguous(),
        has_initial_state.to(torch.bool).contiguous(),
        checkpoints.to(torch.int64).reshape(-1, 3).contiguous(),
        float(dt_limit[0]),
        float(dt_limit[1]),
    )
    return out
