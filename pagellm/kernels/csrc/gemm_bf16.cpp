// Matrix multiply in bfloat16 with float32 accumulation: y = x W^T (+ b) on CPUs with AVX512_BF16,
// or, without it (AVX2, AVX-512 before Cooper Lake), on the same panels widened to float32 in
// registers (a shift and a mask per pair of inputs, then FMAs): half float32's bytes to stream.
//
// `vdpbf16ps` multiplies 16 pairs of bfloat16 numbers and adds each pair's two products to one
// float32 lane: twice the multiply-adds of a float32 FMA per instruction, from half the bytes of
// weight. So the weight is rounded to bfloat16 once, at load, and packed as panels of NR = 32
// output columns with each column's inputs k and k + 1 side by side: [ceil(N / NR), K / 2, NR, 2].
// A product rounds x to bfloat16 once per call; a micro-tile of up to MR rows then broadcasts one
// (k, k + 1) pair of each row against two panel vectors per step, 2 x MR accumulators in
// registers. Unlike the float32 panels (gemm.cpp) the whole K is walked per tile: a panel is half
// the bytes, and at the depths of the models served here (K up to a few thousand) one panel stays
// in L2 while every row block passes over it.
//
// Everything around the products (norms, attention, the residual stream) stays float32: only the
// two inputs of each product are rounded, as a bfloat16 GEMM with float32 accumulation does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "amx.h"
#include "bf16_tiles.h"
#include "parallel_panels.h"
#include "vec.h"
#include "weight_layout.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGELLM_BF16_DOT 1
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGELLM_BF16_WIDEN 1
#endif

namespace pagellm {
namespace {

#if defined(PAGELLM_BF16_DOT) || defined(PAGELLM_BF16_WIDEN)

constexpr int NR_BF16 = 32;  // output columns per panel: pairs [K / 2, 32, 2], as an AMX B tile

// How far ahead a panel's first row tile requests its weights, in k-pair steps (8 KiB).
constexpr int64_t kPrefetchSteps = 64;

#endif

#if defined(PAGELLM_BF16_DOT)

static_assert(NR_BF16 == kBf16PanelCols, "the AMX path's panels are these panels");
constexpr int MR_BF16 = 12;  // 24 accumulators, 2 panel vectors and a broadcast of 32 registers
using TileInput = uint32_t;  // x as bfloat16 pairs
// From this many rows a product takes AMX tiles where the CPU has them (below, one tile's 16 rows
// would be mostly zeros and the product streams its weights either way).
constexpr int64_t kAmxMinRows = 4;

// out[r, 0:ncols) = bias + sum over the k pairs of x[r] . panel, for R rows of x (bfloat16 pairs,
// `ldx` pairs apart) and one panel of `k2` pairs. With kGated the panel's first 16 columns are
// gate and the last 16 the matching up columns, `bias` (if any) their 32 biases in that order, and
// act(gate) * up (vec.h's `gated`, 16 values a row) is stored.
template <int R, bool kGated>
void tile_bf16(const TileInput* x, int64_t ldx, const uint16_t* panel, int64_t k2, float* out, int64_t ldo, int ncols,
               const float* bias, int64_t act, const uint16_t* prefetch) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < k2; ++i) {
    if (prefetch != nullptr) {  // this step's two cache lines, into L2; past the weights' end a no-op
      __builtin_prefetch(prefetch + i * NR_BF16 * 2, 0, 2);
      __builtin_prefetch(prefetch + i * NR_BF16 * 2 + 32, 0, 2);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + i * NR_BF16 * 2);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + i * NR_BF16 * 2 + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + i]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], b0, a);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], b1, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    store_row<kGated>(out + r * ldo, acc0[r], acc1[r], ncols, bias, bias == nullptr ? nullptr : bias + 16, act);
  }
}

#if defined(PAGELLM_AMX)
// Every panel against every row of x on AMX tiles (bf16_tiles.h).
template <bool kGated>
void linear_amx(const AmxRows& x, const uint16_t* b, int64_t panels, int64_t n, float* c, int64_t ldc,
                const float* bias, int64_t act) {
  const int64_t k2 = x.kp / 2, cols_per_panel = kGated ? NR_BF16 / 2 : NR_BF16;
  auto panel_of = [&](int64_t p) { return b + p * k2 * NR_BF16 * 2; };
  auto place = [&](int64_t p, int* ncols, float** dst, const float** b0, const float** b1) {
    *ncols = static_cast<int>(std::min<int64_t>(cols_per_panel, n - p * cols_per_panel));
    *dst = c + p * cols_per_panel;
    if (bias != nullptr) *b0 = bias + p * NR_BF16, *b1 = *b0 + 16;
  };
  parallel_panels(panels,
                  [&](int64_t begin, int64_t end) { amx_panels<kGated>(x, begin, end, c, ldc, act, panel_of, place); });
}
#endif  // PAGELLM_AMX

