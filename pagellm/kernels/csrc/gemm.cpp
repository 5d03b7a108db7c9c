// Small-batch matrix multiply for CPUs: y = x W^T (+ b) for the few rows of a decode step.
//
// At 1-64 rows a linear layer is a stream of weights with little arithmetic per weight, and
// general BLAS spends as long re-packing the weight matrix on every call as it does on the
// arithmetic.
// So the weights are packed once, at load time, into panels of NR = 2 vectors of output
// columns, k-major: [ceil(N / NR), K, NR]. A product then streams each panel exactly once, in
// order, while a micro-tile of up to MR rows keeps 2 x MR accumulators in registers: per k, two
// panel loads and MR broadcasts of x feed 2 x MR fused multiply-adds. K is walked in slices of
// KC so that a panel slice stays in cache while every row block of x passes over it, and each
// row block prefetches its share of the next slice. Past a few hundred rows BLAS's own blocking
// wins, so large batches stay with it (where exactly is measured at start-up: kernels/tuning.py;
// the measurements are in docs/kernels.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel_panels.h"
#include "quant_blocks.h"
#include "vec.h"
#include "weight_layout.h"

namespace pagellm {
namespace {

// Rows per micro-tile: 2 x MR accumulators, 2 panel vectors and a broadcast fit the vector
// registers (32 with AVX-512, 16 otherwise).
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int KC = 576;  // k per slice: 576 x 32 floats (72 KiB) stay in L2

// acc[r] = (c_in ? c_in[r] : bias or 0) + sum over k of a[k, r] * b[k, :], for R rows and one
// panel slice, stored to c_out[r]. a is either x itself (row r at a + r * lda) or, with
// kPackedRows, a row block of x packed k-major with MR rows per k, so that both inputs stream in
// order (see kPackRowsMinPanels). With kGated the panel holds W gate columns then the W matching
// up columns (pack_weight_gate_up), and act(gate) * up (vec.h's `gated`), W values a row, is stored.
// `ahead` is this tile's share (`ahead_rows` k-rows) of the next panel slice, pulled towards L2
// evenly over the tile's k loop: the weights come from DRAM, the hardware prefetcher stops at page
// boundaries, and spreading the requests over all row blocks keeps each core's stream at the rate
// it consumes rather than in bursts that overflow its queue of outstanding misses.
template <int R, bool kPackedRows, bool kGated>
void micro_tile(const float* a, int64_t lda, const float* b, int kc, const float* c_in, int64_t ldc_in, float* c_out,
                int64_t ldc_out, int ncols, const float* bias, const float* ahead, int ahead_rows, int64_t act) {
  vfloat acc0[R], acc1[R];
  float edge[NR];
  for (int r = 0; r < R; ++r) {
    const float* src = nullptr;
    if (c_in != nullptr) {
      src = c_in + r * ldc_in;
    } else if (bias != nullptr) {
      src = bias;
    }
    if (src == nullptr) {
      acc0[r] = vfloat{};
      acc1[r] = vfloat{};
    } else if (ncols == NR) {
      acc0[r] = vload(src);
      acc1[r] = vload(src + W);
    } else {
      std::memset(edge, 0, sizeof(edge));
      std::memcpy(edge, src, ncols * sizeof(float));
      acc0[r] = vload(edge);
      acc1[r] = vload(edge + W);
    }
  }
  const int step = (ahead_rows << 16) / kc;  // 16.16 fixed point: which ahead row goes with k
  for (int k = 0; k < kc; ++k) {
    // Loop-invariant test: -O3 unswitches it into a loop with and one without the prefetches.
    if (ahead_rows > 0) {
      const float* row = ahead + ((k * step) >> 16) * NR;
      __builtin_prefetch(row, 0, 2);
      __builtin_prefetch(row + W, 0, 2);
    }
    const vfloat b0 = vload(b + k * NR), b1 = vload(b + k * NR + W);
    for (int r = 0; r < R; ++r) {
      const vfloat x = vsplat(kPackedRows ? a[k * MR + r] : a[r * lda + k]);
      acc0[r] += x * b0;
      acc1[r] += x * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (kGated) {  // whole panels only (checked by linear_packed_gated)
      vstore(c_out + r * ldc_out, gated(act, acc0[r], acc1[r]));
    } else if (ncols == NR) {
      vstore(c_out + r * ldc_out, acc0[r]);
      vstore(c_out + r * ldc_out + W, acc1[r]);
    } else {
      vstore(edge, acc0[r]);
      vstore(edge + W, acc1[r]);
      std::memcpy(c_out + r * ldc_out, edge, ncols * sizeof(float));
    }
  }
}

using MicroTile = void (*)(const float*, int64_t, const float*, int, const float*, int64_t, float*, int64_t, int,
                           const float*, const float*, int, int64_t);

template <bool kPackedRows, bool kGated, size_t... I>
constexpr auto make_tiles(std::index_sequence<I...>) {
  return std::array<MicroTile, sizeof...(I)>{&micro_tile<static_cast<int>(I) + 1, kPackedRows, kGated>...};
}
// [packed rows][act(gate) * up]: tiles of 1..MR rows.
constexpr std::array<std::array<std::array<MicroTile, MR>, 2>, 2> kTiles = {{
    {{make_tiles<false, false>(std::make_index_sequence<MR>{}),
      make_tiles<false, true>(std::make_index_sequence<MR>{})}},
    {{make_tiles<true, false>(std::make_index_sequence<MR>{}), make_tiles<true, true>(std::make_index_sequence<MR>{})}},
}};

// Packing x costs one serial pass over it before the threads start and makes each k's MR
// broadcasts one contiguous read instead of MR rows' worth; it pays only when many panels reuse
// it (the crossover, measured, is in docs/kernels.md).
constexpr int64_t kPackRowsMinPanels = 64;

// [N, K] -> [ceil(N / NR), K, NR], zero-padded past N.
at::Tensor pack_f32(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR;
  at::Tensor packed = at::zeros({panels, k, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t cols = std::min<int64_t>(NR, n - p * NR);
      for (int64_t j = 0; j < cols; ++j) {
        const float* row = src + (p * NR + j) * k;
        float* col = dst + p * k * NR + j;
        for (int64_t i = 0; i < k; ++i) col[i * NR] = row[i];
      }
    }
  });
  return packed;
}

at::Tensor pack_weight(const at::Tensor& weight) { return pack_f32(weight_to_pack(weight, "pack_weight")); }

// The checks both entry points share; `packer` names where `packed` must come from.
void check_linear_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const char* op,
                         const char* packer) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
                    ": x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
                    op, ": out must be float32 [rows of x, N] with contiguous rows");
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                        packed.size(2) == NR && packed.size(1) == x.size(1),
                    op, ": packed must come from ", packer, " for this input width (", NR, " columns per panel)");
}

