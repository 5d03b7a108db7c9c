// The Mamba-2 selective state scan of hybrid models (Granite 4.0-H, Nemotron-H) over a flat batch of
// sequences, each reading and writing its own state slot. Semantics and argument rules:
// pagellm/kernels/mamba.py (the metadata: pagellm/kernels/recurrent.py).
//
// Every sequence runs sequentially in time; the rows p of a head's state S [P, N] are independent
// (S[p] = e^(dt A) S[p] + dt x[p] B, y[p] = S[p].C + D x[p]).
// - A decode (one token) is one pass over each head's state in place, row by row: read once, written
//   once, y[p] a dot product over N.
// - A longer sequence cuts each head's rows into tiles of kTile rows, held transposed ([N, kTile]) in
//   a buffer that stays in L1 for the whole sequence, so that each token is one fused pass of
//   vertical vector operations: the decay, the update and y's sums over N, with no horizontal sums.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_types.h"
#include "seq_meta.h"
#include "vec.h"

namespace pagellm {
namespace {

constexpr int kTileVecs = 2;               // state rows per prefill tile, in vectors
constexpr int kTile = kTileVecs * W;       // 32 rows with AVX-512, 16 with AVX2
constexpr int64_t kParallelMin = 1 << 16;  // state elements updated per call below which one thread runs it

struct ScanArgs {
  const float *dt, *decay;  // [T, H]: the discretized dt and e^(dt A)
  const float *B, *C, *D;   // B, C rows of N floats, token stride bc_stride; D [H]
  void* state;              // [S, H, P, N] of ST
  int64_t H, P, N, heads_per_group, x_stride, bc_stride;
};

// clamp(softplus(dt + dt_bias), lo, hi) and e^(dt A) per (token, head); softplus as torch's (threshold 20).
void discretize(const float* dt_raw, int64_t dt_stride, const float* A, const float* dt_bias, int64_t T, int64_t H,
                float lo, float hi, float* dt_out, float* decay_out) {
  const bool parallel = T * H >= (1 << 14);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float v = dt_raw[t * dt_stride + h] + dt_bias[h];
      const float sp = v > 20.0f ? v : std::log1p(std::exp(v));
      const float d = std::min(std::max(sp, lo), hi);
      dt_out[t * H + h] = d;
      decay_out[t * H + h] = std::exp(d * A[h]);
    }
  }
}

// A whole head for one token, in place on its slot's state (zeros first without an initial state).
// T: x/out's element type; ST: the state slots'.
template <typename T, typename ST>
void decode_head(const ScanArgs& p, const T* x, T* out, const SeqMeta& m, int64_t i, int64_t h) {
  const int64_t t = m.starts[i], P = p.P, N = p.N, head_state = P * N;
  const float dtv = p.dt[t * p.H + h], decay = p.decay[t * p.H + h], d = p.D[h];
  const float* b = p.B + t * p.bc_stride + (h / p.heads_per_group) * N;
  const float* c = p.C + t * p.bc_stride + (h / p.heads_per_group) * N;
  const T* xr = x + t * p.x_stride + h * P;
  T* yr = out + (t * p.H + h) * P;
  ST* const state = static_cast<ST*>(p.state);
  ST* S = state + (m.slots[i] * p.H + h) * head_state;
  const bool initial = m.initial[i];
  const int64_t nv = N / W * W;
  for (int64_t r = 0; r < P; ++r) {
    const float xv = to_float(xr[r]), xdt = xv * dtv;
    ST* s = S + r * N;
    vfloat acc0 = {}, acc1 = {};
    int64_t n = 0;
    for (; n + 2 * W <= nv; n += 2 * W) {
      const vfloat s0 = (initial ? load_kv(s + n) * decay : vfloat{}) + xdt * vload(b + n);
      const vfloat s1 = (initial ? load_kv(s + n + W) * decay : vfloat{}) + xdt * vload(b + n + W);
      store_kv(s + n, s0);
      store_kv(s + n + W, s1);
      acc0 += s0 * vload(c + n);
      acc1 += s1 * vload(c + n + W);
    }
    for (; n < nv; n += W) {
      const vfloat s0 = (initial ? load_kv(s + n) * decay : vfloat{}) + xdt * vload(b + n);
      store_kv(s + n, s0);
      acc0 += s0 * vload(c + n);
    }
    float y = hsum(acc0 + acc1);
    for (; n < N; ++n) {
      const float s0 = (initial ? to_float(s[n]) * decay : 0.0f) + xdt * b[n];
      s[n] = from_float<ST>(s0);
      y += s0 * c[n];
    }
    yr[r] = from_float<T>(y + d * xv);
  }
  for (int64_t cp = m.cp_begin[i]; cp < m.cp_begin[i + 1]; ++cp) {
    std::memcpy(state + (m.cps[3 * cp + 2] * p.H + h) * head_state, S, sizeof(ST) * head_state);
  }
}

