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
//
// Weights that are exactly GGUF-style blocks of 4- or 8-bit integers (quant_blocks.h) can also be
// packed in that form, 5.3x / 3.6x smaller; each panel slice is expanded back into float32 in a
// per-thread buffer just before the row blocks pass over it. The results are bit for bit those of
// the float32 panels, with a fraction of the memory traffic, which pays at few rows (see
// blocks_max_rows); linear_packed takes either form.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "vec.h"

namespace pagellm {
namespace {

// Rows per micro-tile: 2 x MR accumulators, 2 panel vectors and a broadcast fit the vector
// registers (32 with AVX-512, 16 otherwise).
#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int KC = 576;    // k per slice: 576 x 32 floats (72 KiB, in L2); 128 and 256 measured no better at 32 rows, worse at 64-128
constexpr int KC_BLOCKS = 128;  // k per slice of block-packed weights: the expanded slice (16 KiB) stays in L1
static_assert(KC % QK == 0 && KC_BLOCKS % QK == 0, "slices hold whole blocks");

// acc[r] = (first ? bias or 0 : c[r]) + sum over k of a[k, r] * b[k, :], for R rows and one panel
// slice. a is either x itself (row r at a + r * lda) or, with kPackedRows, a row block of x packed
// k-major with MR rows per k, so that both inputs stream in order (see kPackRowsMinPanels).
// `ahead` is this tile's share (`ahead_rows` k-rows) of the next panel slice, pulled towards L2
// evenly over the tile's k loop: the weights come from DRAM, the hardware prefetcher stops at page
// boundaries, and spreading the requests over all row blocks keeps each core's stream at the rate
// it consumes rather than in bursts that overflow its queue of outstanding misses.
template <int R, bool kPackedRows>
void micro_tile(const float* a, int64_t lda, const float* b, int kc, float* c, int64_t ldc, int ncols, bool first,
                const float* bias, const float* ahead, int ahead_rows) {
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
      const vfloat x = vsplat(kPackedRows ? a[k * MR + r] : a[r * lda + k]);
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

using MicroTile = void (*)(const float*, int64_t, const float*, int, float*, int64_t, int, bool, const float*, const float*,
                           int);

template <bool kPackedRows, size_t... I>
constexpr auto make_tiles(std::index_sequence<I...>) {
  return std::array<MicroTile, sizeof...(I)>{&micro_tile<static_cast<int>(I) + 1, kPackedRows>...};
}
constexpr auto kTiles = make_tiles<false>(std::make_index_sequence<MR>{});
constexpr auto kPackedTiles = make_tiles<true>(std::make_index_sequence<MR>{});

// Packing x costs one serial pass over it before the threads start (~16 us for 32 x 576) and
// makes each k's MR broadcasts one contiguous read instead of MR rows' worth; it pays only when
// many panels reuse it. Measured at 32 rows with 4-bit blocks (AVX-512, ms per call, in place /
// packed): 576 -> 576 (18 panels) 0.091 / 0.107, 576 -> 960 (30) 0.151 / 0.156, 576 -> 3072 (96)
// 0.485 / 0.452, the 49,152-column vocabulary head 7.9 / 7.2.
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

// [N, K] -> uint8 [ceil(N / NR), K / QK, block bytes] in the 4-bit (Q4) or 8-bit layout of
// quant_blocks.h, or an undefined tensor as soon as one block is not exactly of that form.
template <bool Q4>
at::Tensor pack_blocks(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR, num_blocks = k / QK;
  const int64_t block_bytes = Q4 ? kQ4BlockBytes : kQ8BlockBytes;
  at::Tensor packed = at::zeros({panels, num_blocks, block_bytes}, w.options().dtype(at::kByte));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    uint8_t q[QK];
    for (int64_t p = begin; p < end && exact.load(std::memory_order_relaxed); ++p) {
      const int64_t cols = std::min<int64_t>(NR, n - p * NR);
      for (int64_t b = 0; b < num_blocks; ++b) {
        uint8_t* block = dst + (p * num_blocks + b) * block_bytes;
        float* d = reinterpret_cast<float*>(block);
        for (int64_t j = 0; j < cols; ++j) {
          const float* v = src + (p * NR + j) * k + b * QK;
          if constexpr (Q4) {
            uint8_t* qs = block + NR * 8;
            if (!find_q4_block(v, d[j], d[NR + j], q)) {
              exact = false;
              return;
            }
            // Column j's nibble goes low in byte j, column W + j's high in byte j.
            const int shift = j < W ? 0 : 4;
            for (int i = 0; i < QK; ++i) qs[i * W + j % W] |= static_cast<uint8_t>(q[i] << shift);
          } else {
            int8_t* qs = reinterpret_cast<int8_t*>(block + NR * 4);
            if (!find_q8_block(v, d[j], reinterpret_cast<int8_t*>(q))) {
              exact = false;
              return;
            }
            for (int i = 0; i < QK; ++i) qs[i * NR + j] = static_cast<int8_t>(q[i]);
          }
        }
      }
    }
  });
  return exact ? packed : at::Tensor();
}

// The weight to pack, checked and contiguous.
at::Tensor weight_to_pack(const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2, op,
                    ": weight must be a 2-D float32 CPU tensor");
  return weight.contiguous();
}

