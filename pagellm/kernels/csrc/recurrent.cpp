// The recurrent layers of hybrid models (Qwen3-Next / Qwen3.5 Gated DeltaNet) over a flat batch of
// sequences, each reading and writing its own state slot: the short depthwise causal convolution
// and the gated delta rule. Semantics and argument rules: pagellm/kernels/recurrent.py.
//
// Gated delta rule: every sequence runs sequentially in time. The delta rule keeps the state's
// value columns independent, so the state [Dk, Dv] of a (sequence, head) is cut into tiles of
// kTileVecs vectors of columns; a tile is copied into a contiguous buffer that stays in L1 for the
// whole sequence, and each token is one fused pass over it: the update of token t
// (S = S * e^g_t + k_t delta_t^T) also accumulates token t+1's reads k_{t+1}.S and q_{t+1}.S, so the
// output of t+1 follows from S_t without a second pass (q.(d S + k delta^T) = d q.S + (q.k) delta).
// A decode (one token) is one work item per head, updated in place in its slot: its state is read
// from memory once and written once.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_types.h"
#include "seq_meta.h"
#include "vec.h"

namespace pagellm {
namespace {

constexpr int kTileVecs = 2;               // value columns per state tile, in vectors
constexpr int kTile = kTileVecs * W;       // 32 floats with AVX-512, 16 with AVX2
constexpr int64_t kConvBlock = 8 * W;      // channels per convolution work item
constexpr int64_t kParallelMin = 1 << 17;  // state or input elements below which one thread runs the call
constexpr int kDecodeVecs = 32 / W;        // a decode's column chunk: 128 bytes of each state row

// ---- causal conv1d ---------------------------------------------------------------------------

// A one-token sequence's full block of channels, straight from its state rows (the K - 1 inputs
// before it, oldest first), which then shift by one: no ring of inputs to set up and save. The
// state may be in another type than x (--mamba-cache-dtype): its rows are widened and rounded here.
template <typename T, typename ST>
void conv_decode_block(T* orow, const T* xr, const float* wpad, const float* bpad, ST* st, bool initial, int64_t C,
                       int64_t K, bool silu_on) {
  const int64_t H = K - 1;
  alignas(64) float xin[kConvBlock], y[kConvBlock];
  for (int64_t c = 0; c < kConvBlock; ++c) xin[c] = to_float(xr[c]);
  for (int64_t v = 0; v < kConvBlock; v += W) {
    vfloat acc = vload(bpad + v) + vload(wpad + H * kConvBlock + v) * vload(xin + v);
    if (initial) {
      for (int64_t j = 0; j < H; ++j) {
        alignas(64) float prev[W];
        for (int c = 0; c < W; ++c) prev[c] = to_float(st[j * C + v + c]);
        acc += vload(wpad + j * kConvBlock + v) * vload(prev);
      }
    }
    vstore(y + v, silu_on ? silu(acc) : acc);
  }
  for (int64_t c = 0; c < kConvBlock; ++c) orow[c] = from_float<T>(y[c]);
  for (int64_t j = 0; j + 1 < H; ++j) {
    for (int64_t c = 0; c < kConvBlock; ++c) st[j * C + c] = initial ? st[(j + 1) * C + c] : ST(0);
  }
  if (H > 0) {
    for (int64_t c = 0; c < kConvBlock; ++c) st[(H - 1) * C + c] = from_float<ST>(xin[c]);
  }
}

// Where sequence i's input at position p (from its first token; negative: before it) lies: a row of
// its state slot (returned; in the state's type), or else a row of x (ldx apart) or zeros for a
// sequence without a state (set in *x_row, in x's type).
template <typename T, typename ST>
const ST* conv_input(const T* x, int64_t ldx, const ST* state, const T* zeros, const SeqMeta& m, int64_t i, int64_t p,
                     int64_t C, int64_t H, const T** x_row) {
  *x_row = p >= 0 ? x + (m.starts[i] + p) * ldx : zeros;
  return p < 0 && m.initial[i] ? state + (m.slots[i] * H + H + p) * C : nullptr;
}

// Channels [c0, c1) of tokens [t0, t1) of sequence i, each input read where it lies (conv_input).
// A work item's K row spans and taps stay in L1, and the rows stream through it in order.
template <typename T, typename ST>
void conv_span(T* out, const T* x, int64_t ldx, const float* taps, const float* bias, const ST* state, const T* zeros,
               const SeqMeta& m, int64_t i, int64_t t0, int64_t t1, int64_t c0, int64_t c1, int64_t C, int64_t K,
               bool silu_on) {
  const int64_t a = m.starts[i], H = K - 1;
  const T* in[16];
  const ST* in_state[16];  // non-null where the input is a state row (only the first K - 1 tokens)
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < K; ++j)
      in_state[j] = conv_input(x, ldx, state, zeros, m, i, t - H + j, C, H, &in[j]);  // oldest first
    T* orow = out + (a + t) * C;
    int64_t c = c0;
    if (t >= H || !m.initial[i]) {  // every input a row of x (or zeros): the loop without a choice per tap
      for (; c + W <= c1; c += W) {
        vfloat acc = bias != nullptr ? vload(bias + c) : vfloat{};
        for (int64_t j = 0; j < K; ++j) acc += vload(taps + j * C + c) * load_kv(in[j] + c);
        store_kv(orow + c, silu_on ? silu(acc) : acc);
      }
    }
    for (; c + W <= c1; c += W) {
      vfloat acc = bias != nullptr ? vload(bias + c) : vfloat{};
      for (int64_t j = 0; j < K; ++j)
        acc += vload(taps + j * C + c) * (in_state[j] != nullptr ? load_kv(in_state[j] + c) : load_kv(in[j] + c));
      store_kv(orow + c, silu_on ? silu(acc) : acc);
    }
    if (c < c1) {  // the last channels, through zero-padded vectors
      alignas(64) float tap[W], xin[W], y[W];
      for (int l = 0; l < W; ++l) y[l] = bias != nullptr && c + l < c1 ? bias[c + l] : 0.0f;
      vfloat acc = vload(y);
      for (int64_t j = 0; j < K; ++j) {
        for (int l = 0; l < W; ++l) {
          tap[l] = c + l < c1 ? taps[j * C + c + l] : 0.0f;
          xin[l] = c + l >= c1 ? 0.0f : in_state[j] != nullptr ? to_float(in_state[j][c + l]) : to_float(in[j][c + l]);
        }
        acc += vload(tap) * vload(xin);
      }
      vstore(y, silu_on ? silu(acc) : acc);
      for (int64_t l = 0; c + l < c1; ++l) orow[c + l] = from_float<T>(y[l]);
    }
  }
}

