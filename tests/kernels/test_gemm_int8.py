"""The int8 dot-product matmul on GGUF blocks of every type it takes, against gguf's own dequantization.

On a CPU with AMX, products of 64 rows or more take bfloat16 tiles instead (test_gemm_int8_amx.py);
these tests keep every product on the int8 kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from gguf_blocks import random_blocks

from pagellm.kernels import ops

pytestmark = [
    pytest.mark.skipif(not ops.int8_matmul_available(), reason="no int8 dot products in this build"),
    pytest.mark.usefixtures("no_amx"),  # every product on the int8 kernel, whatever its rows
]


T = GGMLQuantizationType
LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
TYPES = LEGACY + K_QUANTS

# Around the micro-tiles (AVX-512: 6 rows, or one of up to 8; AVX2: 4) and past them.
ROWS = (1, 5, 6, 7, 8, 9, 13, 32, 200)
# (out, in) features: N past a whole panel of 32 (an edge panel) or under one.
SHAPES = {
    **{t: [(50, 64), (40, 576)] for t in LEGACY},
    **{t: [(40, 256), (17, 512), (64, 1536)] for t in K_QUANTS},
}


def reference(raw: np.ndarray, qtype: T) -> torch.Tensor:
    """gguf's float32 dequantization of the blocks, in float64."""
    return torch.from_numpy(dequantize(raw, qtype)).double()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty where /proc/cpuinfo has none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def act_span(qtype: T) -> int:
    """Inputs of a row sharing one activation scale: 256 for the K-quants without VNNI (llama.cpp's Q8_K), 32 otherwise."""
    return ops.int8_activation_span(int(qtype))


def exact_x(rows: int, cols: int, seed: int, span: int = 32) -> torch.Tensor:
    """x whose every span of inputs is 2^e q with integer q in [-127, 127] and max |q| = 127: the
    kernel's quantization of it is lossless, so it computes x @ W.T up to float32 rounding."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, size=(rows, cols // span, span))
    top = rng.integers(0, span, size=(rows, cols // span))
    np.put_along_axis(q, top[..., None], np.where(rng.random((rows, cols // span, 1)) < 0.5, 127, -127), axis=-1)
    scale = 2.0 ** rng.integers(-9, -2, size=(rows, cols // span, 1))
    return torch.from_numpy((q * scale).reshape(rows, cols)).float()


def quantized_x(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """x as the kernel sees it, in float64: per span of inputs, round(x / d) * d with d = amax / 127
    (through the inverse 1 / d, in float32, as the kernel and llama.cpp compute it)."""
    blocks = x.reshape(x.shape[0], -1, span)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse).double() * d.double()).reshape(x.shape)


def assert_float32_close(out: torch.Tensor, x64: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out == x64 @ weight.T + bias up to float32 rounding of the sums: per element 1e-5 of the sum
    of its terms' magnitudes. One quant wrong by one step moves an output ~1e-3 of that."""
    expected = x64 @ weight.T + (0 if bias is None else bias.double())
    bound = 1e-5 * (x64.abs() @ weight.abs().T + (0 if bias is None else bias.double().abs())) + 1e-30
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), f"worst error {(error / bound).max().item():.3g} x the bound"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_types_lists_every_type(qtype: T) -> None:
    assert int(qtype) in ops.int8_types()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_activation_span_is_a_superblock_only_where_summed_as_one(qtype: T) -> None:
    if not cpu_flags():
        pytest.skip("no /proc/cpuinfo flags to tell VNNI by")
    vnni = bool({"avx512_vnni", "avx_vnni"} & cpu_flags())
    assert act_span(qtype) == (256 if qtype in K_QUANTS and not vnni else 32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_linear_int8_is_the_product_with_the_dequantized_blocks(qtype: T) -> None:
    for shape_index, (out_features, in_features) in enumerate(SHAPES[qtype]):
        seed = int(qtype) * 100 + shape_index
        raw = random_blocks(qtype, out_features, in_features, seed)
        weight = reference(raw, qtype)
        packed = ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), in_features)
        assert packed.dtype == torch.uint8 and packed.is_contiguous()
        gen = torch.Generator().manual_seed(seed)
        bias = torch.randn(out_features, generator=gen)
        errors, norms = [], []
        for rows in ROWS:
            for b in (None, bias):
                # Exact activations: every packed weight is gguf's float32 value.
                x = exact_x(rows, in_features, seed + rows, act_span(qtype))
                wide = torch.full((rows, out_features + 9), float("nan"))
                out = wide[:, 4 : 4 + out_features]  # a column slice of a wider output
                ops.linear_int8(out, x, packed, int(qtype), b)
                assert torch.isnan(wide[:, :4]).all() and torch.isnan(wide[:, 4 + out_features :]).all()
                assert_float32_close(out, x.double(), weight, b)
                # Gaussian activations: the quantized product, ~0.5% from the float32 one.
                x = torch.randn(rows, in_features, generator=gen)
                out = torch.empty(rows, out_features)
                ops.linear_int8(out, x, packed, int(qtype), b)
                assert_float32_close(out, quantized_x(x, act_span(qtype)), weight, b)
                full = x.double() @ weight.T + (0 if b is None else b.double())
                errors.append((out.double() - full).norm() ** 2)
                norms.append(full.norm() ** 2)
        # Over all the shape's products: a single row of 17 outputs is too few to judge by.
        assert (sum(errors) / sum(norms)).sqrt().item() < 1e-2


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q5_1, T.Q2_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_may_be_strided(qtype: T) -> None:
    out_features, in_features = 33, 512
    raw = random_blocks(qtype, out_features, in_features, 7)
    wider = torch.zeros(out_features, raw.shape[1] + 16, dtype=torch.uint8)
    wider[:, 8 : 8 + raw.shape[1]] = torch.from_numpy(raw)
    packed = ops.pack_weight_int8(wider[:, 8 : 8 + raw.shape[1]], int(qtype), in_features)
    assert torch.equal(packed, ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), in_features))
    x_wide = exact_x(5, in_features + 512, 3, act_span(qtype))
    x = x_wide[:, 256 : 256 + in_features]  # rows 1024 floats apart
    out = torch.empty(5, out_features)
    ops.linear_int8(out, x, packed, int(qtype), None)
    assert_float32_close(out, x.double(), reference(raw, qtype), None)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_parts_pack_in_place_as_their_rows_one_after_another(qtype: T) -> None:
    # A fused projection's shards (strided views of the file) pack as their concatenation, and
    # interleave=16 as the gate/up order a fused activation needs, without either being built first.
    in_features = 512
    gate, up = (random_blocks(qtype, 64, in_features, seed) for seed in (1, 2))
    wide = torch.zeros(64, gate.shape[1] + 32, dtype=torch.uint8)
    wide[:, 16 : 16 + gate.shape[1]] = torch.from_numpy(gate)
    parts = [wide[:, 16 : 16 + gate.shape[1]], torch.from_numpy(up)]
    both = np.concatenate([gate, up])
    expected = ops.pack_weight_int8(torch.from_numpy(both), int(qtype), in_features)
    assert torch.equal(ops.pack_weight_int8(parts, int(qtype), in_features), expected)
    assert torch.equal(
        ops.pack_weight_int8(parts, int(qtype), in_features, interleave=16),
        ops.pack_weight_int8(torch.from_numpy(interleaved(both)), int(qtype), in_features),
    )
    with pytest.raises(ValueError, match="gate and up groups"):
        ops.pack_weight_int8(parts[:1] + [parts[1][:8]], int(qtype), in_features, interleave=16)


