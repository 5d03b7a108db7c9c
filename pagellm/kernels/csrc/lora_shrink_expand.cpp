// Batched multi-LoRA (Punica's shrink and expand): for each segment s of rows [a, b) with pool
// slot k >= 0, y[a:b] += (x[a:b] A[k]^T) B[k]^T, with A [slots, rank, in] and B [slots, out, rank]
// float32 or bfloat16 (sums in float32).
//
// A decode batch has one row per adapter, so the cost is streaming every used slot's A and B once:
// rows are grouped by slot (adjacent or not), each group's rows share one pass over its weights,
// and the two passes (shrink: t = x A^T, expand: y += t B^T) are split into tasks of (group, a few
// rank rows) and (group, a chunk of outputs) that the threads take as they come free.
//
// Expand dots each output's B row (rank contiguous values) with t. A vector holds W values, so a
// block of W outputs is W x rank values; their W sums are folded together with two-input shuffles
// (each step halves the width over which a vector's lanes still belong to one output and merges
// two vectors), ending in one vector of W sums rather than W horizontal sums. A rank below W that
// divides it starts with several outputs per vector; any other rank takes a scalar loop.
//
// A long run of rows of one slot (a prefill chunk) is a real matrix product: at and past
// `aten_min_rows` rows it goes to ATen's (BLAS) matmul instead, per run.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "parallel_panels.h"
#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PAGELLM_INLINE inline __attribute__((always_inline))

