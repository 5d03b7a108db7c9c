// y = x W^T (+ b) with integer dot products, for weights that are exactly GGUF-style blocks
// (quant_blocks.h), as llama.cpp computes them.
//
// gemm.cpp expands such blocks back into float32 and spends one FMA per weight and row. Here the
// activations are quantized too, on the fly, once per call: every 32 inputs of a row become
// qa = round(x / da) with da = amax / 127, and the product of a weight block with an activation
// block is one int32 sum of byte products, which `vpdpbusd` (AVX512-VNNI, or the 256-bit AVX-VNNI
// form) computes four at a time per lane: 64 multiply-adds per instruction where an FMA does 16.
// Each block's int32 sum is scaled to float once per 32 inputs:
//   4-bit (w = d q + m, q in 0..15):  sum w x ~ d da sum(q qa) + m da sum(qa)
//   8-bit (w = d q, q in -128..127):  stored as q + 128 (vpdpbusd multiplies unsigned bytes by
//     signed ones), so the sum starts at -128 sum(qa) to cancel the offset.
// The result is exactly the product of W with the quantized x (up to float rounding): the error
// against float32 is that of 8-bit activations (figures in docs/kernels.md).
//
// Weights are packed once into panels of NR = 2 W output columns, block-major; in each block the
// bytes are ordered so that one vector load holds, for the W columns of one vector, 4 consecutive
// k of each column (a "k-quad"), the order vpdpbusd sums in; 4-bit blocks hold two k-quads per
// byte (low and high nibbles). The activations are stored by row block, k-quad-major, so a
// micro-tile's broadcasts are fixed offsets from one pointer. A micro-tile multiplies one panel by
// one row block over the whole K (a panel is at most a few dozen KiB: it stays in L2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "vec.h"
#include "weight_layout.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGELLM_INT8 1
#elif defined(__AVXVNNI__)
#define PAGELLM_INT8 1
#else
#define PAGELLM_INT8 0
#endif