def interleaved(raw: np.ndarray) -> np.ndarray:
    """A gate/up weight's rows (gate first) in groups of 16: 16 gate rows, the same outputs' up rows, ..."""
    d = raw.shape[0] // 2
    return raw.reshape(2, d // 16, 16, -1).transpose(1, 0, 2, 3).reshape(2 * d, -1)


GATED_CASES = [(t, "silu") for t in TYPES] + [
    (t, a) for t in (T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K) for a in ops.FUSED_ACTIVATIONS if a != "silu"
]


@pytest.mark.parametrize("qtype,activation", GATED_CASES, ids=lambda c: getattr(c, "name", c))
def test_gate_up_mode_fuses_the_activation(qtype: T, activation: str) -> None:
    half, in_features = 48, 256 if qtype in K_QUANTS else 96
    raw = random_blocks(qtype, 2 * half, in_features, int(qtype))
    weight = reference(raw, qtype)
    packed = ops.pack_weight_int8(torch.from_numpy(interleaved(raw)), int(qtype), in_features)
    gen = torch.Generator().manual_seed(int(qtype))
    bias = torch.randn(2 * half, generator=gen)
    for rows in ROWS:
        for b in (None, bias):
            for x in (exact_x(rows, in_features, rows, act_span(qtype)), torch.randn(rows, in_features, generator=gen)):
                wide = torch.full((rows, half + 3), float("nan"))
                out = wide[:, 1 : 1 + half]
                ops.linear_int8(out, x, packed, int(qtype), b, activation)
                assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, 1 + half :]).all()
                product = quantized_x(x, act_span(qtype)) @ weight.T + (0 if b is None else b.double())
                expected = ops.gated_and_mul_torch(product, activation)
                torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
                full = x.double() @ weight.T + (0 if b is None else b.double())
                full = ops.gated_and_mul_torch(full, activation)
                # A product of two such sums: about twice the relative error; gpt-oss's up + 1
                # cancels where up is near -1, which magnifies it there.
                bound = 6e-2 if activation == "swiglu_oai" else 2e-2
                assert ((out.double() - full).norm() / full.norm()).item() < bound