// Runs `body(a, tiles, pack_rows)` with x as the micro-tiles want it: `a` is x packed k-major by
// row block when many panels reuse it (see kPackRowsMinPanels, `pack_rows`), else x in place;
// `tiles` are the matching kernels.
template <bool kGated, typename Body>
void with_rows(const at::Tensor& x, int64_t panels, Body body) {
  const int64_t m = x.size(0), k = x.size(1), row_blocks = (m + MR - 1) / MR;
  const bool pack_rows = row_blocks > 1 && panels >= kPackRowsMinPanels;
  if (!pack_rows) return body(x.data_ptr<float>(), kTiles[0][kGated], false);
  thread_local std::vector<float> a_packed;  // [row_blocks, k, MR]
  a_packed.resize(row_blocks * k * MR);
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  for (int64_t j = 0; j < row_blocks; ++j) {
    const int rows = static_cast<int>(std::min<int64_t>(MR, m - j * MR));
    const float* src = a + j * MR * lda;
    float* dst = a_packed.data() + j * k * MR;
    for (int64_t i = 0; i < k; ++i)
      for (int r = 0; r < rows; ++r) dst[i * MR + r] = src[r * lda + i];
  }
  // The worker threads see their own (empty) thread_local, so they get this thread's buffer by pointer.
  body(a_packed.data(), kTiles[1][kGated], true);
}

// One panel slice [k0, k0 + kc) against every row block of x (`a` as with_rows gives it): calls
// `tile(m0, rows, a_tile, ahead_share, ahead_rows)` per block of up to MR rows from row m0, where
// the share is the block's part of `ahead` (the next slice, to prefetch meanwhile; none if null).
template <typename Tile>
inline void for_each_row_block(const float* a, bool pack_rows, int64_t m, int64_t k, int64_t lda, int64_t k0, int kc,
                               const float* ahead, Tile tile) {
  const int64_t row_blocks = (m + MR - 1) / MR;
  for (int64_t j = 0; j < row_blocks; ++j) {
    const int64_t m0 = j * MR;
    const int rows = static_cast<int>(std::min<int64_t>(MR, m - m0));
    const int share_begin = static_cast<int>(j * kc / row_blocks),
              share_end = static_cast<int>((j + 1) * kc / row_blocks);
    const float* a_tile = pack_rows ? a + j * k * MR + k0 * MR : a + m0 * lda + k0;
    tile(m0, rows, a_tile, ahead == nullptr ? nullptr : ahead + share_begin * NR,
         ahead == nullptr ? 0 : share_end - share_begin);
  }
}