// The K - 1 inputs of sequence i before token `offset`, channels [c0, c1), into state slot `slot`.
// Rows go in ascending order: a slot overwritten with its own later rows (a sequence shorter than
// K - 1 saving into its slot) reads each row before it is written.
template <typename T, typename ST>
void conv_save(const T* x, int64_t ldx, ST* state, const T* zeros, const SeqMeta& m, int64_t i, int64_t offset,
               int64_t slot, int64_t c0, int64_t c1, int64_t C, int64_t H) {
  ST* dst = state + slot * H * C;
  for (int64_t r = 0; r < H; ++r) {
    const T* x_row;
    const ST* src = conv_input(x, ldx, static_cast<const ST*>(state), zeros, m, i, offset - H + r, C, H, &x_row);
    if (src != nullptr) {
      std::memmove(dst + r * C + c0, src + c0, sizeof(ST) * (c1 - c0));
    } else if constexpr (std::is_same_v<T, ST>) {
      std::memmove(dst + r * C + c0, x_row + c0, sizeof(ST) * (c1 - c0));
    } else {
      for (int64_t c = c0; c < c1; ++c) dst[r * C + c] = from_float<ST>(to_float(x_row[c]));
    }
  }
}

constexpr int64_t kConvTokens = 32;  // tokens per prompt work item
constexpr int64_t kConvSpan = 512;   // channels per prompt work item

// A work item of the convolution: a block of channels of every one-token sequence (the decode
// path, seq < 0), or a span of channels and tokens of one sequence.
struct ConvItem {
  int64_t seq, c0, c1, t0, t1;
};