namespace pagellm {
namespace {

typedef uint16_t vbf16_u __attribute__((vector_size(W * 2), aligned(2)));
typedef uint32_t vuint __attribute__((vector_size(W * 4)));

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
PAGELLM_INLINE vfloat vload_weight(const float* p) { return vload(p); }
// bfloat16 is the top half of a float32: widen and shift. Spelled out for x86, where GCC's generic
// conversion widens in 128-bit pieces and reinserts them (decode ran at half float32's weights/s).
PAGELLM_INLINE vfloat vload_weight(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  const vuint wide = __builtin_convertvector(*reinterpret_cast<const vbf16_u*>(p), vuint);
  return (vfloat)(wide << 16);
#endif
}

constexpr int kShrinkRanks = 4;                 // rank rows of A per shrink tile (and per task)
constexpr int kShrinkRows = 4;                  // rows of x per shrink tile
constexpr int64_t kExpandTaskBytes = 32 << 10;  // B bytes per expand task: stays in L1/L2 across a group's rows

// t[r][j0 + j] = A[j0 + j] . x[rows[r]] for J rank rows and R rows.
template <int J, int R, typename T>
void shrink_tile(const T* a, int64_t in, const float* x, const int64_t* rows, float* t, int64_t ldt) {
  vfloat acc[J][R];
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + rows[r] * in;
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = vfloat{};
  int64_t k = 0;
  for (; k + W <= in; k += W) {
    vfloat xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vload(xr[r] + k);
    for (int j = 0; j < J; ++j) {
      const vfloat av = vload_weight(a + j * in + k);
      for (int r = 0; r < R; ++r) acc[j][r] += av * xv[r];
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int r = 0; r < R; ++r) {
      float sum = hsum(acc[j][r]);
      for (int64_t i = k; i < in; ++i) sum += to_float(a[j * in + i]) * xr[r][i];
      t[r * ldt + j] = sum;
    }
  }
}

template <int J, typename T>
void shrink_rows(const T* a, int64_t in, const float* x, const int64_t* rows, int64_t num_rows, float* t, int64_t ldt) {
  int64_t r = 0;
  for (; r + kShrinkRows <= num_rows; r += kShrinkRows)
    shrink_tile<J, kShrinkRows>(a, in, x, rows + r, t + r * ldt, ldt);
  switch (num_rows - r) {
    case 3: shrink_tile<J, 3>(a, in, x, rows + r, t + r * ldt, ldt); break;
    case 2: shrink_tile<J, 2>(a, in, x, rows + r, t + r * ldt, ldt); break;
    case 1: shrink_tile<J, 1>(a, in, x, rows + r, t + r * ldt, ldt); break;
    default: break;
  }
}

// One fold step at chunk width c: lanes [0, c/2) of each chunk take a's chunk halves summed, lanes
// [c/2, c) b's, so the result has chunks of width c/2 alternating between a's and b's outputs.
template <int c>
PAGELLM_INLINE vfloat fold_pair(vfloat a, vfloat b) {
  constexpr vint first = make_mask([](int l) { return l % c < c / 2 ? l : W + l; });
  constexpr vint second = make_mask([](int l) { return l % c < c / 2 ? l + c / 2 : W + l - c / 2; });
  return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

// c vectors whose lanes come in chunks of width c, each chunk one output's partial products ->
// one vector of the sums, in fold order.
template <int c>
PAGELLM_INLINE vfloat fold(vfloat* v) {
  if constexpr (c == 1) {
    return v[0];
  } else {
#pragma GCC unroll 16
    for (int j = 0; j < c / 2; ++j) v[j] = fold_pair<c>(v[2 * j], v[2 * j + 1]);
    return fold<c / 2>(v);
  }
}

constexpr int bit_reverse(int value, int bits) {
  int out = 0;
  for (int b = 0; b < bits; ++b) out |= ((value >> b) & 1) << (bits - 1 - b);
  return out;
}
constexpr int log2_int(int value) { return value <= 1 ? 0 : 1 + log2_int(value / 2); }

// Output o of a block starts in vector o / (W / C), chunk o % (W / C); fold leaves it in lane
// chunk * C + bit_reverse(vector): this mask puts every output back in its own lane.
template <int C>
PAGELLM_INLINE vfloat unfold_order(vfloat v) {
  constexpr vint mask = make_mask([](int o) { return (o % (W / C)) * C + bit_reverse(o / (W / C), log2_int(C)); });
  if constexpr (C == 1) {
    return v;
  } else {
    return __builtin_shuffle(v, mask);
  }
}

// y[o0 + l] += B[o0 + l] . t for the W outputs of a block, B's rows `rank` values long. C = W when
// rank is a multiple of W (each output's values summed down to one vector first); C = rank below
// W (t_tiled holds t repeated W / rank times, and each vector covers W / rank outputs). A
// compile-time Rank (0: rank) turns the W row offsets into constant displacements.
template <int C, int Rank, typename T>
PAGELLM_INLINE void expand_block(const T* b, int64_t runtime_rank, const float* t, vfloat t_tiled, float* y) {
  const int64_t rank = Rank > 0 ? Rank : runtime_rank;
  vfloat v[C];
  if constexpr (C == W) {
    // Outputs inner: W independent sums, not one chain of dependent multiply-adds per output.
    const vfloat t0 = vload(t);
#pragma GCC unroll 16
    for (int o = 0; o < W; ++o) v[o] = vload_weight(b + o * rank) * t0;
    for (int64_t q = W; q < rank; q += W) {
      const vfloat tq = vload(t + q);
#pragma GCC unroll 16
      for (int o = 0; o < W; ++o) v[o] += vload_weight(b + o * rank + q) * tq;
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) v[i] = vload_weight(b + i * W) * t_tiled;
  }
  vstore(y, vload(y) + unfold_order<C>(fold<C>(v)));
}

template <typename T>
inline void expand_scalar(const T* b, int64_t rank, const float* t, int64_t count, float* y) {
  for (int64_t o = 0; o < count; ++o) {
    float sum = 0.f;
    for (int64_t r = 0; r < rank; ++r) sum += to_float(b[o * rank + r]) * t[r];
    y[o] += sum;
  }
}

// Outputs [begin, end) of every row of a group, `b` at output `begin`'s row: rows outer, so the
// chunk of B read from memory for the first row is in cache for the others.
template <int C, int Rank, typename T>
void expand_rows(const T* b, int64_t rank, const float* t, int64_t ldt, const int64_t* rows, int64_t num_rows, float* y,
                 int64_t ldy, int64_t out, int64_t begin, int64_t end) {
  const int64_t vector_end = C == 0 ? begin : begin + (std::min(end, out) - begin) / W * W;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* tr = t + r * ldt;
    float* yr = y + rows[r] * ldy;
    if constexpr (C > 0) {
      float tiled[W];
      for (int l = 0; l < W; ++l) tiled[l] = tr[l % rank];
      const vfloat t_tiled = vload(tiled);
      for (int64_t o = begin; o < vector_end; o += W)
        expand_block<C, Rank>(b + (o - begin) * rank, rank, tr, t_tiled, yr + o);
    }
    expand_scalar(b + (vector_end - begin) * rank, rank, tr, end - vector_end, yr + vector_end);
  }
}

template <typename T>
using ExpandRows = void (*)(const T*, int64_t, const float*, int64_t, const int64_t*, int64_t, float*, int64_t, int64_t,
                            int64_t, int64_t);

// A rank below W that divides it; expand_rows<C> is not instantiated where C >= W.
template <int C, typename T>
ExpandRows<T> expand_below_width() {
  if constexpr (C < W) {
    return &expand_rows<C, C, T>;
  } else {
    return &expand_rows<0, 0, T>;
  }
}

// C for a rank: W for multiples of W, the rank itself for a power of two below W, 0 (scalar) otherwise.
template <typename T>
ExpandRows<T> expand_for_rank(int64_t rank) {
  if (rank % W == 0) {
    switch (rank / W) {
      case 1: return &expand_rows<W, W, T>;
      case 2: return &expand_rows<W, 2 * W, T>;
      case 4: return &expand_rows<W, 4 * W, T>;
      case 8: return &expand_rows<W, 8 * W, T>;
      default: return &expand_rows<W, 0, T>;
    }
  }
  switch (rank) {
    case 1: return &expand_rows<1, 1, T>;
    case 2: return expand_below_width<2, T>();
    case 4: return expand_below_width<4, T>();
    case 8: return expand_below_width<8, T>();
    default: return &expand_rows<0, 0, T>;
  }
}

// The rows of one slot that the native passes take: rows[first, first + count) of the flat list.
struct SlotGroup {
  int64_t slot;
  int64_t first;
  int64_t count;
};

struct Task {
  int64_t group;
  int64_t begin;  // rank row (shrink) or output (expand)
  int64_t end;
};

// A bfloat16 chunk of weights as float32, for a group of several rows: converted once rather than
// once per row.
inline const float* widened(const uint16_t* src, int64_t count, std::vector<float>& dst) {
  dst.resize(count);
  int64_t i = 0;
  for (; i + W <= count; i += W) vstore(dst.data() + i, vload_weight(src + i));
  for (; i < count; ++i) dst[i] = to_float(src[i]);
  return dst.data();
}

template <typename T>
void shrink_task(const T* a, int64_t num_ranks, int64_t in, const float* x, const int64_t* rows, int64_t num_rows,
                 float* t, int64_t ldt) {
  switch (num_ranks) {
    case 4: shrink_rows<4>(a, in, x, rows, num_rows, t, ldt); break;
    case 3: shrink_rows<3>(a, in, x, rows, num_rows, t, ldt); break;
    case 2: shrink_rows<2>(a, in, x, rows, num_rows, t, ldt); break;
    default: shrink_rows<1>(a, in, x, rows, num_rows, t, ldt); break;
  }
}

template <typename T>
void run_native(at::Tensor& y, const at::Tensor& x, const T* a_pool, const T* b_pool, int64_t rank, int64_t in,
                int64_t out, const std::vector<SlotGroup>& groups, const std::vector<int64_t>& rows) {
  constexpr bool kWiden = std::is_same_v<T, uint16_t>;
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  if (num_rows == 0) return;
  const int64_t ldt = rank;
  std::vector<float> t(num_rows * ldt);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = y.stride(0);  // y may be a column slice of a wider product (a fused layer's shard)

  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t j = 0; j < rank; j += kShrinkRanks) tasks.push_back({g, j, std::min(rank, j + kShrinkRanks)});
  parallel_panels(static_cast<int64_t>(tasks.size()), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const SlotGroup& group = groups[task.group];
      const T* a = a_pool + (group.slot * rank + task.begin) * in;
      float* tg = t.data() + group.first * ldt + task.begin;
      const int64_t* group_rows = rows.data() + group.first;
      const int64_t num_ranks = task.end - task.begin;
      if (kWiden && group.count > 1) {
        shrink_task(widened(reinterpret_cast<const uint16_t*>(a), num_ranks * in, scratch), num_ranks, in, xp,
                    group_rows, group.count, tg, ldt);
      } else {
        shrink_task(a, num_ranks, in, xp, group_rows, group.count, tg, ldt);
      }
    }
  });

  const int64_t elem = static_cast<int64_t>(sizeof(T));
  const int64_t outputs_per_task = std::max<int64_t>(W, kExpandTaskBytes / (rank * elem) / W * W);
  tasks.clear();
  for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
    for (int64_t o = 0; o < out; o += outputs_per_task) tasks.push_back({g, o, std::min(out, o + outputs_per_task)});
  const ExpandRows<T> expand = expand_for_rank<T>(rank);
  const ExpandRows<float> expand_widened = expand_for_rank<float>(rank);
  parallel_panels(static_cast<int64_t>(tasks.size()), [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const SlotGroup& group = groups[task.group];
      const T* b = b_pool + (group.slot * out + task.begin) * rank;
      const float* tg = t.data() + group.first * ldt;
      const int64_t* group_rows = rows.data() + group.first;
      if (kWiden && group.count > 1) {
        const float* wide = widened(reinterpret_cast<const uint16_t*>(b), (task.end - task.begin) * rank, scratch);
        expand_widened(wide, rank, tg, ldt, group_rows, group.count, yp, ldy, out, task.begin, task.end);
      } else {
        expand(b, rank, tg, ldt, group_rows, group.count, yp, ldy, out, task.begin, task.end);
      }
    }
  });
}