// Rows [r0, r0 + kTile) of one head through all of a sequence's tokens; S: an [N, kTile] buffer.
template <typename T, typename ST>
void prefill_tile(const ScanArgs& p, const T* x, T* out, const SeqMeta& m, int64_t i, int64_t h, int64_t r0, float* S) {
  const int64_t N = p.N, P = p.P, rw = std::min<int64_t>(kTile, P - r0), a = m.starts[i], e = m.starts[i + 1];
  const int64_t g = h / p.heads_per_group;
  auto head_rows = [&](int64_t slot) { return static_cast<ST*>(p.state) + ((slot * p.H + h) * P + r0) * N; };
  std::fill(S, S + N * kTile, 0.0f);
  if (m.initial[i]) {
    const ST* src = head_rows(m.slots[i]);
    for (int64_t r = 0; r < rw; ++r) {
      for (int64_t n = 0; n < N; ++n) S[n * kTile + r] = to_float(src[r * N + n]);
    }
  }
  auto save = [&](int64_t slot) {
    ST* dst = head_rows(slot);
    for (int64_t r = 0; r < rw; ++r) {
      for (int64_t n = 0; n < N; ++n) dst[r * N + n] = from_float<ST>(S[n * kTile + r]);
    }
  };
  const float d = p.D[h];
  int64_t cp = m.cp_begin[i];
  const int64_t cp_end = m.cp_begin[i + 1];
  alignas(64) float xin[kTile];
  for (int64_t t = a; t < e; ++t) {
    const float dtv = p.dt[t * p.H + h], decay = p.decay[t * p.H + h];
    const T* xr = x + t * p.x_stride + h * P + r0;
    for (int64_t r = 0; r < kTile; ++r) xin[r] = r < rw ? to_float(xr[r]) : 0.0f;
    const float* b = p.B + t * p.bc_stride + g * N;
    const float* c = p.C + t * p.bc_stride + g * N;
    vfloat xdt[kTileVecs], acc0[kTileVecs] = {}, acc1[kTileVecs] = {};
    for (int u = 0; u < kTileVecs; ++u) xdt[u] = vload(xin + u * W) * dtv;
    int64_t n = 0;
    for (; n + 2 <= N; n += 2) {
      for (int u = 0; u < kTileVecs; ++u) {
        float* p0 = S + n * kTile + u * W;
        float* p1 = p0 + kTile;
        const vfloat s0 = vload(p0) * decay + b[n] * xdt[u];
        const vfloat s1 = vload(p1) * decay + b[n + 1] * xdt[u];
        vstore(p0, s0);
        vstore(p1, s1);
        acc0[u] += c[n] * s0;
        acc1[u] += c[n + 1] * s1;
      }
    }
    for (; n < N; ++n) {
      for (int u = 0; u < kTileVecs; ++u) {
        float* p0 = S + n * kTile + u * W;
        const vfloat s0 = vload(p0) * decay + b[n] * xdt[u];
        vstore(p0, s0);
        acc0[u] += c[n] * s0;
      }
    }
    T* yr = out + (t * p.H + h) * P + r0;
    for (int u = 0; u < kTileVecs; ++u) {
      const vfloat y = acc0[u] + acc1[u] + d * vload(xin + u * W);
      for (int64_t r = u * W; r < std::min<int64_t>((u + 1) * W, rw); ++r) yr[r] = from_float<T>(y[r - u * W]);
    }
    for (; cp < cp_end && m.cps[3 * cp + 1] == t + 1 - a; ++cp) save(m.cps[3 * cp + 2]);
  }
  save(m.slots[i]);
}