void causal_conv1d(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, at::Tensor& conv_state, const at::Tensor& query_start_loc,
                   const at::Tensor& slot_ids, const at::Tensor& has_initial_state, const at::Tensor& checkpoints,
                   bool silu_on) {
  const char* op = "causal_conv1d";
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= x.size(1) && out.is_contiguous() &&
                        out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
                    op, ": x must be a [T, C] tensor of contiguous rows and out a contiguous one of its dtype");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                    ": x must be float32 or bfloat16");
  const int64_t T = x.size(0), C = x.size(1), ldx = x.stride(0);
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.dim() == 2 &&
                        weight.size(1) == C && weight.size(0) >= 1 && weight.size(0) <= 16,
                    op, ": weight must be a contiguous float32 [K, C] tensor, K <= 16");
  const int64_t K = weight.size(0), H = K - 1;
  TORCH_CHECK_VALUE((conv_state.scalar_type() == at::kFloat || conv_state.scalar_type() == at::kBFloat16) &&
                        conv_state.is_contiguous() && conv_state.dim() == 3 && conv_state.size(1) == H &&
                        conv_state.size(2) == C,
                    op, ": conv_state must be a contiguous float32 or bfloat16 [S, K - 1, C] tensor");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == C, op,
                      ": bias must be a contiguous float32 [C] vector");
    b = bias->data_ptr<float>();
  }
  const SeqMeta m = read_meta(query_start_loc, slot_ids, has_initial_state, checkpoints, T, conv_state.size(0), op);
  // One-token sequences without checkpoints take the decode path on their full channel blocks;
  // everything else is cut into spans, whose windows are saved once all inputs are read.
  const int64_t full = C / kConvBlock * kConvBlock;
  std::vector<ConvItem> items, saves;
  bool any_decode = false;
  for (int64_t i = 0; i < m.num_seqs; ++i) {
    const int64_t L = m.starts[i + 1] - m.starts[i];
    const bool decode = L == 1 && m.cp_begin[i] == m.cp_begin[i + 1] && full > 0;
    any_decode = any_decode || decode;
    for (int64_t c0 = decode ? full : 0; c0 < C; c0 += kConvSpan) {
      const int64_t c1 = std::min(C, c0 + kConvSpan);
      for (int64_t t0 = 0; t0 < L; t0 += kConvTokens) items.push_back({i, c0, c1, t0, std::min(L, t0 + kConvTokens)});
      saves.push_back({i, c0, c1, 0, 0});
    }
  }
  if (any_decode) {
    for (int64_t c0 = 0; c0 < full; c0 += kConvBlock) items.push_back({-1, c0, c0 + kConvBlock, 0, 0});
  }
  const bool parallel = T * C * 8 >= kParallelMin && items.size() > 1;
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    dispatch_float_bf16(conv_state.scalar_type(), [&](auto state_tag) {
      using scalar_t = decltype(tag);
      using state_t = decltype(state_tag);
      scalar_t* o = out.data_ptr<scalar_t>();
      const scalar_t* xp = x.data_ptr<scalar_t>();
      state_t* st = conv_state.data_ptr<state_t>();
      const float* w = weight.data_ptr<float>();
      const std::vector<scalar_t> zeros(C, scalar_t(0));
#pragma omp parallel if (parallel)
      {
        float wpad[16 * kConvBlock];  // a decode block's taps
        float bpad[kConvBlock];
#pragma omp for schedule(dynamic, 1)
        for (size_t n = 0; n < items.size(); ++n) {
          const ConvItem& it = items[n];
          if (it.seq >= 0) {
            conv_span<scalar_t, state_t>(o, xp, ldx, w, b, st, zeros.data(), m, it.seq, it.t0, it.t1, it.c0, it.c1, C,
                                         K, silu_on);
            continue;
          }
          for (int64_t j = 0; j < K; ++j) std::copy(w + j * C + it.c0, w + j * C + it.c1, wpad + j * kConvBlock);
          for (int64_t c = 0; c < kConvBlock; ++c) bpad[c] = b != nullptr ? b[it.c0 + c] : 0.0f;
          for (int64_t i = 0; i < m.num_seqs; ++i) {
            const int64_t a = m.starts[i];
            if (m.starts[i + 1] - a != 1 || m.cp_begin[i] != m.cp_begin[i + 1]) continue;
            conv_decode_block(o + a * C + it.c0, xp + a * ldx + it.c0, wpad, bpad, st + m.slots[i] * H * C + it.c0,
                              m.initial[i], C, K, silu_on);
          }
        }
        // Checkpoints first: a sequence's own slot, which they may read, is written last.
#pragma omp for schedule(dynamic, 1)
        for (size_t n = 0; n < saves.size(); ++n) {
          const ConvItem& it = saves[n];
          const int64_t i = it.seq, L = m.starts[i + 1] - m.starts[i];
          for (int64_t cp = m.cp_begin[i]; cp < m.cp_begin[i + 1]; ++cp)
            conv_save(xp, ldx, st, zeros.data(), m, i, m.cps[3 * cp + 1], m.cps[3 * cp + 2], it.c0, it.c1, C, H);
          conv_save(xp, ldx, st, zeros.data(), m, i, L, m.slots[i], it.c0, it.c1, C, H);
        }
      }
    });
  });
}

