// The elementwise parts of a Llama block, fused for CPUs: RMSNorm (with the residual add folded
// in), SiLU-and-multiply, and rotary embedding applied in place. In eager torch each of these is
// three to six ops, every one a pass over memory, a fresh allocation and a dispatch; at a decode
// batch the dispatches dominate and at a prefill the memory passes do.
//
// The arithmetic follows transformers' order (x * rsqrt(mean(x^2) + eps), then * weight; x / (1 +
// e^-x); x * cos -/+ rotated * sin), so results agree to a few ulps; sums run in a different
// order, as in any kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace pagellm {
namespace {

// Rows per parallel chunk: a decode batch's few short rows stay on one thread, since waking a
// sleeping OpenMP worker costs more than the work (about a nanosecond per element).
int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 131072 / std::max<int64_t>(row_len, 1)); }

void check_matrix(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
                    " must be a float32 CPU tensor");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.stride(1) == 1, op, ": ", name, " must be 2-D with contiguous rows");
}

void check_weight(const at::Tensor& weight, int64_t hidden, const char* op) {
  TORCH_CHECK_VALUE(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                        weight.is_contiguous() && weight.size(0) == hidden,
                    op, ": weight must be a contiguous float32 vector of the hidden size");
}

// out = x * (1 / sqrt(mean(x^2) + eps)) * w for one row; out may alias x.
inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vfloat v = vload(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const vfloat vinv = vsplat(inv);
  for (i = 0; i + W <= n; i += W) vstore(out + i, (vload(x + i) * vinv) * vload(w + i));
  for (; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_matrix(x, "rms_norm", "x");
  check_matrix(out, "rms_norm", "out");
  TORCH_CHECK_VALUE(out.sizes() == x.sizes(), "rms_norm: out must be shaped like x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, "rms_norm");
  const float* src = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(src + r * xs, w, dst + r * os, n, static_cast<float>(eps));
  });
}

// out = weight * rms_norm(x * silu(z)) with each run of `group` channels normalised on its own:
// Mamba-2's gated norm (transformers' MambaRMSNormGated, the gate before the norm) in one pass
// instead of a dozen ops. z may be a column slice of a wider projection.
void group_gated_rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight,
                          int64_t group, double eps) {
  const char* op = "group_gated_rms_norm";
  check_matrix(x, op, "x");
  check_matrix(z, op, "z");
  check_matrix(out, op, "out");
  TORCH_CHECK_VALUE(z.sizes() == x.sizes() && out.sizes() == x.sizes(), op, ": x, z and out must have one shape");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK_VALUE(group > 0 && n % group == 0, op, ": ", n, " channels are not whole groups of ", group);
  check_weight(weight, n, op);
  const float* xd = x.data_ptr<float>();
  const float* zd = z.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t xs = x.stride(0), zs = z.stride(0), os = out.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xd + r * xs;
      const float* zr = zd + r * zs;
      float* o = od + r * os;
      int64_t i = 0;
      for (; i + W <= n; i += W) vstore(o + i, vload(xr + i) * silu(vload(zr + i)));
      if (i < n) {  // through zero-padded vectors, so every element takes the same silu
        float xv[W] = {}, zv[W] = {}, res[W];
        std::memcpy(xv, xr + i, (n - i) * sizeof(float));
        std::memcpy(zv, zr + i, (n - i) * sizeof(float));
        vstore(res, vload(xv) * silu(vload(zv)));
        std::memcpy(o + i, res, (n - i) * sizeof(float));
      }
      for (int64_t g = 0; g < n; g += group) norm_row(o + g, w + g, o + g, group, e);
    }
  });
}

// residual += x, then x = rms_norm(residual): the pre-norm block's "add the sublayer output to
// the stream, normalise for the next sublayer" in one pass.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_matrix(x, "fused_add_rms_norm", "x");
  check_matrix(residual, "fused_add_rms_norm", "residual");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "fused_add_rms_norm: residual must be shaped like x");
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(weight, n, "fused_add_rms_norm");
  float* xd = x.data_ptr<float>();
  float* rd = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xd + r * xs;
      float* rr = rd + r * rs;
      int64_t i = 0;
      for (; i + W <= n; i += W) vstore(rr + i, vload(xr + i) + vload(rr + i));
      for (; i < n; ++i) rr[i] = xr[i] + rr[i];
      norm_row(rr, w, xr, n, static_cast<float>(eps));
    }
  });
}