#endif  // PAGELLM_BF16_DOT

#if defined(PAGELLM_BF16_WIDEN)

constexpr int kPanelVectors = NR_BF16 / W;  // column vectors of a panel: 4 with AVX2, 2 with AVX-512
// Accumulators, 3 panel registers (a load, its two widened halves) and 2 broadcasts: 2 rows fill
// AVX2's 16 registers, 8 rows 21 of AVX-512's 32.
constexpr int MR_BF16 = W == 8 ? 2 : 8;
using TileInput = float;  // x rounded to bfloat16, kept as float32
typedef uint32_t vuint __attribute__((vector_size(W * 4)));
typedef uint32_t vuint_u __attribute__((vector_size(W * 4), aligned(2)));

// Rows [begin, end) of x rounded to bfloat16 (to nearest even, NaN kept a NaN) but kept as float32,
// each padded with a zero to an even length `kp`, so that a tile broadcasts its inputs as they are.
void round_rows_widen(const float* x, int64_t ldx, int64_t k, int64_t kp, int64_t begin, int64_t end, float* dst) {
  for (int64_t r = begin; r < end; ++r) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(x + r * ldx);
    uint32_t* row = reinterpret_cast<uint32_t*>(dst + r * kp);
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t bits = src[i];
      const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
      row[i] = nan ? (bits | 0x00400000u) & 0xFFFF0000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    }
    if (kp > k) row[k] = 0;
  }
}

// The DOT tile_bf16's product on widened panels: per pair of inputs, a panel vector's low halves (input k)
// shifted up and its high halves (input k + 1) masked are float32, and FMA with x's two values.
// Vector c holds columns [cW, cW + W); with kGated the first 16 columns are gate, the rest up.
template <int R, bool kGated>
void tile_bf16(const TileInput* x, int64_t ldx, const uint16_t* panel, int64_t k2, float* out, int64_t ldo, int ncols,
               const float* bias, int64_t act,
               const uint16_t* /*prefetch: not measured on this build, left to the hardware*/) {
  vfloat acc[R][kPanelVectors] = {};
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(panel);
  for (int64_t i = 0; i < k2; ++i, pairs += NR_BF16) {
    vfloat x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      x0[r] = vsplat(x[r * ldx + 2 * i]);
      x1[r] = vsplat(x[r * ldx + 2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < kPanelVectors; ++c) {
      const vuint w = *reinterpret_cast<const vuint_u*>(pairs + c * W);
      const vfloat lo = (vfloat)(w << 16), hi = (vfloat)(w & 0xFFFF0000u);
      for (int r = 0; r < R; ++r) {
        acc[r][c] += lo * x0[r];
        acc[r][c] += hi * x1[r];
      }
    }
  }
  constexpr int kHalf = kPanelVectors / 2;
  // An edge panel's bias holds only its `ncols` values.
  const bool whole = kGated || ncols == NR_BF16;
  for (int r = 0; r < R; ++r) {
    float* row = out + r * ldo;
    if (bias != nullptr && whole)
      for (int c = 0; c < kPanelVectors; ++c) acc[r][c] += vload(bias + c * W);
    if constexpr (kGated) {
      for (int c = 0; c < kHalf; ++c) vstore(row + c * W, gated(act, acc[r][c], acc[r][c + kHalf]));
    } else if (whole) {
      for (int c = 0; c < kPanelVectors; ++c) vstore(row + c * W, acc[r][c]);
    } else {
      float edge[NR_BF16];
      for (int c = 0; c < kPanelVectors; ++c) vstore(edge + c * W, acc[r][c]);
      for (int j = 0; j < ncols; ++j) row[j] = edge[j] + (bias != nullptr ? bias[j] : 0.f);
    }
  }
}

#endif  // PAGELLM_BF16_WIDEN

#if defined(PAGELLM_BF16_DOT) || defined(PAGELLM_BF16_WIDEN)

using TileBf16 = void (*)(const TileInput*, int64_t, const uint16_t*, int64_t, float*, int64_t, int, const float*,
                          int64_t, const uint16_t*);

template <bool kGated, size_t... I>
constexpr auto make_bf16_tiles(std::index_sequence<I...>) {
  return std::array<TileBf16, sizeof...(I)>{&tile_bf16<static_cast<int>(I) + 1, kGated>...};
}
constexpr std::array<std::array<TileBf16, MR_BF16>, 2> kBf16Tiles = {
    make_bf16_tiles<false>(std::make_index_sequence<MR_BF16>{}),
    make_bf16_tiles<true>(std::make_index_sequence<MR_BF16>{}),
};

// [N, K] bfloat16 (contiguous) -> [ceil(N / NR), ceil(K / 2), NR, 2], zero-padded past N and K.
// With `gate_up` (a gate/up weight, N = 2d) panel p holds gate rows [16p, 16p + 16) then the same
// outputs' up rows, read in place rather than from a reordered copy of the matrix.
at::Tensor pack_bf16_panels(const at::Tensor& w, bool gate_up) {
  constexpr int64_t kHalf = NR_BF16 / 2;
  const int64_t n = w.size(0), k = w.size(1), k2 = (k + 1) / 2, panels = (n + NR_BF16 - 1) / NR_BF16;
  const int64_t d = gate_up ? gate_up_half(w, kHalf, "pack_weight_bf16") : 0;
  at::Tensor packed = at::zeros({panels, k2, NR_BF16, 2}, w.options().dtype(at::kBFloat16));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(NR_BF16, n - p * NR_BF16);
      for (int64_t j = 0; j < cols; ++j) {
        const int64_t w_row = !gate_up ? p * NR_BF16 + j : (j < kHalf ? 0 : d) + p * kHalf + j % kHalf;
        const uint16_t* row = src + w_row * k;
        uint16_t* col = dst + p * k2 * NR_BF16 * 2 + j * 2;
        for (int64_t i = 0; i < k; ++i) col[(i / 2) * NR_BF16 * 2 + (i % 2)] = row[i];
      }
    }
  });
  return packed;
}