namespace pagellm {
namespace {

constexpr int QUADS = QK / 4;                        // k-quads per block
constexpr int kQuadBytes = 4 * W;                    // one k-quad of one column vector: one vector load
constexpr int64_t kI4BlockBytes = NR * 8 + QK * W;   // float d[NR], float m[NR], nibbles
constexpr int64_t kI8BlockBytes = NR * 4 + QK * NR;  // float d[NR], bytes q + 128

#if PAGELLM_INT8

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using ivec = __m512i;
// Rows per micro-tile: 4 accumulators a row (2 int, 2 float) x 6, 4 weight vectors and a mask use
// 29 of the 32 registers. A batch of up to 8 rows is one tile even so: reading and unpacking the
// panel once outweighs the spills (docs/kernels.md).
constexpr int MR = 6, MR_MAX = 8;
inline ivec load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec splat_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline ivec high_nibbles(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline ivec dpbusd(ivec acc, ivec u8, ivec s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
inline vint round_to_int(vfloat v) { return (vint)_mm512_cvtps_epi32((__m512)v); }
#else
using ivec = __m256i;
// 4 accumulators a row do not leave room for 3 rows in 16 registers, but the float ones are
// touched once per block, and spilling them cost less than a third tile's unpacking (docs/kernels.md).
constexpr int MR = 3, MR_MAX = 3;
inline ivec load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec splat_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline ivec high_nibbles(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline ivec dpbusd(ivec acc, ivec u8, ivec s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
inline vint round_to_int(vfloat v) { return (vint)_mm256_cvtps_epi32((__m256)v); }
#endif
static_assert(sizeof(ivec) == kQuadBytes, "one k-quad of a column vector is one register");

typedef int8_t vbyte __attribute__((vector_size(W)));

// 4 bytes as one int32 lane value; memcpy, which the compiler folds into the broadcast's load.
inline int32_t quad_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// x quantized per block of 32 inputs, by row block of up to MR_MAX rows: qa [row blocks][K / 4]
// [MR_MAX][4], and per [row block][block][MR_MAX]: da, da * sum(qa) (4-bit) and -128 * sum(qa) (8-bit).
struct Activations {
  const int8_t* qa;
  const float* da;
  const float* da_sum;
  const int32_t* neg128_sum;
  int64_t k, num_blocks;
};

// m rows split into one row block (up to MR_MAX rows) or ceil(m / MR) of as even sizes as can be
// (32 rows: 6, 6, 5, 5, 5, 5 rather than 5 x 6 and 2): a tile of few rows spends more per row on
// unpacking the weights.
struct RowBlocks {
  int64_t count, base, extra;  // the first `extra` blocks have base + 1 rows, the others base
  explicit RowBlocks(int64_t m) : count(m <= MR_MAX ? 1 : (m + MR - 1) / MR), base(m / count), extra(m % count) {}
  int64_t start(int64_t j) const { return j * base + std::min(j, extra); }
  int rows(int64_t j) const { return static_cast<int>(base + (j < extra ? 1 : 0)); }
  int64_t block_of(int64_t r) const {
    const int64_t split = extra * (base + 1);
    return r < split ? r / (base + 1) : extra + (r - split) / base;
  }
};

// Rows [r0, r1) of x into the layout above.
void quantize_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, const RowBlocks& blocks, int8_t* qa,
                   float* da, float* da_sum, int32_t* neg128_sum) {
  const int64_t num_blocks = k / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t rb = blocks.block_of(r), lane = r - blocks.start(rb);
    const float* row = x + r * ldx;
    for (int64_t b = 0; b < num_blocks; ++b) {
      vfloat v[QK / W];
      vfloat amax{};
      for (int i = 0; i < QK / W; ++i) {
        v[i] = vload(row + b * QK + i * W);
        const vfloat a = v[i] < vfloat{} ? -v[i] : v[i];
        amax = vmax(amax, a);
      }
      // As llama.cpp's quantize_row_q8_1: the scale, then its inverse, so that |qa| <= 127.
      const float d = hmax(amax) / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t q[QK];
      vint sum{};
      for (int i = 0; i < QK / W; ++i) {
        const vint t = round_to_int(v[i] * id);
        sum += t;
        const vbyte bytes = __builtin_convertvector(t, vbyte);
        std::memcpy(q + i * W, &bytes, sizeof(bytes));
      }
      // |sum| < 2^24: exact in float, and a shuffle reduction rather than W lane extractions.
      const int32_t s = static_cast<int32_t>(hsum(to_float(sum)));
      int8_t* dst = qa + (rb * (k / 4) + b * QUADS) * MR_MAX * 4 + lane * 4;
      for (int j = 0; j < QUADS; ++j) std::memcpy(dst + j * MR_MAX * 4, q + j * 4, 4);
      const int64_t at = (rb * num_blocks + b) * MR_MAX + lane;
      da[at] = d;
      da_sum[at] = d * static_cast<float>(s);
      neg128_sum[at] = -128 * s;
    }
  }
}

// out[r0 + r] = bias + x_r W^T for the R rows of row block `rb` (from row r0) and one panel (`ncols` of its columns
// stored), or with kSiluMul silu(gate) * up, W values a row. `ahead` (the next panel, or null) is
// pulled towards the cache a block at a time while this one is multiplied.
template <int R, bool kQ4, bool kSiluMul>
void micro_tile(const Activations& act, int64_t rb, int64_t r0, const uint8_t* panel, const float* bias0,
                const float* bias1, float* c, int64_t ldc, int ncols, const uint8_t* ahead) {
  constexpr int64_t kBlockBytes = kQ4 ? kI4BlockBytes : kI8BlockBytes;
  vfloat acc0[R], acc1[R];
  const vfloat b0 = bias0 != nullptr ? vload(bias0) : vfloat{}, b1 = bias1 != nullptr ? vload(bias1) : vfloat{};
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  const int8_t* qa = act.qa + rb * act.k * MR_MAX;
  const int64_t scales = rb * act.num_blocks * MR_MAX;
  for (int64_t b = 0; b < act.num_blocks; ++b, qa += QK * MR_MAX) {
    const uint8_t* block = panel + b * kBlockBytes;
    if (ahead != nullptr)
      for (int64_t line = 0; line < kBlockBytes; line += 64) __builtin_prefetch(ahead + b * kBlockBytes + line, 0, 2);
    const float* d = reinterpret_cast<const float*>(block);
    const int64_t s = scales + b * MR_MAX;
    ivec i0[R], i1[R];
    if constexpr (kQ4) {
      for (int r = 0; r < R; ++r) i0[r] = i1[r] = splat_i32(0);
      const uint8_t* qs = block + NR * 8;
      for (int i = 0; i < QUADS / 2; ++i) {
        const ivec w0 = load_bytes(qs + (2 * i) * kQuadBytes), w1 = load_bytes(qs + (2 * i + 1) * kQuadBytes);
        const ivec lo0 = low_nibbles(w0), hi0 = high_nibbles(w0), lo1 = low_nibbles(w1), hi1 = high_nibbles(w1);
        for (int r = 0; r < R; ++r) {
          const ivec a_lo = splat_i32(quad_at(qa + ((2 * i) * MR_MAX + r) * 4));
          const ivec a_hi = splat_i32(quad_at(qa + ((2 * i + 1) * MR_MAX + r) * 4));
          i0[r] = dpbusd(dpbusd(i0[r], lo0, a_lo), hi0, a_hi);
          i1[r] = dpbusd(dpbusd(i1[r], lo1, a_lo), hi1, a_hi);
        }
      }
      const vfloat d0 = vload(d), d1 = vload(d + W), m0 = vload(d + NR), m1 = vload(d + NR + W);
      for (int r = 0; r < R; ++r) {
        const vfloat da = vsplat(act.da[s + r]), da_sum = vsplat(act.da_sum[s + r]);
        // Two separate updates: two FMAs, where one expression would take an FMA and an add.
        acc0[r] += to_float((vint)i0[r]) * (d0 * da);
        acc0[r] += m0 * da_sum;
        acc1[r] += to_float((vint)i1[r]) * (d1 * da);
        acc1[r] += m1 * da_sum;
      }
    } else {
      for (int r = 0; r < R; ++r) i0[r] = i1[r] = splat_i32(act.neg128_sum[s + r]);
      const uint8_t* qs = block + NR * 4;
      for (int j = 0; j < QUADS; ++j) {
        const ivec w0 = load_bytes(qs + (2 * j) * kQuadBytes), w1 = load_bytes(qs + (2 * j + 1) * kQuadBytes);
        for (int r = 0; r < R; ++r) {
          const ivec a = splat_i32(quad_at(qa + (j * MR_MAX + r) * 4));
          i0[r] = dpbusd(i0[r], w0, a);
          i1[r] = dpbusd(i1[r], w1, a);
        }
      }
      const vfloat d0 = vload(d), d1 = vload(d + W);
      for (int r = 0; r < R; ++r) {
        const vfloat da = vsplat(act.da[s + r]);
        acc0[r] += to_float((vint)i0[r]) * (d0 * da);
        acc1[r] += to_float((vint)i1[r]) * (d1 * da);
      }
    }
  }
  float edge[NR];
  for (int r = 0; r < R; ++r) {
    float* row = c + (r0 + r) * ldc;
    if constexpr (kSiluMul) {
      vstore(row, silu(acc0[r]) * acc1[r]);
    } else if (ncols == NR) {
      vstore(row, acc0[r]);
      vstore(row + W, acc1[r]);
    } else {
      vstore(edge, acc0[r]);
      vstore(edge + W, acc1[r]);
      std::memcpy(row, edge, ncols * sizeof(float));
    }
  }
}

using MicroTile = void (*)(const Activations&, int64_t, int64_t, const uint8_t*, const float*, const float*, float*,
                           int64_t, int, const uint8_t*);

template <bool kQ4, bool kSiluMul, size_t... I>
constexpr auto make_tiles(std::index_sequence<I...>) {
  return std::array<MicroTile, sizeof...(I)>{&micro_tile<static_cast<int>(I) + 1, kQ4, kSiluMul>...};
}
// [4-bit][silu * up]: tiles of 1..MR_MAX rows.
constexpr std::array<std::array<std::array<MicroTile, MR_MAX>, 2>, 2> kTiles = {{
    {{make_tiles<false, false>(std::make_index_sequence<MR_MAX>{}),
      make_tiles<false, true>(std::make_index_sequence<MR_MAX>{})}},
    {{make_tiles<true, false>(std::make_index_sequence<MR_MAX>{}),
      make_tiles<true, true>(std::make_index_sequence<MR_MAX>{})}},
}};

// Quantizing is a serial pass over x before the panels' threads start; from this many rows on it
// is split over the threads too (waking them costs less than the pass).
constexpr int64_t kQuantizeParallelRows = 16;

// [N, K] -> int8 [ceil(N / NR), K / QK, block bytes] in the layout above, or an undefined tensor
// as soon as one block is not exactly a block of that form.
template <bool Q4>
at::Tensor pack_int8_blocks(const at::Tensor& w) {
  // Column j is byte lane (j % W) * 4 of the vectors of column vector j / W.
  auto lane_of = [](uint8_t* block, int64_t j) {
    return block + (Q4 ? NR * 8 : NR * 4) + (j / W) * kQuadBytes + (j % W) * 4;
  };
  if constexpr (Q4) {
    return pack_exact_blocks<true>(w, kI4BlockBytes, at::kChar, [&](uint8_t* block, int64_t j, const uint8_t* q) {
      uint8_t* lane = lane_of(block, j);
      // k-quads 2i (low nibbles) and 2i + 1 (high) share the vector of 8i..8i + 7.
      for (int i = 0; i < QK; ++i)
        lane[(i / 8) * 2 * kQuadBytes + i % 4] |= static_cast<uint8_t>(q[i] << (i % 8 < 4 ? 0 : 4));
    });
  } else {
    return pack_exact_blocks<false>(w, kI8BlockBytes, at::kChar, [&](uint8_t* block, int64_t j, const uint8_t* q) {
      uint8_t* lane = lane_of(block, j);
      const int8_t* q8 = reinterpret_cast<const int8_t*>(q);
      for (int i = 0; i < QK; ++i) lane[(i / 4) * 2 * kQuadBytes + i % 4] = static_cast<uint8_t>(q8[i] + 128);
    });
  }
}

#endif  // PAGELLM_INT8

bool int8_supported() { return PAGELLM_INT8 != 0; }

// The weight as int8-kernel panels of its 4-bit blocks, else its 8-bit blocks, else nothing. With
// silu_mul, a gate/up weight [2d, K] (gate rows first) is reordered first as pack_weight_silu_mul
// does, so each panel holds W gate columns then the matching W up columns.
c10::optional<at::Tensor> pack_weight_int8(const at::Tensor& weight, bool silu_mul) {
  at::Tensor w = weight_to_pack(weight, "pack_weight_int8");
  if (silu_mul) w = gate_up_interleaved(w, W, "pack_weight_int8");
#if PAGELLM_INT8
  if (w.size(1) % QK != 0 || w.size(1) == 0) return c10::nullopt;
  if (at::Tensor q4 = pack_int8_blocks<true>(w); q4.defined()) return q4;
  if (at::Tensor q8 = pack_int8_blocks<false>(w); q8.defined()) return q8;
#endif
  return c10::nullopt;
}

void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 bool silu_mul) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "linear_int8: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                        out.size(0) == x.size(0),
                    "linear_int8: out must be float32 [rows of x, N] with contiguous rows");
  TORCH_CHECK_VALUE(
      packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.is_contiguous() &&
          (packed.size(2) == kI4BlockBytes || packed.size(2) == kI8BlockBytes) && packed.size(1) * QK == x.size(1) &&
          packed.size(0) > 0,
      "linear_int8: packed must come from pack_weight_int8 for this input width (", NR, " columns per panel)");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = packed.size(0);
  if (silu_mul) {
    TORCH_CHECK_VALUE(n == panels * W, "linear_int8: out has ", n, " columns, packed holds ", panels,
                      " gate/up panel pairs of ", W);
  } else {
    TORCH_CHECK_VALUE(n <= panels * NR && n > (panels - 1) * NR, "linear_int8: out has ", n, " columns, packed holds ",
                      panels, " panels of ", NR);
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(
        bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == (silu_mul ? 2 * n : n),
        "linear_int8: bias must be contiguous float32 of ", silu_mul ? 2 * n : n, " elements");
    bias_ptr = bias->data_ptr<float>();
  }
#if PAGELLM_INT8
  if (m == 0) return;
  const RowBlocks row_blocks(m);
  const int64_t num_blocks = k / QK;
  // The worker threads reach these through pointers: their own thread_locals are other buffers.
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<float> da, da_sum;
  thread_local std::vector<int32_t> neg128_sum;
  qa.resize(row_blocks.count * MR_MAX * k);
  da.resize(row_blocks.count * MR_MAX * num_blocks);
  da_sum.resize(da.size());
  neg128_sum.resize(da.size());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  auto quantize = [&](int64_t r0, int64_t r1) {
    quantize_rows(xp, ldx, r0, r1, k, row_blocks, qa.data(), da.data(), da_sum.data(), neg128_sum.data());
  };
  if (m >= kQuantizeParallelRows) {
    int8_t* qa_ptr = qa.data();
    float *da_ptr = da.data(), *da_sum_ptr = da_sum.data();
    int32_t* neg_ptr = neg128_sum.data();
    at::parallel_for(0, m, 8, [&](int64_t r0, int64_t r1) {
      quantize_rows(xp, ldx, r0, r1, k, row_blocks, qa_ptr, da_ptr, da_sum_ptr, neg_ptr);
    });
  } else {
    quantize(0, m);
  }
  const Activations act{qa.data(), da.data(), da_sum.data(), neg128_sum.data(), k, num_blocks};
  const bool q4 = packed.size(2) == kI4BlockBytes;
  const int64_t block_bytes = packed.size(2);
  const auto& tiles = kTiles[q4][silu_mul];
  const uint8_t* w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  float* c = out.data_ptr<float>();
  const int64_t ldc = out.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = w + p * num_blocks * block_bytes;
      const int ncols = silu_mul ? W : static_cast<int>(std::min<int64_t>(NR, n - p * NR));
      float* c_panel = c + p * (silu_mul ? W : NR);
      const float *b0 = nullptr, *b1 = nullptr;
      float edge[NR];
      if (bias_ptr != nullptr && silu_mul) {
        b0 = bias_ptr + p * W;
        b1 = bias_ptr + n + p * W;
      } else if (bias_ptr != nullptr) {
        std::memset(edge, 0, sizeof(edge));
        std::memcpy(edge, bias_ptr + p * NR, ncols * sizeof(float));
        b0 = edge;
        b1 = edge + W;
      }
      // The first row block pulls in the next panel (the hardware prefetcher stops at pages).
      const uint8_t* ahead = p + 1 < end ? panel + num_blocks * block_bytes : nullptr;
      for (int64_t rb = 0; rb < row_blocks.count; ++rb) {
        tiles[row_blocks.rows(rb) - 1](act, rb, row_blocks.start(rb), panel, b0, b1, c_panel, ldc, ncols,
                                       rb == 0 ? ahead : nullptr);
      }
    }
  });
#else
  (void)m, (void)k, (void)bias_ptr;
  TORCH_CHECK(false, "linear_int8: this build has no int8 dot products (needs AVX512-VNNI or AVX-VNNI)");
#endif
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm_int8, m) {
  m.def("pack_weight_int8(Tensor weight, bool silu_mul) -> Tensor?");
  m.def("linear_int8(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, bool silu_mul) -> ()");
  // No tensor arguments to dispatch on: one kernel for every backend.
  m.def("int8_supported() -> bool", &pagellm::int8_supported);
}

TORCH_LIBRARY_IMPL(pagellm_gemm_int8, CPU, m) {
  m.impl("pack_weight_int8", &pagellm::pack_weight_int8);
  m.impl("linear_int8", &pagellm::linear_int8);
}