// out = act(x[:, :d]) * x[:, d:] for a gated activation code (vec.h's GatedAct); a row's tail goes
// through the same vector form, so every element is what the fused epilogues store.
void gated_and_mul(at::Tensor& out, const at::Tensor& x, int64_t activation) {
  check_matrix(x, "gated_and_mul", "x");
  check_matrix(out, "gated_and_mul", "out");
  TORCH_CHECK_VALUE(activation >= kActSilu && activation <= kActSwigluOai, "gated_and_mul: unknown activation code ",
                    activation);
  const int64_t rows = x.size(0), d = out.size(1);
  TORCH_CHECK_VALUE(x.size(1) == 2 * d && out.size(0) == rows, "gated_and_mul: x must be [rows, 2d] and out [rows, d]");
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = src + r * xs;
      const float* up = gate + d;
      float* o = dst + r * os;
      int64_t i = 0;
      for (; i + W <= d; i += W) vstore(o + i, gated(activation, vload(gate + i), vload(up + i)));
      if (i < d) {
        float g[W] = {}, u[W] = {}, res[W];
        std::memcpy(g, gate + i, (d - i) * sizeof(float));
        std::memcpy(u, up + i, (d - i) * sizeof(float));
        vstore(res, gated(activation, vload(g), vload(u)));
        std::memcpy(o + i, res, (d - i) * sizeof(float));
      }
    }
  });
}

// Rotates the first `num_heads` heads of every row of x in place (Neox style: the two halves of a
// head are the pair), by the angle of that row's position. With x the fused q/k/v projection
// output and num_heads = query + key heads, this rotates q and k where they lie.
void rotary_embedding(at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_heads, int64_t head_dim) {
  check_matrix(x, "rotary_embedding", "x");
  check_matrix(cos, "rotary_embedding", "cos");
  check_matrix(sin, "rotary_embedding", "sin");
  const int64_t half = head_dim / 2;
  TORCH_CHECK_VALUE(head_dim % 2 == 0 && num_heads >= 0 && num_heads * head_dim <= x.size(1),
                    "rotary_embedding: x rows are too short for ", num_heads, " heads of ", head_dim);
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.size(1) == half && cos.is_contiguous() && sin.is_contiguous(),
                    "rotary_embedding: cos and sin must be contiguous [positions, head_dim / 2]");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.is_contiguous() &&
                        positions.size(0) == x.size(0),
                    "rotary_embedding: positions must be contiguous int64, one per row of x");
  const int64_t rows = x.size(0), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK_VALUE(pos[r] >= 0 && pos[r] < max_pos, "rotary_embedding: position ", pos[r], " outside [0, ", max_pos,
                      ")");
  float* xd = x.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cd + pos[r] * half;
      const float* s = sd + pos[r] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x1 = xd + r * xs + h * head_dim;
        float* x2 = x1 + half;
        int64_t i = 0;
        for (; i + W <= half; i += W) {
          const vfloat a = vload(x1 + i), b = vload(x2 + i), vc = vload(c + i), vs = vload(s + i);
          vstore(x1 + i, a * vc - b * vs);
          vstore(x2 + i, b * vc + a * vs);
        }
        for (; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_ops, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("gated_and_mul(Tensor(a!) out, Tensor x, int activation) -> ()");
  m.def("group_gated_rms_norm(Tensor(a!) out, Tensor x, Tensor z, Tensor weight, int group, float eps) -> ()");
  m.def("rotary_embedding(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_ops, CPU, m) {
  m.impl("rms_norm", &pagellm::rms_norm);
  m.impl("fused_add_rms_norm", &pagellm::fused_add_rms_norm);
  m.impl("gated_and_mul", &pagellm::gated_and_mul);
  m.impl("group_gated_rms_norm", &pagellm::group_gated_rms_norm);
  m.impl("rotary_embedding", &pagellm::rotary_embedding);
}