#endif  // PAGELLM_BF16_DOT || PAGELLM_BF16_WIDEN

bool amx_supported() { return amx_permitted(); }

// Turns the AMX path on or off (where supported), returning whether it was on.
bool set_amx(bool on) { return amx_switch().exchange(on); }

bool bf16_supported() {
#if defined(PAGELLM_BF16_DOT) || defined(PAGELLM_BF16_WIDEN)
  return true;
#else
  return false;
#endif
}

// A bfloat16 weight is packed from its own bytes; a float32 one is rounded to a bfloat16 copy
// first (round to nearest even, as the activations are).
at::Tensor pack_weight_bf16(const at::Tensor& weight, bool gate_up) {
  TORCH_CHECK_VALUE(bf16_supported(), "pack_weight_bf16: this build has no bfloat16 kernel (needs AVX2 and FMA)");
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.dim() == 2 &&
                        (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
                    "pack_weight_bf16: weight must be a 2-D float32 or bfloat16 CPU tensor");
#if defined(PAGELLM_BF16_DOT) || defined(PAGELLM_BF16_WIDEN)
  return pack_bf16_panels(weight.to(at::kBFloat16).contiguous(), gate_up);
#else
  (void)gate_up;
  return at::Tensor();
#endif
}

// out = x W^T (+ bias), or with an activation code (vec.h's GatedAct) act(x G^T + b_g) * (x U^T + b_u)
// for a gate/up weight packed by pack_weight_bf16 with `gate_up` (bias: gate's then up's, 2d values).
void linear_bf16(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 int64_t activation) {
  TORCH_CHECK_VALUE(bf16_supported(), "linear_bf16: this build has no bfloat16 kernel (needs AVX2 and FMA)");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "linear_bf16: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
                    "linear_bf16: out must be float32 [rows of x, N] with contiguous rows");