at::Tensor pack_weight(const at::Tensor& weight) { return pack_f32(weight_to_pack(weight, "pack_weight")); }

// The weight as 4-bit blocks, else as 8-bit blocks, else nothing (not exactly either).
c10::optional<at::Tensor> pack_weight_blocks(const at::Tensor& weight) {
  const at::Tensor w = weight_to_pack(weight, "pack_weight_blocks");
  if (w.size(1) % QK != 0) return c10::nullopt;
  if (at::Tensor q4 = pack_blocks<true>(w); q4.defined()) return q4;
  if (at::Tensor q8 = pack_blocks<false>(w); q8.defined()) return q8;
  return c10::nullopt;
}

// Up to this many rows these block panels beat float32 panels of the same weight; past it,
// expanding the blocks costs more than the memory traffic it saves, and sooner for 8-bit blocks
// (less traffic saved per weight expanded). `python -m pagellm.bench.gemm_bench`, 30 layers of
// 4-bit blocks (vocabulary head, 8-bit): AVX-512 2.1x (2.3x) at 1 row, 1.3x (1.2x) at 16, 1.1x
// (1.0x) at 24, 1.0x (0.87x) at 32, 0.95x at 64; AVX2 (x86-64-v3) 1.75x at 1, 1.13x at 8, 0.95x
// at 16.
int64_t blocks_max_rows(const at::Tensor& blocks) {
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
                        (blocks.size(2) == kQ4BlockBytes || blocks.size(2) == kQ8BlockBytes),
                    "blocks_max_rows: expects the output of pack_weight_blocks");
#if defined(__AVX512F__)
  return blocks.size(2) == kQ4BlockBytes ? 32 : 24;
#else
  return 8;
#endif
}

