// What the dense-weight packers (gemm.cpp, gemm_bf16.cpp) do to a weight before laying it out in
// their own panels: the same input check and the same gate/up pairing for a fused gated activation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pagellm {

// The weight to pack, checked and contiguous.
inline at::Tensor weight_to_pack(const at::Tensor& weight, const char* op) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2, op,
                    ": weight must be a 2-D float32 CPU tensor");
  return weight.contiguous();
}

// d of a gate/up weight [2d, K] (gate rows first); ValueError unless d is a multiple of `group`.
inline int64_t gate_up_half(const at::Tensor& w, int64_t group, const char* op) {
  const int64_t d = w.size(0) / 2;
  TORCH_CHECK_VALUE(w.size(0) % 2 == 0 && d % group == 0, op, ": a gate/up weight needs 2d rows with d a multiple of ",
                    group, "; got ", w.size(0));
  return d;
}

// A gate/up weight [2d, K] (gate rows first) reordered as [d / group, 2, group, K]: each `group`
// gate rows followed by the same outputs' up rows, so that a panel of 2 x group columns holds
// both sums of each output and the kernel can store act(gate) * up. ValueError unless d is a
// multiple of `group`.
inline at::Tensor gate_up_interleaved(const at::Tensor& w, int64_t group, const char* op) {
  const int64_t d = gate_up_half(w, group, op), k = w.size(1);
  return w.view({2, d / group, group, k}).transpose(0, 1).contiguous().view({2 * d, k});
}

// A gate/up bias (2d floats, gate's then up's) in the same order as gate_up_interleaved's rows,
// so that a panel's 2 x group bias values sit where its sums do.
inline std::vector<float> gate_up_bias_interleaved(const at::Tensor& bias, int64_t d, int64_t group, const char* op) {
  TORCH_CHECK_VALUE(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == 2 * d, op,
                    ": a gate/up bias must be contiguous float32 of ", 2 * d, " elements");
  const float* b = bias.data_ptr<float>();
  std::vector<float> out(2 * d);
  for (int64_t p = 0; p < d / group; ++p) {
    for (int64_t j = 0; j < group; ++j) {
      out[2 * group * p + j] = b[group * p + j];
      out[2 * group * p + group + j] = b[d + group * p + j];
    }
  }
  return out;
}

}  // namespace pagellm
