// What the packers (gemm.cpp, gemm_bf16.cpp, gemm_int8.cpp) do to a weight before laying it out
// in their own panels: the same input check, the same gate/up reordering for a fused SiLU-and-mul,
// and one walk over the GGUF-style blocks a weight holds exactly (quant_blocks.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "quant_blocks.h"

namespace pagellm {

// The weight to pack, checked and contiguous.
inline at::Tensor weight_to_pack(const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2, op,
                    ": weight must be a 2-D float32 CPU tensor");
  return weight.contiguous();
}

// A gate/up weight [2d, K] (gate rows first) reordered as [d / group, 2, group, K]: each `group`
// gate rows followed by the same outputs' up rows, so that a panel of 2 x group columns holds
// both sums of each output and the kernel can store silu(gate) * up. ValueError unless d is a
// multiple of `group`.
inline at::Tensor gate_up_interleaved(const at::Tensor& w, int64_t group, const char* op) {
  const int64_t d = w.size(0) / 2, k = w.size(1);
  TORCH_CHECK_VALUE(w.size(0) % 2 == 0 && d % group == 0, op, ": a gate/up weight needs 2d rows with d a multiple of ",
                    group, "; got ", w.size(0));
  return w.view({2, d / group, group, k}).transpose(0, 1).contiguous().view({2 * d, k});
}

// Packs w [N, K] (K a multiple of QK) into `dtype` [ceil(N / NR), K / QK, block_bytes] when every
// block of QK inputs of every row is exactly a 4-bit (Q4) or 8-bit block, else returns an
// undefined tensor (as soon as one block is not). Each block starts with its scales, float
// d[NR] (and for Q4 m[NR]), filled here; `store(block, j, q)` puts column j's QK values q (uint8
// 0..15 for Q4, int8 for Q8) where the caller's layout wants them.
template <bool Q4, typename Store>
at::Tensor pack_exact_blocks(const at::Tensor& w, int64_t block_bytes, at::ScalarType dtype, Store store) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR, num_blocks = k / QK;
  at::Tensor packed = at::zeros({panels, num_blocks, block_bytes}, w.options().dtype(dtype));
  const float* src = w.data_ptr<float>();
  uint8_t* dst = static_cast<uint8_t*>(packed.data_ptr());
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
          const bool fits =
              Q4 ? find_q4_block(v, d[j], d[NR + j], q) : find_q8_block(v, d[j], reinterpret_cast<int8_t*>(q));
          if (!fits) {
            exact = false;
            return;
          }
          store(block, j, q);
        }
      }
    }
  });
  return exact ? packed : at::Tensor();
}

}  // namespace pagellm