// ---- gated delta rule ------------------------------------------------------------------------

// q and k as float32, L2-normalised (eps 1e-6, transformers' l2norm) when asked, q times scale; qk = q.k.
template <typename T>
void prepare_qk(const T* q, const T* k, float* qn, float* kn, float* qk, int64_t rows, int64_t D, float scale,
                bool l2norm, bool parallel) {
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + r * D;
    const T* kr = k + r * D;
    float* qo = qn + r * D;
    float* ko = kn + r * D;
    float sq = 0.f, sk = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      qo[d] = to_float(qr[d]);
      ko[d] = to_float(kr[d]);
      sq += qo[d] * qo[d];
      sk += ko[d] * ko[d];
    }
    const float iq = (l2norm ? 1.0f / std::sqrt(sq + 1e-6f) : 1.0f) * scale,
                ik = l2norm ? 1.0f / std::sqrt(sk + 1e-6f) : 1.0f;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      qo[d] *= iq;
      ko[d] *= ik;
      dot += qo[d] * ko[d];
    }
    qk[r] = dot;
  }
}

struct GdrArgs {
  const float *qn, *kn, *qk, *g, *beta;
  void* state;  // [S, Hv, Dk, Dv] of ST
  int64_t Hk, Hv, Dk, Dv, group;
};