void linear_packed(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                   const c10::optional<at::Tensor>& bias) {
  check_linear_inputs(out, x, packed, "linear_packed", "pack_weight");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = packed.size(0);
  TORCH_CHECK_VALUE(n <= panels * NR && n > (panels - 1) * NR, "linear_packed: out has ", n, " columns, packed holds ",
                    panels, " panels of ", NR);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                      "linear_packed: bias must be contiguous float32 of N elements");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t lda = x.stride(0);
  float* c = out.data_ptr<float>();
  const int64_t ldc = out.stride(0);
  const float* b = packed.data_ptr<float>();
  with_rows<false>(x, panels, [&](const float* a, const std::array<MicroTile, MR>& tiles, bool pack_rows) {
    parallel_panels(panels, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = b + p * k * NR;
        const int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
        const float* panel_bias = bias_ptr == nullptr ? nullptr : bias_ptr + p * NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
          const int kc = static_cast<int>(std::min<int64_t>(KC, k - k0));
          const float* slice = panel + k0 * NR;
          // The weights are one contiguous stream, so the next slice (maybe the next panel's
          // first) starts right after this one; past the end, prefetches are harmless no-ops.
          for_each_row_block(a, pack_rows, m, k, lda, k0, kc, slice + kc * NR,
                             [&](int64_t m0, int rows, const float* a_tile, const float* ahead_share, int ahead_rows) {
                               float* c_tile = c + m0 * ldc + p * NR;
                               tiles[rows - 1](a_tile, lda, slice, kc, k0 == 0 ? nullptr : c_tile, ldc, c_tile, ldc,
                                               ncols, panel_bias, ahead_share, ahead_rows, kActNone);
                             });
        }
      }
    });
  });
}

// A gate/up projection [2d, K] (gate rows first) packed for linear_packed_gated: panel p holds
// gate columns [pW, pW + W) then up columns [pW, pW + W), so a micro-tile has each output
// column's gate and up sums side by side in registers and stores act(gate) * up directly: the
// [rows, 2d] product is never written, nor read back by a separate activation pass (which, at
// decode sizes, also read half its inputs from the other core's cache: the two halves came from
// panels of different threads).
at::Tensor pack_weight_gate_up(const at::Tensor& weight) {
  const at::Tensor w = weight_to_pack(weight, "pack_weight_gate_up");
  return pack_f32(gate_up_interleaved(w, W, "pack_weight_gate_up"));
}

// out = act(x G^T + b_g) * (x U^T + b_u) for a gate/up weight packed by pack_weight_gate_up;
// `bias` (optional) is gate's then up's, 2d values.
void linear_packed_gated(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias, int64_t activation) {
  check_linear_inputs(out, x, packed, "linear_packed_gated", "pack_weight_gate_up");
  TORCH_CHECK_VALUE(activation >= kActSilu && activation <= kActSwigluOai,
                    "linear_packed_gated: unknown activation code ", activation);
  const int64_t m = x.size(0), k = x.size(1), d = out.size(1), panels = packed.size(0);
  TORCH_CHECK_VALUE(panels * W == d, "linear_packed_gated: out has ", d, " columns, packed holds ", panels,
                    " gate/up panel pairs of ", W);
  std::vector<float> bias_interleaved;
  if (bias.has_value() && bias->defined())
    bias_interleaved = gate_up_bias_interleaved(*bias, d, W, "linear_packed_gated");
  const float* bias_ptr = bias_interleaved.empty() ? nullptr : bias_interleaved.data();
  const int64_t lda = x.stride(0), ldc = out.stride(0);
  float* c = out.data_ptr<float>();
  const float* b = packed.data_ptr<float>();
  with_rows<true>(x, panels, [&](const float* a, const std::array<MicroTile, MR>& fused, bool pack_rows) {
    const auto& plain = kTiles[pack_rows][false];
    parallel_panels(panels, [&](int64_t begin, int64_t end) {
      // Past the first k slice, the raw gate and up sums of a panel wait here for the last one.
      std::vector<float> partial(k > KC ? m * NR : 0);
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = b + p * k * NR;
        const float* panel_bias = bias_ptr == nullptr ? nullptr : bias_ptr + p * NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
          const int kc = static_cast<int>(std::min<int64_t>(KC, k - k0));
          const bool last = k0 + kc == k;
          for_each_row_block(a, pack_rows, m, k, lda, k0, kc, panel + (k0 + kc) * NR,
                             [&](int64_t m0, int rows, const float* a_tile, const float* ahead_share, int ahead_rows) {
                               float* part = partial.empty() ? nullptr : partial.data() + m0 * NR;  // only when k > KC
                               const float* c_in = k0 == 0 ? nullptr : part;
                               if (last) {
                                 fused[rows - 1](a_tile, lda, panel + k0 * NR, kc, c_in, NR, c + m0 * ldc + p * W, ldc,
                                                 NR, panel_bias, ahead_share, ahead_rows, activation);
                               } else {
                                 plain[rows - 1](a_tile, lda, panel + k0 * NR, kc, c_in, NR, part, NR, NR, panel_bias,
                                                 ahead_share, ahead_rows, kActNone);
                               }
                             });
        }
      }
    });
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("pack_weight_gate_up(Tensor weight) -> Tensor");
  m.def("linear_packed_gated(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias, int activation) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_gemm, CPU, m) {
  m.impl("pack_weight", &pagellm::pack_weight);
  m.impl("linear_packed", &pagellm::linear_packed);
  m.impl("pack_weight_gate_up", &pagellm::pack_weight_gate_up);
  m.impl("linear_packed_gated", &pagellm::linear_packed_gated);
}