void check_inputs(const at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                  const at::Tensor& seg_starts, const at::Tensor& seg_slots) {
  for (const at::Tensor* tensor : {&y, &x, &lora_a, &lora_b, &seg_starts, &seg_slots})
    TORCH_CHECK_VALUE(tensor->device().is_cpu(), "lora_shrink_expand: every tensor must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "lora_shrink_expand: x must be a contiguous float32 [num_tokens, in_features] tensor");
  TORCH_CHECK_VALUE(
      y.dim() == 2 && y.scalar_type() == at::kFloat && y.stride(1) == 1 && y.stride(0) >= y.size(1) &&
          y.size(0) == x.size(0),
      "lora_shrink_expand: y must be a float32 [num_tokens, out_features] tensor with contiguous rows and x's rows");
  TORCH_CHECK_VALUE(lora_a.scalar_type() == lora_b.scalar_type() &&
                        (lora_a.scalar_type() == at::kFloat || lora_a.scalar_type() == at::kBFloat16),
                    "lora_shrink_expand: lora_a and lora_b must both be float32 or both bfloat16");
  TORCH_CHECK_VALUE(lora_a.is_contiguous() && lora_b.is_contiguous(),
                    "lora_shrink_expand: lora_a and lora_b must be contiguous");
  TORCH_CHECK_VALUE(lora_a.dim() == 3 && lora_a.size(2) == x.size(1),
                    "lora_shrink_expand: lora_a must be [num_slots, max_rank, in_features] with x's in_features");
  TORCH_CHECK_VALUE(lora_b.dim() == 3 && lora_b.size(0) == lora_a.size(0) && lora_b.size(1) == y.size(1) &&
                        lora_b.size(2) == lora_a.size(1),
                    "lora_shrink_expand: lora_b must be [num_slots, out_features, max_rank] matching lora_a and y");
  TORCH_CHECK_VALUE(seg_starts.scalar_type() == at::kLong && seg_starts.dim() == 1 && seg_starts.is_contiguous() &&
                        seg_starts.numel() >= 1,
                    "lora_shrink_expand: seg_starts must be a contiguous int64 [num_segments + 1] tensor");
  TORCH_CHECK_VALUE(seg_slots.scalar_type() == at::kLong && seg_slots.dim() == 1 && seg_slots.is_contiguous() &&
                        seg_slots.numel() == seg_starts.numel() - 1,
                    "lora_shrink_expand: seg_slots must be a contiguous int64 [num_segments] tensor");
}

void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                        const at::Tensor& seg_starts, const at::Tensor& seg_slots, int64_t aten_min_rows) {
  check_inputs(y, x, lora_a, lora_b, seg_starts, seg_slots);
  const int64_t num_tokens = x.size(0), num_slots = lora_a.size(0), rank = lora_a.size(1);
  const int64_t num_segments = seg_slots.numel();
  const int64_t* starts = seg_starts.data_ptr<int64_t>();
  const int64_t* slots = seg_slots.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(starts[0] >= 0 && starts[num_segments] <= num_tokens,
                    "lora_shrink_expand: seg_starts must lie in [0, ", num_tokens, "]");
  for (int64_t s = 0; s < num_segments; ++s) {
    TORCH_CHECK_VALUE(starts[s] <= starts[s + 1], "lora_shrink_expand: seg_starts must be ascending");
    TORCH_CHECK_VALUE(slots[s] >= -1 && slots[s] < num_slots, "lora_shrink_expand: seg_slots[", s, "] = ", slots[s],
                      " is not -1 or a slot of the pool of ", num_slots);
  }
  if (rank == 0 || x.size(1) == 0 || y.size(1) == 0) return;

  // Runs of adjacent segments with one slot; long ones go to ATen, the others' rows are grouped by slot.
  std::vector<int64_t> group_of_slot(num_slots, -1);
  std::vector<SlotGroup> groups;
  std::vector<std::array<int64_t, 3>> runs;  // (slot, begin, end)
  for (int64_t s = 0; s < num_segments; ++s) {
    if (slots[s] < 0 || starts[s] == starts[s + 1]) continue;
    if (!runs.empty() && runs.back()[0] == slots[s] && runs.back()[2] == starts[s]) {
      runs.back()[2] = starts[s + 1];
    } else {
      runs.push_back({slots[s], starts[s], starts[s + 1]});
    }
  }
  for (const auto& run : runs) {
    if (run[2] - run[1] >= aten_min_rows) {
      const at::Tensor a = lora_a[run[0]].to(at::kFloat), b = lora_b[run[0]].to(at::kFloat);
      y.narrow(0, run[1], run[2] - run[1]).addmm_(x.narrow(0, run[1], run[2] - run[1]).mm(a.t()), b.t());
      continue;
    }
    int64_t& g = group_of_slot[run[0]];
    if (g < 0) {
      g = static_cast<int64_t>(groups.size());
      groups.push_back({run[0], 0, 0});
    }
    groups[g].count += run[2] - run[1];
  }
  int64_t total = 0;
  for (SlotGroup& group : groups) {
    group.first = total;
    total += group.count;
    group.count = 0;
  }
  std::vector<int64_t> rows(total);
  for (const auto& run : runs) {
    if (run[2] - run[1] >= aten_min_rows) continue;
    SlotGroup& group = groups[group_of_slot[run[0]]];
    for (int64_t r = run[1]; r < run[2]; ++r) rows[group.first + group.count++] = r;
  }
  const int64_t in = x.size(1), out = y.size(1);
  if (lora_a.scalar_type() == at::kFloat) {
    run_native<float>(y, x, lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), rank, in, out, groups, rows);
  } else {
    run_native<uint16_t>(y, x, reinterpret_cast<const uint16_t*>(lora_a.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(lora_b.data_ptr<at::BFloat16>()), rank, in, out, groups,
                         rows);
  }
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_lora, m) {
  m.def(
      "lora_shrink_expand(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor seg_starts, Tensor seg_slots, "
      "int "
      "aten_min_rows) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_lora, CPU, m) { m.impl("lora_shrink_expand", &pagellm::lora_shrink_expand); }