// One (sequence, v head, column tile) through all the sequence's tokens; S: a [Dk, kTile] buffer.
// T: q/k/v/out's element type; ST: the state slots'.
template <typename T, typename ST>
void gdr_tile(const GdrArgs& p, const T* v, T* out, const SeqMeta& m, int64_t i, int64_t h, int64_t c0, float* S) {
  const int64_t Dk = p.Dk, Dv = p.Dv, cw = std::min<int64_t>(kTile, Dv - c0), a = m.starts[i], e = m.starts[i + 1];
  const int64_t kh = h / p.group, head_state = p.Dk * p.Dv;
  auto state_tile = [&](int64_t slot) { return static_cast<ST*>(p.state) + (slot * p.Hv + h) * head_state + c0; };
  if (m.initial[i]) {
    const ST* src = state_tile(m.slots[i]);
    for (int64_t d = 0; d < Dk; ++d) {
      widen_row(S + d * kTile, src + d * Dv, cw);
      std::fill(S + d * kTile + cw, S + (d + 1) * kTile, 0.0f);
    }
  } else {
    std::fill(S, S + Dk * kTile, 0.0f);
  }
  auto save = [&](int64_t slot) {
    ST* dst = state_tile(slot);
    for (int64_t d = 0; d < Dk; ++d) convert_row(dst + d * Dv, S + d * kTile, cw);
  };
  // kv, qs: k_t.S and q_t.S of the state before token t's decay, two accumulators each to shorten the chains.
  vfloat kv[kTileVecs], qs[kTileVecs];
  if (e > a) {
    vfloat k0[kTileVecs] = {}, k1[kTileVecs] = {}, q0[kTileVecs] = {}, q1[kTileVecs] = {};
    const float* kr = p.kn + (a * p.Hk + kh) * Dk;
    const float* qr = p.qn + (a * p.Hk + kh) * Dk;
    int64_t d = 0;
    for (; d + 2 <= Dk; d += 2) {
      for (int u = 0; u < kTileVecs; ++u) {
        const vfloat s0 = vload(S + d * kTile + u * W), s1 = vload(S + (d + 1) * kTile + u * W);
        k0[u] += kr[d] * s0;
        q0[u] += qr[d] * s0;
        k1[u] += kr[d + 1] * s1;
        q1[u] += qr[d + 1] * s1;
      }
    }
    for (; d < Dk; ++d) {
      for (int u = 0; u < kTileVecs; ++u) {
        const vfloat s0 = vload(S + d * kTile + u * W);
        k0[u] += kr[d] * s0;
        q0[u] += qr[d] * s0;
      }
    }
    for (int u = 0; u < kTileVecs; ++u) {
      kv[u] = k0[u] + k1[u];
      qs[u] = q0[u] + q1[u];
    }
  }
  int64_t cp = m.cp_begin[i];
  const int64_t cp_end = m.cp_begin[i + 1];
  alignas(64) float vin[kTile];
  for (int64_t t = a; t < e; ++t) {
    const float decay = std::exp(p.g[t * p.Hv + h]), b = p.beta[t * p.Hv + h], qk = p.qk[t * p.Hk + kh];
    const T* vr = v + (t * p.Hv + h) * Dv + c0;
    const bool whole = cw == kTile;  // a full tile moves its v and out rows as vectors
    if (!whole) {
      for (int64_t c = 0; c < kTile; ++c) vin[c] = c < cw ? to_float(vr[c]) : 0.0f;
    }
    vfloat delta[kTileVecs];
    T* orow = out + (t * p.Hv + h) * Dv + c0;
    for (int u = 0; u < kTileVecs; ++u) {
      delta[u] = ((whole ? load_kv(vr + u * W) : vload(vin + u * W)) - decay * kv[u]) * b;
      const vfloat o = decay * qs[u] + qk * delta[u];
      if (whole) {
        store_kv(orow + u * W, o);
      } else {
        for (int64_t c = u * W; c < std::min<int64_t>((u + 1) * W, cw); ++c) orow[c] = from_float<T>(o[c - u * W]);
      }
    }
    // S = S * decay + k_t delta^T, accumulating the next token's k.S and q.S on the way.
    const int64_t next = t + 1 < e ? t + 1 : t;
    const float* kr = p.kn + (t * p.Hk + kh) * Dk;
    const float* kx = p.kn + (next * p.Hk + kh) * Dk;
    const float* qx = p.qn + (next * p.Hk + kh) * Dk;
    vfloat k0[kTileVecs] = {}, k1[kTileVecs] = {}, q0[kTileVecs] = {}, q1[kTileVecs] = {};
    int64_t d = 0;
    for (; d + 2 <= Dk; d += 2) {
      for (int u = 0; u < kTileVecs; ++u) {
        float* p0 = S + d * kTile + u * W;
        float* p1 = p0 + kTile;
        const vfloat s0 = vload(p0) * decay + kr[d] * delta[u];
        const vfloat s1 = vload(p1) * decay + kr[d + 1] * delta[u];
        vstore(p0, s0);
        vstore(p1, s1);
        k0[u] += kx[d] * s0;
        q0[u] += qx[d] * s0;
        k1[u] += kx[d + 1] * s1;
        q1[u] += qx[d + 1] * s1;
      }
    }
    for (; d < Dk; ++d) {
      for (int u = 0; u < kTileVecs; ++u) {
        float* p0 = S + d * kTile + u * W;
        const vfloat s0 = vload(p0) * decay + kr[d] * delta[u];
        vstore(p0, s0);
        k0[u] += kx[d] * s0;
        q0[u] += qx[d] * s0;
      }
    }
    for (int u = 0; u < kTileVecs; ++u) {
      kv[u] = k0[u] + k1[u];
      qs[u] = q0[u] + q1[u];
    }
    for (; cp < cp_end && m.cps[3 * cp + 1] == t + 1 - a; ++cp) save(m.cps[3 * cp + 2]);
  }
  save(m.slots[i]);
}

