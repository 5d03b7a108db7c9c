// Small-batch matrix multiply for CPUs: y = x W^T (+ b) for the few rows of a decode step.
//
// At 1-64 rows a linear layer is a stream of weights with little arithmetic per weight, and
// general BLAS spends as long re-packing the weight matrix on every call as it does on the
// arithmetic (MKL reached 130-170 GFLOP/s at 32 rows here, against 285 for large products).
// So the weights are packed once, at load time, into panels of NR = 2 vectors of output
// columns, k-major: [ceil(N / NR), K, NR]. A product then streams each panel exactly once, in
// order, while a micro-tile of up to MR rows keeps 2 x MR accumulators in registers: per k, two
// panel loads and MR broadcasts of x feed 2 x MR fused multiply-adds. K is walked in slices of
// KC so that a panel slice stays in cache while every row block of x passes over it, and each
// row block prefetches its share of the next slice. Measured on 2 AVX-512 cores (`python -m
// pagellm.bench.gemm_bench`): 1.2-1.5x MKL at 32 rows, 1.5-2x at 8-16, even at 96-128, behind from
// 256 rows on, so large batches stay with BLAS.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace pagellm {
namespace {

constexpr int NR = 2 * W;  // output columns per panel
// Rows per micro-tile: 2 x MR accumulators, 2 panel vectors and a broadcast fit the vector
// registers (32 with AVX-512, 16 otherwise).
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int KC = 576;    // k per slice: 576 x 32 floats (72 KiB, in L2); 128 and 256 measured no better at 32 rows, worse at 64-128

// acc[r] = (first ? bias or 0 : c[r]) + sum over k of a[k, r] * b[k, :], for R rows and one panel
// slice; a is a packed row block, k-major with MR rows per k, so both inputs stream in order.
// `ahead` is this tile's share (`ahead_rows` k-rows) of the next panel slice, pulled towards L2
// evenly over the tile's k loop: the weights come from DRAM, the hardware prefetcher stops at page
// boundaries, and spreading the requests over all row blocks keeps each core's stream at the rate
// it consumes rather than in bursts that overflow its queue of outstanding misses.
template <int R>
void micro_tile(const float* a, const float* b, int kc, float* c, int64_t ldc, int ncols, bool first, const float* bias,
                const float* ahead, int ahead_rows) {
  vfloat acc0[R], acc1[R];
  float edge[NR];
  for (int r = 0; r < R; ++r) {
    const float* src = nullptr;
    if (!first) {
      src = c + r * ldc;
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
      const vfloat x = vsplat(a[k * MR + r]);
      acc0[r] += x * b0;
      acc1[r] += x * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (ncols == NR) {
      vstore(c + r * ldc, acc0[r]);
      vstore(c + r * ldc + W, acc1[r]);
    } else {
      vstore(edge, acc0[r]);
      vstore(edge + W, acc1[r]);
      std::memcpy(c + r * ldc, edge, ncols * sizeof(float));
    }
  }
}

using MicroTile = void (*)(const float*, const float*, int, float*, int64_t, int, bool, const float*, const float*, int);

template <size_t... I>
constexpr auto make_tiles(std::index_sequence<I...>) {
  return std::array<MicroTile, sizeof...(I)>{&micro_tile<static_cast<int>(I) + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_index_sequence<MR>{});

// [N, K] -> [ceil(N / NR), K, NR], zero-padded past N.
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
                    "pack_weight: weight must be a 2-D float32 CPU tensor");
  const at::Tensor w = weight.contiguous();
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

void linear_packed(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "linear_packed: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
                    "linear_packed: out must be float32 [rows of x, N] with contiguous rows");
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                        packed.size(2) == NR && packed.size(1) == x.size(1),
                    "linear_packed: packed must come from pack_weight for this input width (", NR, " columns per panel)");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = packed.size(0);
  TORCH_CHECK_VALUE(n <= panels * NR && n > (panels - 1) * NR, "linear_packed: out has ", n, " columns, packed holds ",
                    panels, " panels of ", NR);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                      "linear_packed: bias must be contiguous float32 of N elements");
    bias_ptr = bias->data_ptr<float>();
  }
  // x in row blocks of MR, k-major: [ceil(m / MR), k, MR]; every panel reads it again, in order.
  const int64_t blocks = (m + MR - 1) / MR;
  std::vector<float> a_packed(blocks * k * MR);
  {
    const float* src = x.data_ptr<float>();
    const int64_t lda = x.stride(0);
    for (int64_t r = 0; r < m; ++r) {
      float* dst = a_packed.data() + (r / MR) * k * MR + r % MR;
      const float* row = src + r * lda;
      for (int64_t i = 0; i < k; ++i) dst[i * MR] = row[i];
    }
  }
  const float* a = a_packed.data();
  const float* b = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  const int64_t ldc = out.stride(0);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
      const float* panel = b + p * k * NR;
      for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int kc = static_cast<int>(std::min<int64_t>(KC, k - k0));
        // The weights are one contiguous stream, so the next slice (maybe the next panel's
        // first) starts right after this one; past the end, prefetches are harmless no-ops.
        const float* next = panel + (k0 + kc) * NR;
        for (int64_t j = 0; j < blocks; ++j) {
          const int64_t m0 = j * MR;
          const int rows = static_cast<int>(std::min<int64_t>(MR, m - m0));
          const int share_begin = static_cast<int>(j * kc / blocks), share_end = static_cast<int>((j + 1) * kc / blocks);
          kTiles[rows - 1](a + j * k * MR + k0 * MR, panel + k0 * NR, kc, c + m0 * ldc + p * NR, ldc, ncols, k0 == 0,
                           bias_ptr == nullptr ? nullptr : bias_ptr + p * NR, next + share_begin * NR,
                           share_end - share_begin);
        }
      }
    }
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_gemm, CPU, m) {
  m.impl("pack_weight", &pagellm::pack_weight);
  m.impl("linear_packed", &pagellm::linear_packed);
}