#if defined(PAGELLM_BF16_DOT) || defined(PAGELLM_BF16_WIDEN)
  const int64_t m = x.size(0), k = x.size(1), kp = (k + 1) / 2 * 2, n = out.size(1);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                        packed.size(2) == NR_BF16 && packed.size(3) == 2 && packed.size(1) * 2 == kp,
                    "linear_bf16: packed must come from pack_weight_bf16 for this input width");
  const int64_t panels = packed.size(0);
  TORCH_CHECK_VALUE(activation >= kActNone && activation <= kActSwigluOai, "linear_bf16: unknown activation code ",
                    activation);
  const bool gate_up = activation != kActNone;
  std::vector<float> bias_interleaved;
  if (gate_up) {
    TORCH_CHECK_VALUE(panels * (NR_BF16 / 2) == n, "linear_bf16: out has ", n, " columns, packed holds ", panels,
                      " gate/up panels of ", NR_BF16 / 2);
    if (bias.has_value() && bias->defined())
      bias_interleaved = gate_up_bias_interleaved(*bias, n, NR_BF16 / 2, "linear_bf16");
  } else {
    TORCH_CHECK_VALUE(n <= panels * NR_BF16 && n > (panels - 1) * NR_BF16, "linear_bf16: out has ", n,
                      " columns, packed holds ", panels, " panels of ", NR_BF16);
  }
  const float* bias_ptr = bias_interleaved.empty() ? nullptr : bias_interleaved.data();
  if (!gate_up && bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                      "linear_bf16: bias must be contiguous float32 of N elements");
    bias_ptr = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* c = out.data_ptr<float>();
  const int64_t ldc = out.stride(0);
#if defined(PAGELLM_BF16_WIDEN)
  // x rounded as float32 values; a few rows on this thread, a prefill's rows in parallel.
  thread_local std::vector<float> xb;
  xb.resize(m * kp);
  float* xb_data = xb.data();
  at::parallel_for(0, m, 64,
                   [&](int64_t begin, int64_t end) { round_rows_widen(xp, ldx, k, kp, begin, end, xb_data); });
  const float* x2 = xb_data;
  const int64_t k2 = kp / 2, ldx2 = kp;
#else
  thread_local std::vector<uint16_t> xb;
#if defined(PAGELLM_AMX)
  if (m >= kAmxMinRows && k % 32 == 0 && amx_enabled()) {
    const AmxRows rows = amx_rows(xp, ldx, m, k, xb);
    (gate_up ? linear_amx<true> : linear_amx<false>)(rows, b, panels, n, c, ldc, bias_ptr, activation);
    return;
  }
#endif
  // x in bfloat16 pairs; a few rows round on this thread, a prefill's rows in parallel.
  xb.resize(m * kp);
  uint16_t* xb_data = xb.data();
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) { round_rows_bf16(xp, ldx, k, kp, begin, end, xb_data); });
  const uint32_t* x2 = reinterpret_cast<const uint32_t*>(xb_data);
  const int64_t k2 = kp / 2, ldx2 = k2;
#endif
  if (m == 0) return;
  const auto& tiles = kBf16Tiles[gate_up];
  const int64_t cols_per_panel = gate_up ? NR_BF16 / 2 : NR_BF16;
  // Row tiles of equal size (16 rows: 8 + 8, not 12 + 4). The first tile of a panel requests the
  // weights kPrefetchSteps k-pair steps ahead into L2 (into the next panel near its end): the
  // hardware prefetcher alone left a decode step's weights streaming below the machine's read
  // rate (docs/kernels.md). The widening build's tiles leave it to the hardware (not measured).
  const RowBlocks row_tiles(m, MR_BF16, MR_BF16);
  const int64_t panel_elems = k2 * NR_BF16 * 2;
  parallel_panels(panels, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = b + p * panel_elems;
      const int ncols = static_cast<int>(std::min<int64_t>(cols_per_panel, n - p * cols_per_panel));
      for (int64_t t = 0; t < row_tiles.count; ++t) {
        const int64_t m0 = row_tiles.start(t);
        const uint16_t* ahead = t == 0 ? panel + kPrefetchSteps * NR_BF16 * 2 : nullptr;
        tiles[row_tiles.rows(t) - 1](x2 + m0 * ldx2, ldx2, panel, k2, c + m0 * ldc + p * cols_per_panel, ldc, ncols,
                                     bias_ptr == nullptr ? nullptr : bias_ptr + p * NR_BF16, activation, ahead);
      }
    }
  });
#else
  (void)packed;
  (void)bias;
  (void)activation;
#endif
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm_bf16, m) {
  m.def("bf16_supported() -> bool", &pagellm::bf16_supported);
  m.def("amx_supported() -> bool", &pagellm::amx_supported);
  m.def("set_amx(bool on) -> bool", &pagellm::set_amx);
  m.def("pack_weight_bf16(Tensor weight, bool gate_up) -> Tensor");
  m.def("linear_bf16(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int activation) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_gemm_bf16, CPU, m) {
  m.impl("pack_weight_bf16", &pagellm::pack_weight_bf16);
  m.impl("linear_bf16", &pagellm::linear_bf16);
}