void selective_state_scan(at::Tensor& out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                          const at::Tensor& B, const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias,
                          at::Tensor& state, const at::Tensor& query_start_loc, const at::Tensor& slot_ids,
                          const at::Tensor& has_initial_state, const at::Tensor& checkpoints, double dt_min,
                          double dt_max) {
  const char* op = "selective_state_scan";
  TORCH_CHECK_VALUE(x.dim() == 3 && x.device().is_cpu() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.stride(2) == 1 &&
                        x.stride(1) == x.size(2),
                    op, ": x must be a float32 or bfloat16 CPU [T, H, P] tensor with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TORCH_CHECK_VALUE(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), op,
                    ": out must be contiguous, shaped and typed like x");
  TORCH_CHECK_VALUE(
      dt.scalar_type() == at::kFloat && dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H && dt.stride(1) == 1, op,
      ": dt must be a float32 [T, H] tensor with contiguous rows");
  for (const at::Tensor* v : {&A, &D, &dt_bias}) {
    TORCH_CHECK_VALUE(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == H, op,
                      ": A, D and dt_bias must be contiguous float32 [H] vectors");
  }
  TORCH_CHECK_VALUE(B.scalar_type() == at::kFloat && B.dim() == 3 && B.size(0) == T && B.stride(2) == 1 &&
                        B.stride(1) == B.size(2) && C.sizes() == B.sizes() && C.strides() == B.strides() &&
                        C.scalar_type() == at::kFloat,
                    op, ": B and C must be float32 [T, G, N] tensors of one layout with contiguous groups");
  const int64_t G = B.size(1), N = B.size(2);
  TORCH_CHECK_VALUE(G > 0 && H % G == 0, op, ": the heads must be a multiple of the groups");
  TORCH_CHECK_VALUE((state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16) &&
                        state.is_contiguous() && state.dim() == 4 && state.size(1) == H && state.size(2) == P &&
                        state.size(3) == N,
                    op, ": state must be a contiguous float32 or bfloat16 [S, H, P, N] tensor");
  const SeqMeta m = read_meta(query_start_loc, slot_ids, has_initial_state, checkpoints, T, state.size(0), op);

  at::Tensor dts = at::empty({T, H}, dt.options());
  at::Tensor decays = at::empty({T, H}, dt.options());
  ScanArgs p;
  p.dt = dts.data_ptr<float>();
  p.decay = decays.data_ptr<float>();
  p.B = B.data_ptr<float>();
  p.C = C.data_ptr<float>();
  p.D = D.data_ptr<float>();
  p.state = state.data_ptr();
  p.H = H;
  p.P = P;
  p.N = N;
  p.heads_per_group = H / G;
  p.x_stride = x.stride(0);
  p.bc_stride = B.stride(0);
  discretize(dt.data_ptr<float>(), dt.stride(0), A.data_ptr<float>(), dt_bias.data_ptr<float>(), T, H,
             static_cast<float>(dt_min), static_cast<float>(dt_max), dts.data_ptr<float>(), decays.data_ptr<float>());

  // Work items, longest sequences first so that the dynamic schedule does not end on one long item:
  // (sequence, head, first row) for a prefill tile, row -1 for a decode's whole head.
  struct Item {
    int64_t seq, head, row;
  };
  std::vector<int64_t> order;
  for (int64_t i = 0; i < m.num_seqs; ++i) {
    const int64_t L = m.starts[i + 1] - m.starts[i];
    if (L == 0 && !m.initial[i]) {
      const int64_t slot_bytes = H * P * N * state.element_size();
      std::memset(static_cast<char*>(p.state) + m.slots[i] * slot_bytes, 0, slot_bytes);
    } else if (L > 0) {
      order.push_back(i);
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t u, int64_t v) { return m.starts[u + 1] - m.starts[u] > m.starts[v + 1] - m.starts[v]; });
  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t i : order) {
    const int64_t L = m.starts[i + 1] - m.starts[i];
    work += L * H * P * N;
    for (int64_t h = 0; h < H; ++h) {
      if (L == 1) {
        items.push_back({i, h, -1});
      } else {
        for (int64_t r = 0; r < P; r += kTile) items.push_back({i, h, r});
      }
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const bool parallel = work >= kParallelMin && num_items > 1;
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    dispatch_float_bf16(state.scalar_type(), [&](auto state_tag) {
      using scalar_t = decltype(tag);
      using state_t = decltype(state_tag);
      const scalar_t* xp = x.data_ptr<scalar_t>();
      scalar_t* yp = out.data_ptr<scalar_t>();
#pragma omp parallel if (parallel)
      {
        std::vector<float> buf(N * kTile + 16);
        float* S = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < num_items; ++k) {
          const Item& it = items[k];
          if (it.row < 0) {
            decode_head<scalar_t, state_t>(p, xp, yp, m, it.seq, it.head);
          } else {
            prefill_tile<scalar_t, state_t>(p, xp, yp, m, it.seq, it.head, it.row, S);
          }
        }
      }
    });
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_mamba, m) {
  m.def(
      "selective_state_scan(Tensor(a!) out, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, "
      "Tensor dt_bias, Tensor(b!) state, Tensor query_start_loc, Tensor slot_ids, Tensor has_initial_state, "
      "Tensor checkpoints, float dt_min, float dt_max) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_mamba, CPU, m) { m.impl("selective_state_scan", &pagellm::selective_state_scan); }