// A one-token sequence's head, in place in its state slot: the columns in chunks of kDecodeVecs
// vectors (two cache lines a row), each chunk read from memory once (k.S and q.S), then updated
// while still in L1. Checkpoints at its token copy the head.
template <typename T, typename ST>
void gdr_decode_head(const GdrArgs& p, const T* v, T* out, const SeqMeta& m, int64_t i, int64_t h) {
  constexpr int kVecs = kDecodeVecs, kChunk = kVecs * W;
  const int64_t Dk = p.Dk, Dv = p.Dv, t = m.starts[i], kh = h / p.group, head_state = Dk * Dv;
  ST* const state = static_cast<ST*>(p.state);
  ST* S = state + (m.slots[i] * p.Hv + h) * head_state;
  const float decay = std::exp(p.g[t * p.Hv + h]), b = p.beta[t * p.Hv + h], qk = p.qk[t * p.Hk + kh];
  const float* kr = p.kn + (t * p.Hk + kh) * Dk;
  const float* qr = p.qn + (t * p.Hk + kh) * Dk;
  const T* vr = v + (t * p.Hv + h) * Dv;
  T* orow = out + (t * p.Hv + h) * Dv;
  const bool initial = m.initial[i];
  alignas(64) float vin[kChunk], ov[kChunk];
  for (int64_t c0 = 0; c0 < Dv; c0 += kChunk) {
    const int64_t cw = std::min<int64_t>(kChunk, Dv - c0);
    for (int c = 0; c < kChunk; ++c) vin[c] = c < cw ? to_float(vr[c0 + c]) : 0.0f;
    vfloat kv[kVecs] = {}, qs[kVecs] = {};
    if (initial && cw == kChunk) {
      for (int64_t d = 0; d < Dk; ++d) {
        const ST* row = S + d * Dv + c0;
        for (int u = 0; u < kVecs; ++u) {
          const vfloat sv = load_kv(row + u * W);
          kv[u] += kr[d] * sv;
          qs[u] += qr[d] * sv;
        }
      }
    } else if (initial) {
      alignas(64) float ks[kChunk] = {}, qv[kChunk] = {};
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t c = 0; c < cw; ++c) {
          const float sv = to_float(S[d * Dv + c0 + c]);
          ks[c] += kr[d] * sv;
          qv[c] += qr[d] * sv;
        }
      for (int u = 0; u < kVecs; ++u) kv[u] = vload(ks + u * W), qs[u] = vload(qv + u * W);
    }
    vfloat delta[kVecs];
    for (int u = 0; u < kVecs; ++u) {
      delta[u] = (vload(vin + u * W) - decay * kv[u]) * b;
      vstore(ov + u * W, decay * qs[u] + qk * delta[u]);
    }
    for (int64_t c = 0; c < cw; ++c) orow[c0 + c] = from_float<T>(ov[c]);
    if (cw == kChunk) {  // no initial state: S starts at zero
      for (int64_t d = 0; d < Dk; ++d) {
        ST* row = S + d * Dv + c0;
        for (int u = 0; u < kVecs; ++u) {
          const vfloat prev = initial ? load_kv(row + u * W) : vfloat{};
          store_kv(row + u * W, prev * decay + kr[d] * delta[u]);
        }
      }
    } else {
      alignas(64) float dl[kChunk];
      for (int u = 0; u < kVecs; ++u) vstore(dl + u * W, delta[u]);
      for (int64_t d = 0; d < Dk; ++d)
        for (int64_t c = 0; c < cw; ++c) {
          ST& x = S[d * Dv + c0 + c];
          x = from_float<ST>((initial ? to_float(x) * decay : 0.0f) + kr[d] * dl[c]);
        }
    }
  }
  for (int64_t cp = m.cp_begin[i]; cp < m.cp_begin[i + 1]; ++cp)
    std::memcpy(state + (m.cps[3 * cp + 2] * p.Hv + h) * head_state, S, sizeof(ST) * head_state);
}