def test_bad_inputs_raise_value_errors() -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_K, 64, 256, 1))
    packed = ops.pack_weight_int8(raw, int(T.Q4_K), 256)
    x = torch.randn(3, 256)
    for unsupported in (T.F32, T.F16, T.Q8_1, T.IQ4_NL):
        with pytest.raises(ValueError, match="GGML type"):
            ops.pack_weight_int8(raw, int(unsupported), 256)
        with pytest.raises(ValueError, match="GGML type"):
            ops.linear_int8(torch.empty(3, 64), x, packed, int(unsupported), None)
    with pytest.raises(ValueError, match="multiple of the type's block"):
        ops.pack_weight_int8(raw[:, :72], int(T.Q4_K), 128)
    with pytest.raises(ValueError, match="bytes"):
        ops.pack_weight_int8(raw[:, :143], int(T.Q4_K), 256)
    with pytest.raises(ValueError, match="uint8"):
        ops.pack_weight_int8(raw.to(torch.int8), int(T.Q4_K), 256)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_int8(torch.empty(3, 64), x.double(), packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="x must be"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(256, 3).T, packed, int(T.Q4_K), None)  # strided columns
    with pytest.raises(ValueError, match="multiple of the type's block"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 96), packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="pack_weight_int8"):
        ops.linear_int8(torch.empty(3, 64), torch.randn(3, 512), packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="pack_weight_int8"):  # another type's panels
        ops.linear_int8(torch.empty(3, 64), x, packed, int(T.Q6_K), None)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_int8(torch.empty(3, 70), x, packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="columns"):
        ops.linear_int8(torch.empty(3, 30), x, packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="out must be"):
        ops.linear_int8(torch.empty(4, 64), x, packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="out must be"):
        ops.linear_int8(torch.empty(64, 3).T, x, packed, int(T.Q4_K), None)
    with pytest.raises(ValueError, match="bias"):
        ops.linear_int8(torch.empty(3, 64), x, packed, int(T.Q4_K), torch.randn(63))
    with pytest.raises(ValueError, match="bias"):
        ops.linear_int8(torch.empty(3, 32), x, packed, int(T.Q4_K), torch.randn(32), "silu")
    with pytest.raises(ValueError, match="gate/up"):
        ops.linear_int8(torch.empty(3, 64), x, packed, int(T.Q4_K), None, "silu")
    small = ops.pack_weight_int8(raw[:16], int(T.Q4_K), 256)  # gate and up of 8 outputs: not a group of 16
    with pytest.raises(ValueError, match="gate/up"):
        ops.linear_int8(torch.empty(3, 8), x, small, int(T.Q4_K), None, "gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="no fused kernel"):
        ops.linear_int8(torch.empty(3, 32), x, packed, int(T.Q4_K), None, "gelu")


@pytest.mark.parametrize("qtype", TYPES)
def test_int8_rows_reads_back_exactly_what_gguf_dequantizes(qtype: T) -> None:
    # An embedding table looked up from the panels a tied head multiplies by.
    rows, cols = 70, SHAPES[qtype][-1][1]
    raw = random_blocks(qtype, rows, cols, seed=int(qtype) + 7)
    packed = ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), cols)
    ids = torch.tensor([0, 69, 31, 32, 5, 5, 64])
    got = ops.int8_rows(packed, int(qtype), cols, ids)
    assert got.dtype == torch.float32 and got.shape == (len(ids), cols)
    assert torch.equal(got, reference(raw, qtype).float()[ids])
    with pytest.raises(ValueError, match="outside"):
        ops.int8_rows(packed, int(qtype), cols, torch.tensor([96]))


# Byte ranges, in a K-quant block, of its quants (low bits and high-bit planes): all bits set is
# every quant at its largest.
QUANT_BYTES = {T.Q2_K: [(16, 80)], T.Q3_K: [(0, 96)], T.Q4_K: [(16, 144)], T.Q5_K: [(16, 176)], T.Q6_K: [(0, 192)]}


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("sign", [1, -1])
def test_largest_quants_times_largest_activations_do_not_saturate(qtype: T, sign: int) -> None:
    # Every quant at its top and every activation at +-127: the int16 pair sums (without VNNI, up
    # to 4 steps of a 4-bit group before vpmaddwd) reach their bound and must not saturate.
    out_features, in_features = 40, 512
    raw = random_blocks(qtype, out_features, in_features, seed=int(qtype)).reshape(out_features, -1, GGML_QUANT_SIZES[qtype][1])
    for start, stop in QUANT_BYTES[qtype]:
        raw[..., start:stop] = 0xFF
    raw = raw.reshape(out_features, -1)
    weight = reference(raw, qtype)
    packed = ops.pack_weight_int8(torch.from_numpy(raw), int(qtype), in_features)
    for rows in (4, 7):
        x = torch.full((rows, in_features), sign * 127 * 2.0**-6)
        out = torch.empty(rows, out_features)
        ops.linear_int8(out, x, packed, int(qtype), None)
        assert_float32_close(out, x.double(), weight, None)
