// Random sampling straight from logits, for rows without top-k, top-p or min-p: per row, one pass
// for the maximum, one for the softmax denominator and a scan that stops at the drawn token.
//
// The torch path for the same rows is divide by temperature, softmax, cumulative sum and a
// search: five full passes over the [rows, vocabulary] matrix, three of them writing it. The
// draw is the same inverse-CDF draw: the first token whose running sum of e^(x / t - max) exceeds
// u times the total, so results agree with the torch path up to rounding at CDF boundaries.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace pagellm {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kSamplingEps = 1e-5f;  // temperatures below this mean greedy rows; they sample at 1

// e^(x / t - m) for one vector, with -inf logits (banned tokens) exactly 0 rather than 2^-127.
inline vfloat weights(vfloat x, vfloat t, vfloat m) {
  const vfloat e = vexp(x / t - m);
  return x == vsplat(kNegInf) ? vfloat{} : e;
}

int64_t sample_row(const float* x, int64_t vocab, float t, float u) {
  const int64_t full = vocab / W * W;
  vfloat vmax_acc = vsplat(kNegInf);
  for (int64_t i = 0; i < full; i += W) vmax_acc = vmax(vmax_acc, vload(x + i));
  float x_max = full > 0 ? hmax(vmax_acc) : kNegInf;
  for (int64_t i = full; i < vocab; ++i) x_max = std::max(x_max, x[i]);
  if (x_max == kNegInf) return 0;  // nothing is allowed: any answer is as good
  const float m = x_max / t;       // division is monotonic, so this is the maximum of x / t
  const vfloat vt = vsplat(t), vm = vsplat(m);
  // The total is summed block by block in the same order as the scan below, so the scan's
  // running sum reaches exactly this total and the target (u < 1) is always crossed.
  float total = 0.f;
  for (int64_t i = 0; i < full; i += W) total += hsum(weights(vload(x + i), vt, vm));
  for (int64_t i = full; i < vocab; ++i) total += x[i] == kNegInf ? 0.f : std::exp(x[i] / t - m);
  const float target = u * total;
  float acc = 0.f;
  int64_t last_allowed = 0;
  for (int64_t i = 0; i < full; i += W) {
    const vfloat w = weights(vload(x + i), vt, vm);
    const float block = hsum(w);
    if (acc + block > target) {
      float inner = acc;
      for (int j = 0; j < W; ++j) {
        if (w[j] > 0.f) last_allowed = i + j;
        inner += w[j];
        if (inner > target && w[j] > 0.f) return i + j;
      }
      return last_allowed;  // the in-block sum rounded below the block total
    }
    acc += block;
    for (int j = 0; j < W; ++j)
      if (w[j] > 0.f) last_allowed = i + j;
  }
  for (int64_t i = full; i < vocab; ++i) {
    const float w = x[i] == kNegInf ? 0.f : std::exp(x[i] / t - m);
    if (w > 0.f) last_allowed = i;
    acc += w;
    if (acc > target && w > 0.f) return i;
  }
  return last_allowed;
}

// The checks both row-wise ops share: float32 CPU logits with contiguous rows, one int64 out per row.
void check_logits_and_out(const at::Tensor& out, const at::Tensor& logits, const char* op) {
  TORCH_CHECK_VALUE(
      logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1, op,
      ": logits must be a float32 CPU matrix with contiguous rows");
  TORCH_CHECK_VALUE(logits.size(1) > 0, op, ": empty vocabulary");
  TORCH_CHECK_VALUE(out.scalar_type() == at::kLong && out.is_contiguous() && out.numel() == logits.size(0), op,
                    ": out must be contiguous int64 with one entry per row");
}

void sample_from_logits(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
  check_logits_and_out(out, logits, "sample_from_logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  for (const at::Tensor* t : {&temperature, &u})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == rows,
                      "sample_from_logits: temperature and u must be contiguous float32, one per row");
  const float* x = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const float* draw = u.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t ld = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float t = temp[r] < kSamplingEps ? 1.0f : temp[r];
      dst[r] = sample_row(x + r * ld, vocab, t, draw[r]);
    }
  });
}

// The index of the row's maximum, the first if several are equal and the first NaN if any, as
// torch.argmax. Each lane keeps its first strict maximum; the lanes' indices interleave, so the
// smallest index among the lanes holding the maximum is the row's first.
int64_t argmax_row(const float* x, int64_t vocab) {
  const int64_t full = vocab / W * W;
  vfloat best = vsplat(kNegInf);
  vint index{}, at{}, has_nan{};
  for (int i = 0; i < W; ++i) at[i] = i;
  index = at;
  for (int64_t i = 0; i < full; i += W, at += W) {
    const vfloat v = vload(x + i);
    const vint greater = v > best;
    best = greater ? v : best;
    index = greater ? at : index;
    has_nan |= v != v;
  }
  float best_value = best[0];  // with no full vector: -inf at index 0, as for a row of -inf
  int64_t best_index = index[0];
  for (int i = 1; i < W; ++i) {
    if (best[i] > best_value || (best[i] == best_value && index[i] < best_index)) {
      best_value = best[i];
      best_index = index[i];
    }
  }
  for (int64_t i = full; i < vocab; ++i) {
    if (x[i] > best_value) {
      best_value = x[i];
      best_index = i;
    }
    has_nan[0] |= x[i] != x[i];
  }
  bool any_nan = false;
  for (int i = 0; i < W; ++i) any_nan |= has_nan[i] != 0;
  if (any_nan) {
    for (int64_t i = 0; i < vocab; ++i)
      if (x[i] != x[i]) return i;
  }
  return best_index;
}

// out[r] = argmax of logits row r, for greedy rows: one pass per row, rows spread over the
// threads (torch's argmax runs one row at a time).
void argmax_rows(at::Tensor& out, const at::Tensor& logits) {
  check_logits_and_out(out, logits, "argmax_rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const float* x = logits.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int64_t ld = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(x + r * ld, vocab);
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_sample, m) {
  m.def("sample_from_logits(Tensor(a!) out, Tensor logits, Tensor temperature, Tensor u) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor logits) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_sample, CPU, m) {
  m.impl("sample_from_logits", &pagellm::sample_from_logits);
  m.impl("argmax_rows", &pagellm::argmax_rows);
}