void gated_delta_rule(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& g, const at::Tensor& beta, at::Tensor& state, const at::Tensor& query_start_loc,
                      const at::Tensor& slot_ids, const at::Tensor& has_initial_state, const at::Tensor& checkpoints,
                      double scale, bool use_qk_l2norm) {
  const char* op = "gated_delta_rule";
  for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->is_contiguous() && t->device().is_cpu() &&
                          (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                      op, ": q, k, v and out must be contiguous 3-D float32 or bfloat16 CPU tensors");
  }
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK_VALUE(k.sizes() == q.sizes() && k.scalar_type() == q.scalar_type(), op,
                    ": k must be shaped and typed like q");
  TORCH_CHECK_VALUE(v.size(0) == T && Hk > 0 && Hv % Hk == 0, op,
                    ": v must be [T, Hv, Dv] with Hv a multiple of q's heads");
  TORCH_CHECK_VALUE(out.sizes() == v.sizes() && out.scalar_type() == v.scalar_type(), op,
                    ": out must be shaped and typed like v");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&g, &beta}) {
    TORCH_CHECK_VALUE(
        t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T && t->size(1) == Hv,
        op, ": g and beta must be contiguous float32 [T, Hv] tensors");
  }
  TORCH_CHECK_VALUE((state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16) &&
                        state.is_contiguous() && state.dim() == 4 && state.size(1) == Hv && state.size(2) == Dk &&
                        state.size(3) == Dv,
                    op, ": state must be a contiguous float32 or bfloat16 [S, Hv, Dk, Dv] tensor");
  const SeqMeta m = read_meta(query_start_loc, slot_ids, has_initial_state, checkpoints, T, state.size(0), op);

  at::Tensor qn = at::empty({T, Hk, Dk}, q.options().dtype(at::kFloat));
  at::Tensor kn = at::empty({T, Hk, Dk}, q.options().dtype(at::kFloat));
  at::Tensor qk = at::empty({T, Hk}, q.options().dtype(at::kFloat));
  dispatch_float_bf16(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    prepare_qk<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), qn.data_ptr<float>(), kn.data_ptr<float>(),
                         qk.data_ptr<float>(), T * Hk, Dk, static_cast<float>(scale), use_qk_l2norm,
                         T * Hk * Dk >= kParallelMin);
  });
  const GdrArgs p{qn.data_ptr<float>(),
                  kn.data_ptr<float>(),
                  qk.data_ptr<float>(),
                  g.data_ptr<float>(),
                  beta.data_ptr<float>(),
                  state.data_ptr(),
                  Hk,
                  Hv,
                  Dk,
                  Dv,
                  Hv / Hk};
  const int64_t tiles = (Dv + kTile - 1) / kTile;
  int64_t work = 0;  // state elements touched, one pass per token
  for (int64_t i = 0; i < m.num_seqs; ++i) work += std::max<int64_t>(1, m.starts[i + 1] - m.starts[i]) * Hv * Dk * Dv;
  // Longest sequences first, so that the dynamic schedule does not end on one long item.
  std::vector<int64_t> order(m.num_seqs);
  for (int64_t i = 0; i < m.num_seqs; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return m.starts[x + 1] - m.starts[x] > m.starts[y + 1] - m.starts[y]; });
  // A work item: (sequence, head, tile), or for a one-token sequence (a decode, bound by reading its
  // state from memory) the whole head in place (tile kWholeHead).
  constexpr int64_t kWholeHead = -1;
  struct Item {
    int64_t seq, head, tile;
  };
  std::vector<Item> work_items;
  for (int64_t i : order) {
    const bool decode = m.starts[i + 1] - m.starts[i] == 1;
    for (int64_t h = 0; h < Hv; ++h) {
      if (decode) {
        work_items.push_back({i, h, kWholeHead});
      } else {
        for (int64_t c = 0; c < tiles; ++c) work_items.push_back({i, h, c});
      }
    }
  }
  const int64_t items = static_cast<int64_t>(work_items.size());
  const bool parallel = work >= kParallelMin && items > 1;
  dispatch_float_bf16(v.scalar_type(), [&](auto tag) {
    dispatch_float_bf16(state.scalar_type(), [&](auto state_tag) {
      using scalar_t = decltype(tag);
      using state_t = decltype(state_tag);
      const scalar_t* vp = v.data_ptr<scalar_t>();
      scalar_t* op_ = out.data_ptr<scalar_t>();
#pragma omp parallel if (parallel)
      {
        std::vector<float> buf(Dk * kTile + 16);
        float* S = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
          const Item& it = work_items[item];
          if (it.tile == kWholeHead) {
            gdr_decode_head<scalar_t, state_t>(p, vp, op_, m, it.seq, it.head);
          } else {
            gdr_tile<scalar_t, state_t>(p, vp, op_, m, it.seq, it.head, it.tile * kTile, S);
          }
        }
      }
    });
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_recurrent, m) {
  m.def(
      "causal_conv1d(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, Tensor(b!) conv_state, Tensor "
      "query_start_loc, "
      "Tensor slot_ids, Tensor has_initial_state, Tensor checkpoints, bool silu) -> ()");
  m.def(
      "gated_delta_rule(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(b!) state, "
      "Tensor query_start_loc, Tensor slot_ids, Tensor has_initial_state, Tensor checkpoints, float scale, "
      "bool use_qk_l2norm) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_recurrent, CPU, m) {
  m.impl("causal_conv1d", &pagellm::causal_conv1d);
  m.impl("gated_delta_rule", &pagellm::gated_delta_rule);
}