void linear_packed(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "linear_packed: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
                    "linear_packed: out must be float32 [rows of x, N] with contiguous rows");
  const bool f32 = packed.scalar_type() == at::kFloat;
  const bool blocks = packed.scalar_type() == at::kByte;
  const bool q4 = blocks && packed.dim() == 3 && packed.size(2) == kQ4BlockBytes;
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.is_contiguous() &&
                        ((f32 && packed.size(2) == NR && packed.size(1) == x.size(1)) ||
                         (blocks && (q4 || packed.size(2) == kQ8BlockBytes) && packed.size(1) * QK == x.size(1))),
                    "linear_packed: packed must come from pack_weight or pack_weight_blocks for this input width (", NR,
                    " columns per panel)");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), panels = packed.size(0);
  TORCH_CHECK_VALUE(n <= panels * NR && n > (panels - 1) * NR, "linear_packed: out has ", n, " columns, packed holds ",
                    panels, " panels of ", NR);
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                      "linear_packed: bias must be contiguous float32 of N elements");
    bias_ptr = bias->data_ptr<float>();
  }
  const int64_t row_blocks = (m + MR - 1) / MR;
  const float* a = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  const bool pack_rows = row_blocks > 1 && panels >= kPackRowsMinPanels;
  thread_local std::vector<float> a_packed;  // [row_blocks, k, MR]
  if (pack_rows) {
    a_packed.resize(row_blocks * k * MR);
    for (int64_t j = 0; j < row_blocks; ++j) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, m - j * MR));
      const float* src = a + j * MR * lda;
      float* dst = a_packed.data() + j * k * MR;
      for (int64_t i = 0; i < k; ++i)
        for (int r = 0; r < rows; ++r) dst[i * MR + r] = src[r * lda + i];
    }
  }
  // The worker threads see their own (empty) thread_local, so they get this thread's buffer by pointer.
  const float* packed_rows = a_packed.data();
  const auto& tiles = pack_rows ? kPackedTiles : kTiles;
  float* c = out.data_ptr<float>();
  const int64_t ldc = out.stride(0);
  // One panel slice [k0, k0 + kc) against every row block; `ahead` is what to prefetch meanwhile.
  auto slice_times_rows = [&](const float* slice, int64_t p, int64_t k0, int kc, const float* ahead, bool spread_ahead) {
    const int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
    for (int64_t j = 0; j < row_blocks; ++j) {
      const int64_t m0 = j * MR;
      const int rows = static_cast<int>(std::min<int64_t>(MR, m - m0));
      const int share_begin = static_cast<int>(j * kc / row_blocks), share_end = static_cast<int>((j + 1) * kc / row_blocks);
      const float* a_tile = pack_rows ? packed_rows + j * k * MR + k0 * MR : a + m0 * lda + k0;
      tiles[rows - 1](a_tile, lda, slice, kc, c + m0 * ldc + p * NR, ldc, ncols, k0 == 0,
                       bias_ptr == nullptr ? nullptr : bias_ptr + p * NR, spread_ahead ? ahead + share_begin * NR : nullptr,
                       spread_ahead ? share_end - share_begin : 0);
    }
  };
  if (f32) {
    const float* b = packed.data_ptr<float>();
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const float* panel = b + p * k * NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
          const int kc = static_cast<int>(std::min<int64_t>(KC, k - k0));
          // The weights are one contiguous stream, so the next slice (maybe the next panel's
          // first) starts right after this one; past the end, prefetches are harmless no-ops.
          slice_times_rows(panel + k0 * NR, p, k0, kc, panel + (k0 + kc) * NR, true);
        }
      }
    });
    return;
  }
  const uint8_t* b = packed.data_ptr<uint8_t>();
  const int64_t block_bytes = packed.size(2), num_blocks = packed.size(1);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> expanded(KC_BLOCKS * NR);
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t k0 = 0; k0 < k; k0 += KC_BLOCKS) {
        const int kc = static_cast<int>(std::min<int64_t>(KC_BLOCKS, k - k0));
        const uint8_t* slice = b + (p * num_blocks + k0 / QK) * block_bytes;
        const uint8_t* ahead = slice + (kc / QK) * block_bytes;  // as above: the next slice follows
        if (q4) {
          dequant_q4_slice(slice, kc / QK, expanded.data(), ahead);
        } else {
          dequant_q8_slice(slice, kc / QK, expanded.data(), ahead);
        }
        slice_times_rows(expanded.data(), p, k0, kc, nullptr, false);
      }
    }
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("pack_weight_blocks(Tensor weight) -> Tensor?");
  m.def("blocks_max_rows(Tensor blocks) -> int");
  m.def("linear_packed(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_gemm, CPU, m) {
  m.impl("pack_weight", &pagellm::pack_weight);
  m.impl("pack_weight_blocks", &pagellm::pack_weight_blocks);
  m.impl("blocks_max_rows", &pagellm::blocks_max_rows);
  m.impl("linear_packed", &pagellm::linear_packed);
}
