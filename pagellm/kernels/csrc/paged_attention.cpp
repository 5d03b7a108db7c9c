// Paged attention for CPUs: reads each sequence's keys and values in place from the paged
// cache (no padded copy), float32 math, online softmax, GQA-aware (all query heads of one
// kv head are processed together so every K/V row is read once per tile).
//
// Two kernels:
//   * decode (a sequence with one new token): work item = (sequence, up to 4 kv heads, head
//     chunk, context partition); the g query heads of each kv head are dotted against each key
//     row as it streams by. Short batches of long contexts are split along the context
//     (flash-decoding, one kv head per item) and merged.
//   * prefill (a sequence with several new tokens): work item = (sequence, kv head, head chunk,
//     query tile).  A tile holds ~64 (token, head) query rows, stored transposed so that
//     scores, masking and the softmax update are vectorised across rows; keys stream in
//     chunks of kKeyChunk. Too few tiles of long contexts (a verification) are split along
//     the keys and merged, as decode is.
// The cache holds float32, float16, bfloat16, fp8 (e4m3 / e5m2, one scale per layer) or int8
// (a float16 scale per head row, stored after the row's values) (kv_types.h); every kernel is a
// template over that element type and widens rows to float32 as it reads them. Scales are folded
// in rather than applied per element: the layer's key scale into the query, its value scale into
// the output, an int8 row's scale into that key's score and that value's weight.
// Vector helpers (vec.h) are GCC vector extensions: one source for AVX-512, AVX2 or NEON.
//
// A layer's options (pagellm/attention/backend.py's AttentionOptions), each free when off:
//   * sliding window W: a query at position p sees keys p - W + 1 ... p. Decode items start at
//     the window; prefill tiles start at their first row's window and mask per row. No block
//     wholly before a sequence's first window start is read: the cache manager may have freed
//     (and reused) those blocks.
//   * logit soft cap c: each score s becomes c * tanh(s / c), before masking (Gemma 2).
//   * sinks: one extra logit per query head in the softmax's denominator, with no value
//     (gpt-oss): the running max and sum start from it instead of from -inf and 0.
// A token's row (its kv heads side by side) is found `token_stride` elements after the previous
// token's: num_kv_heads * head_stride for a contiguous cache, more for a layer whose rows sit in
// the first part of a wider layer's (Gemma 4's sliding layers in its full layers' tensor; see
// pagellm/worker/kv_cache.py), which is handed as a view with that token stride.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "kv_types.h"
#include "vec.h"

namespace pagellm {
namespace {

// One level of a transposing reduction. Inputs hold W / H segments of H partial sums each
// (one segment per key); the output holds twice as many keys, each in H / 2 lanes: a's keys
// first, then b's.
template <int H>
struct FoldMask {
  static constexpr vint make(int half) {
    return make_mask([half](int i) {
      constexpr int kNext = H / 2;
      constexpr int kSegsIn = W / H;
      const int seg = i / kNext, within = i % kNext;
      const int source = seg < kSegsIn ? 0 : W;
      return source + (seg % kSegsIn) * H + within + half * kNext;
    });
  }
};
template <int H>
inline void fold_level(vfloat* x) {
  if constexpr (H > 1) {
    constexpr vint lo = FoldMask<H>::make(0);
    constexpr vint hi = FoldMask<H>::make(1);
    for (int m = 0; m < H / 2; ++m)
      x[m] = __builtin_shuffle(x[2 * m], x[2 * m + 1], lo) + __builtin_shuffle(x[2 * m], x[2 * m + 1], hi);
    fold_level<H / 2>(x);
  }
}
// Given W vectors (clobbered), returns r with r[n] = sum of the lanes of x[n].
inline vfloat transpose_sum(vfloat* x) {
  fold_level<W>(x);
  return x[0];
}

// In-register W x W transpose by recursive block swaps: stage H exchanges the off-diagonal
// H x H blocks of each pair of rows (i, i + H).
template <int H>
struct SwapMask {
  static constexpr vint make(bool upper) {
    return make_mask([upper](int l) {
      if (!upper) return (l & H) ? W + l - H : l;
      return (l & H) ? W + l : l + H;
    });
  }
};
template <int H>
inline void transpose_stage(vfloat* x) {
  if constexpr (H >= 1) {
    constexpr vint lo = SwapMask<H>::make(false);
    constexpr vint hi = SwapMask<H>::make(true);
    for (int i = 0; i < W; ++i) {
      if (i & H) continue;
      const vfloat a = x[i], b = x[i + H];
      x[i] = __builtin_shuffle(a, b, lo);
      x[i + H] = __builtin_shuffle(a, b, hi);
    }
    transpose_stage<H / 2>(x);
  }
}
inline void transpose(vfloat* x) { transpose_stage<W / 2>(x); }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kDecodeChunk = 16;  // keys per decode step; a multiple of W
// Decode chunks prefetched ahead, and whether the values' prefetches go with the value loop
// rather than with the keys'. From memory, float32 attention waits on memory, so prefetching two
// chunks ahead, spread over both loops, pays; 16-bit caches convert every element and wait on
// arithmetic instead, where the extra instructions in the value loop cost more than they hide, so
// they keep one chunk with all prefetches in the key loop (docs/kernels.md).
template <typename T>
constexpr bool kMemoryBound = sizeof(T) == 4;
template <typename T>
constexpr int kPrefetchChunks = kMemoryBound<T> ? 2 : 1;
constexpr int kKeyChunk = 32;  // keys per prefill step
constexpr int kTileRows = 64;  // target (token, head) rows per prefill tile
constexpr int kMaxGroup = 8;   // query heads per kv head handled in one item
// The head sizes run() is instantiated for: the dispatch, the argument check and Python's
// ops.paged_attention_head_dims() all read this list.
constexpr int kHeadDims[] = {32, 64, 80, 96, 128, 256, 512};
constexpr int kMaxHeadDim = *std::max_element(std::begin(kHeadDims), std::end(kHeadDims));
constexpr int kMaxKvPerItem = 4;  // kv heads per decode item (whole rows up to this many heads)

// Where everything lives for one call.
struct Problem {
  const float* query;
  int64_t query_token_stride;
  float* out;
  const void* key_cache;  // element type: the T of the kernels below
  const void* value_cache;
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int head_stride;       // cache elements per (token, kv head) row: head_dim, plus an int8 row's scale
  int64_t token_stride;  // cache elements from one token's row to the next: num_kv_heads * head_stride, or more
  int block_size;
  float scale_log2;   // softmax scale * log2(e) * the keys' scale: scores live in the log2 domain
  float value_scale;  // the values' scale (fp8), applied to the output
  // Whether decode prefetches the next chunk into L2 only (prefetcht1) rather than into L1 as
  // well (prefetcht0). Which is faster depends on the core (the L1 fill buffers that prefetches
  // to L1 hold are few on some), so the caller measures both at start-up (kernels/tuning.py).
  bool prefetch_to_l2;
  int window;               // sliding window in tokens; 0: none
  float cap_log2;           // the soft cap in the scores' log2 units; 0: none
  const float* sinks_log2;  // [num_heads] sinks in log2 units, or nullptr
};

// The first key position sequence `seq`'s new tokens may see: 0, or its first new token's window
// start. Blocks wholly before it may have been freed.
inline int first_visible_key(const Problem& p, int seq) {
  if (p.window <= 0) return 0;
  const int q_len = p.query_start_loc[seq + 1] - p.query_start_loc[seq];
  return std::max(0, p.seq_lens[seq] - q_len - p.window + 1);
}

// tanh by Eigen's rational approximation for float (within a few ulp); +-1 past |x| = 7.9.
inline vfloat vtanh(vfloat x) {
  const vfloat limit = vsplat(7.90531110763549805f);
  x = x > limit ? limit : x;
  x = x < -limit ? -limit : x;
  const vfloat x2 = x * x;
  vfloat num = vsplat(-2.76076847742355e-16f);
  num = num * x2 + 2.00018790482477e-13f;
  num = num * x2 + -8.60467152213735e-11f;
  num = num * x2 + 5.12229709037114e-08f;
  num = num * x2 + 1.48572235717979e-05f;
  num = num * x2 + 6.37261928875436e-04f;
  num = num * x2 + 4.89352455891786e-03f;
  vfloat den = vsplat(1.19825839466702e-06f);
  den = den * x2 + 1.18534705686654e-04f;
  den = den * x2 + 2.26843463243900e-03f;
  den = den * x2 + 4.89352518554385e-03f;
  return x * num / den;
}

// cap * tanh(s / cap); scores are in log2 units, so is the cap (the same function of the true score).
inline vfloat soft_cap(vfloat s, float cap, float inv_cap) { return vsplat(cap) * vtanh(s * inv_cap); }

// One unit of parallel work.
struct Item {
  int seq;
  int kv_head;
  int head_begin;  // first query head (absolute)
  int num_group;   // query heads in this item (<= kMaxGroup)
  int begin;       // decode: first key position; prefill: first new-token index in the sequence
  int end;         // decode: last key position (exclusive); prefill: end new-token index
  int partial;     // index into the split partials, or -1 when the item writes output directly
  double cost;
  int num_kv = 1;  // decode: consecutive kv heads from kv_head, num_group query heads each
  // prefill, when split: the keys [key_begin, key_end) this part reads; -1: all the tile sees
  int key_begin = -1;
  int key_end = -1;
};

// Whether sequence `seq` adds one token this step (decode) rather than several (prefill).
inline bool is_decode(const Problem& p, int seq) { return p.query_start_loc[seq + 1] - p.query_start_loc[seq] == 1; }

// Points key_rows/value_rows at the rows of keys [pos, pos + n) for one kv head; rows past
// `context_len` point at a zero row so that masked-out keys never read stale cache memory.
template <typename T>
inline void locate_rows(const Problem& p, int seq, int kv_head, int pos, int n, int context_len, const T* zero_row,
                        const T** key_rows, const T** value_rows) {
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;
  int block_index = pos / p.block_size;
  int offset = pos - block_index * p.block_size;
  for (int i = 0; i < n; ++i) {
    if (pos + i < context_len) {
      const int64_t slot = static_cast<int64_t>(table[block_index]) * p.block_size + offset;
      const int64_t at = slot * p.token_stride + static_cast<int64_t>(kv_head) * p.head_stride;
      key_rows[i] = static_cast<const T*>(p.key_cache) + at;
      value_rows[i] = static_cast<const T*>(p.value_cache) + at;
    } else {
      key_rows[i] = zero_row;
      value_rows[i] = zero_row;
    }
    if (++offset == p.block_size) {
      offset = 0;
      ++block_index;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode: one new token; its query heads against keys [item.begin, item.end), for item.num_kv
// consecutive kv heads of G query heads each. Every key row holds all kv heads side by side
// (cache layout [block, token, kv head, dim]), so an item that covers them all reads each row
// whole: 768 contiguous bytes at SmolLM2's shapes instead of three 256-byte pieces 768 bytes
// apart, which the memory system serves at a fraction of the rate (docs/kernels.md).
// Writes normalised output, or (m, l, acc) partials for a later merge when split.
template <int D, int G>
struct DecodeState {
  vfloat q[G][D / W];
  vfloat acc[G][D / W];
  vfloat l[G];  // lane-wise partial sums of the softmax denominator
  float m[G];
};

// Prefetches one head's part of a cache row (into L2 only with `to_l2`).
template <int D, typename T>
inline void prefetch_head_row(const T* row, bool to_l2) {
  constexpr int kLine = 64 / static_cast<int>(sizeof(T));  // elements per cache line
  for (int line = 0; line < D + kRowExtra<T>; line += kLine) {
    if (to_l2) {  // the same every call: a predicted branch, not worth a template
      __builtin_prefetch(row + line, 0, 2);
    } else {
      __builtin_prefetch(row + line, 0, 3);
    }
  }
}

// Sums per query head, about 8 registers' worth over the G heads: independent chains in a key's
// dot product, and output vectors per pass over a chunk's value rows (kept in registers). One
// chain per head, or sums kept in memory, leave the FMA units waiting on latency or on stores.
template <int G>
constexpr int kSumsPerHead = G <= 2   ? 4
                             : G <= 4 ? 2
                                      : 1;

// st.acc[j][v0, v0 + B) += sum over the chunk's keys n of prob[j][n] * value n's vectors there.
// `ahead` (or null): rows whose part for this head is prefetched, one per key.
template <int D, int G, int B, typename T>
inline void accumulate_values(DecodeState<D, G>& st, const T* const* value_rows, int head_offset, int n_keys,
                              const float (&prob)[G][kDecodeChunk], int v0, const T* const* ahead, bool to_l2) {
  vfloat a[G][B];
  for (int j = 0; j < G; ++j)
    for (int b = 0; b < B; ++b) a[j][b] = st.acc[j][v0 + b];
  for (int n = 0; n < n_keys; ++n) {
    if (ahead != nullptr) prefetch_head_row<D, T>(ahead[n] + head_offset, to_l2);
    const T* vrow = value_rows[n] + head_offset + v0 * W;
    vfloat vr[B];
    for (int b = 0; b < B; ++b) vr[b] = load_kv(vrow + b * W);
    for (int j = 0; j < G; ++j) {
      const vfloat pj = vsplat(prob[j][n]);
      for (int b = 0; b < B; ++b) a[j][b] += pj * vr[b];
    }
  }
  for (int j = 0; j < G; ++j)
    for (int b = 0; b < B; ++b) st.acc[j][v0 + b] = a[j][b];
}

// One chunk of keys for one kv head (`head_offset` elements into each row). `ahead_keys` and
// `ahead_values`, when given, are the rows kPrefetchChunks<T> chunks ahead: this head's part of
// each is prefetched (into L2 only with `to_l2`) one key at a time as the current rows are
// consumed, keys with the keys and, for float32, values with the values: issued as one burst
// per chunk, the prefetches overflow the core's queue of outstanding misses.
template <int D, int G, typename T>
inline void decode_chunk(DecodeState<D, G>& st, const T* const* key_rows, const T* const* value_rows, int head_offset,
                         int n_keys, const T* const* ahead_keys, const T* const* ahead_values, bool to_l2,
                         float cap_log2) {
  constexpr int NV = D / W;
  constexpr int KV = kDecodeChunk / W;  // score vectors per chunk
  constexpr int C = std::min(kSumsPerHead<G>, NV);
  constexpr int kDotMain = NV / C * C;
  vint lane{};
  for (int i = 0; i < W; ++i) lane[i] = i;
  vfloat scores[G][KV];
  for (int kv = 0; kv < KV; ++kv) {
    vfloat part[G][W];
    vfloat key_scales = vsplat(1.f);
    for (int n = 0; n < W; ++n) {
      if (ahead_keys != nullptr) {
        prefetch_head_row<D, T>(ahead_keys[kv * W + n] + head_offset, to_l2);
        if constexpr (!kMemoryBound<T>) prefetch_head_row<D, T>(ahead_values[kv * W + n] + head_offset, to_l2);
      }
      const T* k = key_rows[kv * W + n] + head_offset;
      if constexpr (kRowScaled<T>) key_scales[n] = row_scale<D>(k);
      vfloat s[G][C];
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < C; ++c) s[j][c] = vfloat{};
      for (int v0 = 0; v0 < kDotMain; v0 += C) {
        for (int c = 0; c < C; ++c) {
          const vfloat kr = load_kv(k + (v0 + c) * W);
          for (int j = 0; j < G; ++j) s[j][c] += st.q[j][v0 + c] * kr;
        }
      }
      for (int v = kDotMain; v < NV; ++v) {
        const vfloat kr = load_kv(k + v * W);
        for (int j = 0; j < G; ++j) s[j][0] += st.q[j][v] * kr;
      }
      for (int j = 0; j < G; ++j) {
        vfloat sum = s[j][0];
        for (int c = 1; c < C; ++c) sum += s[j][c];
        part[j][n] = sum;
      }
    }
    const vint valid = lane < (n_keys - kv * W);
    for (int j = 0; j < G; ++j) {
      vfloat sum = transpose_sum(part[j]);
      if constexpr (kRowScaled<T>) sum *= key_scales;
      if (cap_log2 > 0.f) sum = soft_cap(sum, cap_log2, 1.f / cap_log2);
      scores[j][kv] = valid ? sum : vsplat(kNegInf);
    }
  }
  float prob[G][kDecodeChunk];
  for (int j = 0; j < G; ++j) {
    vfloat cm = scores[j][0];
    for (int kv = 1; kv < KV; ++kv) cm = vmax(cm, scores[j][kv]);
    const float chunk_max = hmax(cm);
    if (chunk_max > st.m[j]) {
      // Rescale only when the running max moves, which is rare after the first chunks.
      const float corr = std::exp2(st.m[j] - chunk_max);  // m = -inf gives 0
      st.l[j] *= corr;
      for (int v = 0; v < NV; ++v) st.acc[j][v] *= corr;
      st.m[j] = chunk_max;
    }
    const vfloat shift = vsplat(st.m[j] == kNegInf ? 0.f : st.m[j]);
    for (int kv = 0; kv < KV; ++kv) {
      const vfloat e = vexp2(scores[j][kv] - shift);
      st.l[j] += e;
      vstore(prob[j] + kv * W, e);
    }
  }
  if constexpr (kRowScaled<T>) {  // each value row's scale, folded into its weights
    for (int n = 0; n < n_keys; ++n) {
      const float value_scale = row_scale<D>(value_rows[n] + head_offset);
      for (int j = 0; j < G; ++j) prob[j][n] *= value_scale;
    }
  }
  constexpr int B = std::min(kSumsPerHead<G>, NV);
  constexpr int kValueMain = NV / B * B;
  // float32 rows' prefetches go with the first pass over the values (see above).
  const T* const* value_ahead = kMemoryBound<T> ? ahead_values : nullptr;
  for (int v0 = 0; v0 < kValueMain; v0 += B, value_ahead = nullptr)
    accumulate_values<D, G, B, T>(st, value_rows, head_offset, n_keys, prob, v0, value_ahead, to_l2);
  for (int v0 = kValueMain; v0 < NV; ++v0)
    accumulate_values<D, G, 1, T>(st, value_rows, head_offset, n_keys, prob, v0, nullptr, to_l2);
}

template <int D, int G, typename T>
void decode_item(const Problem& p, const Item& item, const T* zero_row, float* partials) {
  constexpr int NV = D / W;
  const int context_len = std::min(p.seq_lens[item.seq], item.end);
  const int token = p.query_start_loc[item.seq];
  const int num_kv = item.num_kv;
  const bool to_l2 = p.prefetch_to_l2;
  DecodeState<D, G> states[kMaxKvPerItem];
  const float* q_src = p.query + token * p.query_token_stride + static_cast<int64_t>(item.head_begin) * D;
  for (int h = 0; h < num_kv; ++h) {
    DecodeState<D, G>& st = states[h];
    for (int j = 0; j < G; ++j) {
      for (int v = 0; v < NV; ++v) {
        st.q[j][v] = vload(q_src + (h * G + j) * D + v * W) * p.scale_log2;
        st.acc[j][v] = vfloat{};
      }
      st.m[j] = kNegInf;
      st.l[j] = vfloat{};
      // The sink joins the softmax once: here when the item covers the whole window, else at the merge.
      if (p.sinks_log2 != nullptr && item.partial < 0) {
        st.m[j] = p.sinks_log2[item.head_begin + h * G + j];
        st.l[j][0] = 1.f;
      }
    }
  }
  // Rows of the chunks in flight (pointers to the item's first kv head): kPrefetchChunks ahead
  // are prefetched while this one computes, since blocks are scattered and hardware prefetchers
  // cannot guess the next block.
  constexpr int kAhead = kPrefetchChunks<T>;
  constexpr int kRing = kAhead + 1;
  const T* rows[kRing][2][kDecodeChunk];
  constexpr int kLine = 64 / static_cast<int>(sizeof(T));  // elements per cache line
  for (int c = 0; c < kAhead; ++c) {
    if (item.begin + c * kDecodeChunk < item.end) {
      locate_rows(p, item.seq, item.kv_head, item.begin + c * kDecodeChunk, kDecodeChunk, context_len, zero_row,
                  rows[c][0], rows[c][1]);
      for (int n = 0; n < kDecodeChunk; ++n) {
        for (int line = 0; line < num_kv * p.head_stride; line += kLine) {
          __builtin_prefetch(rows[c][0][n] + line, 0, 3);
          __builtin_prefetch(rows[c][1][n] + line, 0, 3);
        }
      }
    }
  }
  int cur = 0;
  for (int k0 = item.begin; k0 < item.end; k0 += kDecodeChunk, cur = cur + 1 == kRing ? 0 : cur + 1) {
    const int n_keys = std::min(kDecodeChunk, item.end - k0);
    const int ahead = k0 + kAhead * kDecodeChunk;
    const int ahead_slot = cur == 0 ? kRing - 1 : cur - 1;
    const bool fetch_ahead = ahead < item.end;
    if (fetch_ahead)
      locate_rows(p, item.seq, item.kv_head, ahead, kDecodeChunk, context_len, zero_row, rows[ahead_slot][0],
                  rows[ahead_slot][1]);
    for (int h = 0; h < num_kv; ++h) {
      decode_chunk<D, G, T>(states[h], rows[cur][0], rows[cur][1], h * p.head_stride, n_keys,
                            fetch_ahead ? rows[ahead_slot][0] : nullptr, fetch_ahead ? rows[ahead_slot][1] : nullptr,
                            to_l2, p.cap_log2);
    }
  }
  for (int h = 0; h < num_kv; ++h) {
    const DecodeState<D, G>& st = states[h];
    if (item.partial < 0) {
      float* dst =
          p.out + static_cast<int64_t>(token) * p.num_heads * D + static_cast<int64_t>(item.head_begin + h * G) * D;
      for (int j = 0; j < G; ++j) {
        const float total = hsum(st.l[j]);
        const float inv = total > 0.f ? p.value_scale / total : 0.f;
        for (int v = 0; v < NV; ++v) vstore(dst + j * D + v * W, st.acc[j][v] * inv);
      }
    } else {
      // Split items cover one kv head. Partial layout per item: m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][D].
      float* dst = partials + static_cast<int64_t>(item.partial) * (2 + D) * kMaxGroup;
      for (int j = 0; j < G; ++j) {
        dst[j] = st.m[j];
        dst[kMaxGroup + j] = hsum(st.l[j]);
        for (int v = 0; v < NV; ++v) vstore(dst + 2 * kMaxGroup + j * D + v * W, st.acc[j][v] * p.value_scale);
      }
    }
  }
}

template <int D, typename T>
void decode_dispatch(const Problem& p, const Item& item, const T* zero_row, float* partials) {
  switch (item.num_group) {
    case 1: return decode_item<D, 1, T>(p, item, zero_row, partials);
    case 2: return decode_item<D, 2, T>(p, item, zero_row, partials);
    case 3: return decode_item<D, 3, T>(p, item, zero_row, partials);
    case 4: return decode_item<D, 4, T>(p, item, zero_row, partials);
    case 5: return decode_item<D, 5, T>(p, item, zero_row, partials);
    case 6: return decode_item<D, 6, T>(p, item, zero_row, partials);
    case 7: return decode_item<D, 7, T>(p, item, zero_row, partials);
    default: return decode_item<D, 8, T>(p, item, zero_row, partials);
  }
}

// ---------------------------------------------------------------------------------------------
// Prefill: rows r = token_in_tile * g + head_in_group, padded to a multiple of W. Row-major
// buffers use the fixed stride kTileRows so that every offset below is a compile-time constant.
struct TileScratch {
  std::vector<float> qt;                                      // [D][kTileRows]: transposed, pre-scaled queries
  std::vector<float> kc;                                      // [kKeyChunk][D]: the chunk's keys, contiguous
  std::vector<float> vc;                                      // [kKeyChunk][D]: its values widened to float32
  std::vector<float> st;                                      // [kKeyChunk][kTileRows]: scores, then probabilities
  std::vector<float> o;                                       // [kTileRows][D]: unnormalised output
  std::vector<float> m, l, corr, row_pos, row_lo, chunk_max;  // [kTileRows]
  std::vector<float> zero_row;                                // [kMaxHeadDim * kMaxKvPerItem]: a whole masked row
  explicit TileScratch(int head_dim)
      : qt(static_cast<size_t>(head_dim) * kTileRows),
        kc(static_cast<size_t>(kKeyChunk) * head_dim),
        vc(static_cast<size_t>(kKeyChunk) * head_dim),
        st(static_cast<size_t>(kKeyChunk) * kTileRows),
        o(static_cast<size_t>(kTileRows) * head_dim),
        m(kTileRows),
        l(kTileRows),
        corr(kTileRows),
        row_pos(kTileRows),
        row_lo(kTileRows),
        chunk_max(kTileRows),
        zero_row(kMaxHeadDim * kMaxKvPerItem, 0.f) {}
};

#if defined(__AVX512F__)
constexpr int kQkKeys = 4;  // 4 keys x 4 row vectors = 16 accumulators of 32 registers
constexpr int kPvRows = 4;
#else
constexpr int kQkKeys = 2;  // 2 x 4 = 8 accumulators of 16 registers
constexpr int kPvRows = 2;
#endif
constexpr int kQkRowVecs = 4;
constexpr int kPvVecs = 4;

// st[n][r] = k_n . q_r for keys [n0, n0 + KB) and row vectors [rv0, rv0 + RV); also folds
// the scores into the running per-row chunk maximum.
template <int D, int KB, int RV>
inline void qk_block(const float* kc, const float* qt, float* st, float* chunk_max, int n0, int rv0) {
  vfloat acc[KB][RV];
  for (int b = 0; b < KB; ++b)
    for (int i = 0; i < RV; ++i) acc[b][i] = vfloat{};
  const float* k = kc + n0 * D;
#pragma GCC unroll 4
  for (int d = 0; d < D; ++d) {
    vfloat qv[RV];
    for (int i = 0; i < RV; ++i) qv[i] = vload(qt + d * kTileRows + (rv0 + i) * W);
    for (int b = 0; b < KB; ++b) {
      const vfloat kb = vsplat(k[b * D + d]);
      for (int i = 0; i < RV; ++i) acc[b][i] += kb * qv[i];
    }
  }
  for (int i = 0; i < RV; ++i) {
    vfloat mx = vload(chunk_max + (rv0 + i) * W);
    for (int b = 0; b < KB; ++b) {
      vstore(st + (n0 + b) * kTileRows + (rv0 + i) * W, acc[b][i]);
      mx = vmax(mx, acc[b][i]);
    }
    vstore(chunk_max + (rv0 + i) * W, mx);
  }
}

template <int D>
void qk_chunk(const float* kc, int n_keys, const float* qt, int rows, float* st, float* chunk_max) {
  const int row_vecs = rows / W;
  for (int n0 = 0; n0 < n_keys; n0 += kQkKeys) {
    int rv0 = 0;
    for (; rv0 + kQkRowVecs <= row_vecs; rv0 += kQkRowVecs)
      qk_block<D, kQkKeys, kQkRowVecs>(kc, qt, st, chunk_max, n0, rv0);
    for (; rv0 < row_vecs; ++rv0) qk_block<D, kQkKeys, 1>(kc, qt, st, chunk_max, n0, rv0);
  }
}

// o[r] = o[r] * corr[r] + sum_n p[n][r] * v_n for rows [r0, r0 + R), output vectors [c0, c0 + C).
// Value rows are float32: every row block reads them again, so other types are widened once first.
template <int D, int R, int C>
inline void pv_block(const float* const* value_rows, int n_keys, const float* st, const float* corr, float* o, int r0,
                     int c0) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r) {
    const vfloat cr = vsplat(corr[r0 + r]);
    for (int c = 0; c < C; ++c) acc[r][c] = vload(o + (r0 + r) * D + (c0 + c) * W) * cr;
  }
  for (int n = 0; n < n_keys; ++n) {
    vfloat vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(value_rows[n] + (c0 + c) * W);
    for (int r = 0; r < R; ++r) {
      const vfloat pr = vsplat(st[n * kTileRows + r0 + r]);
      for (int c = 0; c < C; ++c) acc[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(o + (r0 + r) * D + (c0 + c) * W, acc[r][c]);
}

template <int D>
void pv_chunk(const float* const* value_rows, int n_keys, const float* st, int rows, const float* corr, float* o) {
  constexpr int NV = D / W;
  constexpr int kTail = NV % kPvVecs;
  for (int r0 = 0; r0 < rows; r0 += kPvRows) {
    int c0 = 0;
    for (; c0 + kPvVecs <= NV; c0 += kPvVecs) pv_block<D, kPvRows, kPvVecs>(value_rows, n_keys, st, corr, o, r0, c0);
    if constexpr (kTail > 0) pv_block<D, kPvRows, kTail>(value_rows, n_keys, st, corr, o, r0, c0);
  }
}

// One head row as float32 values: widened, and times its own scale for an int8 row.
template <int D, typename T>
inline void widen_row(float* dst, const T* row) {
  const vfloat scale = vsplat(row_scale<D>(row));
  for (int v = 0; v < D / W; ++v) {
    const vfloat x = load_kv(row + v * W);
    vstore(dst + v * W, kRowScaled<T> ? x * scale : x);
  }
}

// A split prefill tile's partial softmax state: per row m, l, then the unnormalised output.
constexpr int64_t prefill_partial_floats(int head_dim) { return static_cast<int64_t>(kTileRows) * (2 + head_dim); }

// The sink's log2 score of a query head, or -inf when the model has none.
inline float head_sink(const Problem& p, int head) { return p.sinks_log2 != nullptr ? p.sinks_log2[head] : kNegInf; }

// One output row from `count` partial softmax states `stride` floats apart, each laid out as
// m[rows], l[rows], acc[rows][D]: out = scale * sum_k 2^(m_k - M) acc_k / (2^(sink - M) + sum_k 2^(m_k - M) l_k).
template <int D>
void merge_row(const float* parts, int count, int64_t stride, int rows, int row, float sink, float scale, float* dst) {
  float m_all = sink;
  for (int k = 0; k < count; ++k) m_all = std::max(m_all, parts[k * stride + row]);
  float l_all = sink == kNegInf ? 0.f : std::exp2(sink - m_all);
  float acc[kMaxHeadDim] = {};
  for (int k = 0; k < count; ++k) {
    const float* part = parts + k * stride;
    if (part[row] == kNegInf) continue;
    const float w = std::exp2(part[row] - m_all);
    l_all += w * part[rows + row];
    const float* a = part + 2 * rows + static_cast<int64_t>(row) * D;
    for (int d = 0; d < D; ++d) acc[d] += w * a[d];
  }
  const float inv = l_all > 0.f ? scale / l_all : 0.f;
  for (int d = 0; d < D; ++d) dst[d] = acc[d] * inv;
}

// The keys a prefill tile sees: [first, end), from its first row's window start to its last row.
inline std::pair<int, int> tile_keys(const Problem& p, const Item& item) {
  const int q_len = p.query_start_loc[item.seq + 1] - p.query_start_loc[item.seq];
  const int first_pos = p.seq_lens[item.seq] - q_len;
  const int first = p.window > 0 ? std::max(0, first_pos + item.begin - p.window + 1) : 0;
  return {first, first_pos + item.end};
}

// Writes the tile's normalised output, or, for a part of a split tile (item.partial >= 0), its
// (m, l, o) partials, with no sink: the merge adds it once.
template <int D, typename T>
void prefill_item(const Problem& p, const Item& item, TileScratch& s, float* partials) {
  constexpr int NV = D / W;
  const int g = item.num_group;
  const int context_len = p.seq_lens[item.seq];
  const int token0 = p.query_start_loc[item.seq];
  const int q_len = p.query_start_loc[item.seq + 1] - token0;
  const int first_pos = context_len - q_len;
  const int n_tokens = item.end - item.begin;
  const int used_rows = n_tokens * g;
  const int rows = (used_rows + W - 1) / W * W;
  float* qt = s.qt.data();
  float* kc = s.kc.data();
  float* vc = s.vc.data();
  float* st = s.st.data();
  float* o = s.o.data();
  // Transpose the tile's queries W rows x W dims at a time; padding rows read zeros.
  const vfloat scale = vsplat(p.scale_log2);
  for (int r0 = 0; r0 < rows; r0 += W) {
    const float* src[W];
    for (int i = 0; i < W; ++i) {
      const int r = r0 + i, t = r / g, j = r % g;
      src[i] = r < used_rows ? p.query + static_cast<int64_t>(token0 + item.begin + t) * p.query_token_stride +
                                   static_cast<int64_t>(item.head_begin + j) * D
                             : s.zero_row.data();
    }
    for (int d0 = 0; d0 < D; d0 += W) {
      vfloat x[W];
      for (int i = 0; i < W; ++i) x[i] = vload(src[i] + d0) * scale;
      transpose(x);
      for (int i = 0; i < W; ++i) vstore(qt + (d0 + i) * kTileRows + r0, x[i]);
    }
  }
  std::fill(o, o + rows * D, 0.f);
  for (int r = 0; r < rows; ++r) {
    const bool used = r < used_rows;
    const int t = r / g;
    s.m[r] = kNegInf;
    s.l[r] = 0.f;
    if (used && p.sinks_log2 != nullptr && item.partial < 0) {  // the sink: a first score with no value
      s.m[r] = p.sinks_log2[item.head_begin + r % g];
      s.l[r] = 1.f;
    }
    // Padding rows are never stored; position -1 keeps them out of any masking decision.
    s.row_pos[r] = used ? static_cast<float>(first_pos + item.begin + t) : -1.f;
    s.row_lo[r] = s.row_pos[r] - static_cast<float>(p.window);  // with a window, the row sees keys above this
  }
  const int first_row_pos = first_pos + item.begin;
  const int last_row_pos = first_pos + item.end - 1;
  // The tile's last row sees keys < key_end; keys before the first row's window are outside
  // every row's: never read.
  auto [key_begin, key_end] = tile_keys(p, item);
  if (item.key_end >= 0) {
    key_begin = item.key_begin;
    key_end = item.key_end;
  }
  const bool capped = p.cap_log2 > 0.f;
  const float inv_cap = capped ? 1.f / p.cap_log2 : 0.f;
  const T* key_rows[kKeyChunk];
  const T* value_rows[kKeyChunk];
  const T* ahead_keys[kKeyChunk];
  const T* ahead_values[kKeyChunk];
  const T* zero_row = reinterpret_cast<const T*>(s.zero_row.data());  // all-zero bytes: 0 in every type
  // A tile that is its sequence's only one (a verification's few tokens) reads each key once,
  // from memory rather than from a tile before it: the next chunk's rows are fetched ahead.
  const bool stream = item.begin == 0 && item.end == q_len;
  for (int k0 = key_begin; k0 < key_end; k0 += kKeyChunk) {
    const int n_keys = std::min(kKeyChunk, key_end - k0);
    // Round up to the QK block; the extra keys are zero rows and get masked below.
    const int n_keys_qk = (n_keys + kQkKeys - 1) / kQkKeys * kQkKeys;
    locate_rows(p, item.seq, item.kv_head, k0, n_keys_qk, key_end, zero_row, key_rows, value_rows);
    if (stream && k0 + kKeyChunk < key_end) {
      const int n_ahead = std::min(kKeyChunk, key_end - k0 - kKeyChunk);
      locate_rows(p, item.seq, item.kv_head, k0 + kKeyChunk, n_ahead, key_end, zero_row, ahead_keys, ahead_values);
      for (int n = 0; n < n_ahead; ++n) {
        prefetch_head_row<D, T>(ahead_keys[n], false);
        prefetch_head_row<D, T>(ahead_values[n], false);
      }
    }
    for (int n = 0; n < n_keys_qk; ++n) widen_row<D>(kc + n * D, key_rows[n]);
    const float* values[kKeyChunk];  // the chunk's values as float32 rows
    for (int n = 0; n < n_keys; ++n) {
      if constexpr (std::is_same_v<T, float>) {
        values[n] = value_rows[n];
      } else {
        widen_row<D>(vc + n * D, value_rows[n]);
        values[n] = vc + n * D;
      }
    }
    for (int rv = 0; rv < rows; rv += W) vstore(s.chunk_max.data() + rv, vsplat(kNegInf));
    qk_chunk<D>(kc, n_keys_qk, qt, rows, st, s.chunk_max.data());
    // Only chunks that reach past the tile's first position need the causal mask, and only those
    // that start at or before the last row's window start the window's.
    const bool masked = k0 + n_keys_qk - 1 > first_row_pos;
    const bool window_masked = p.window > 0 && k0 <= last_row_pos - p.window;
    for (int rv = 0; rv < rows; rv += W) {
      vfloat chunk_max = vload(s.chunk_max.data() + rv);
      if (capped || window_masked) {
        const vfloat pos = vload(s.row_pos.data() + rv);
        const vfloat lo = vload(s.row_lo.data() + rv);
        chunk_max = vsplat(kNegInf);
        for (int n = 0; n < n_keys; ++n) {
          vfloat sc = vload(st + n * kTileRows + rv);
          if (capped) sc = soft_cap(sc, p.cap_log2, inv_cap);
          const vfloat key = vsplat(static_cast<float>(k0 + n));
          if (masked) sc = key <= pos ? sc : vsplat(kNegInf);
          if (window_masked) sc = key > lo ? sc : vsplat(kNegInf);
          vstore(st + n * kTileRows + rv, sc);
          chunk_max = vmax(chunk_max, sc);
        }
      } else if (masked) {
        const vfloat pos = vload(s.row_pos.data() + rv);
        chunk_max = vsplat(kNegInf);
        for (int n = 0; n < n_keys; ++n) {
          vfloat sc = vload(st + n * kTileRows + rv);
          sc = vsplat(static_cast<float>(k0 + n)) <= pos ? sc : vsplat(kNegInf);
          vstore(st + n * kTileRows + rv, sc);
          chunk_max = vmax(chunk_max, sc);
        }
      }
      const vfloat m_old = vload(s.m.data() + rv);
      const vfloat m_new = vmax(m_old, chunk_max);
      const vfloat shift = m_new == vsplat(kNegInf) ? vfloat{} : m_new;
      vfloat sum = vfloat{};
      for (int n = 0; n < n_keys; ++n) {
        const vfloat e = vexp2(vload(st + n * kTileRows + rv) - shift);
        vstore(st + n * kTileRows + rv, e);
        sum += e;
      }
      const vfloat corr = vexp2(m_old - shift);
      vstore(s.corr.data() + rv, corr);
      vstore(s.l.data() + rv, vload(s.l.data() + rv) * corr + sum);
      vstore(s.m.data() + rv, m_new);
    }
    pv_chunk<D>(values, n_keys, st, rows, s.corr.data(), o);
  }
  if (item.partial >= 0) {
    float* part = partials + item.partial * prefill_partial_floats(D);
    std::copy(s.m.begin(), s.m.begin() + used_rows, part);
    std::copy(s.l.begin(), s.l.begin() + used_rows, part + kTileRows);
    std::copy(o, o + used_rows * D, part + 2 * kTileRows);
    return;
  }
  for (int r = 0; r < used_rows; ++r) {
    const int t = r / g, j = r % g;
    float* dst = p.out + static_cast<int64_t>(token0 + item.begin + t) * p.num_heads * D +
                 static_cast<int64_t>(item.head_begin + j) * D;
    const vfloat inv = vsplat(s.l[r] > 0.f ? p.value_scale / s.l[r] : 0.f);
    for (int v = 0; v < NV; ++v) vstore(dst + v * W, vload(o + r * D + v * W) * inv);
  }
}

// ---------------------------------------------------------------------------------------------
// Items [begin, end) run back to back on one thread.
struct Run {
  int begin, end;
  double cost;
};

// Orders `items` for the threads and cuts them into runs. Sequences that share a prefix share its
// cache blocks (prefix caching): items of the same kv head whose keys start in the same block go
// into one run, so the shared rows come from memory once and from the core's cache for the rest
// (a 512-token prefix is 256 KiB per kv head at head_dim 64). A run holds at most a quarter of a
// thread's share of the items, so the threads still balance; runs go biggest first, so dynamic
// scheduling ends with the small ones. Without shared blocks every run is one item.
inline std::vector<Run> shared_block_runs(const Problem& p, std::vector<Item>& items, int num_threads) {
  auto first_block = [&](const Item& it) {
    // A prefill tile reads the whole prefix, or from its first row's window start.
    int first_key = it.begin;
    if (!is_decode(p, it.seq)) first_key = it.key_begin >= 0 ? it.key_begin : tile_keys(p, it).first;
    return p.block_table[static_cast<int64_t>(it.seq) * p.block_table_stride + first_key / p.block_size];
  };
  std::vector<std::pair<int64_t, int>> keyed(items.size());  // (shared-block key, item index)
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    keyed[i] = {(static_cast<int64_t>(first_block(it)) * p.num_heads + it.head_begin), static_cast<int>(i)};
  }
  std::stable_sort(keyed.begin(), keyed.end());
  std::vector<Item> sorted;
  sorted.reserve(items.size());
  for (const auto& [key, i] : keyed) sorted.push_back(items[i]);
  items.swap(sorted);
  const int max_run = std::max<int>(1, static_cast<int>(items.size()) / (4 * std::max(1, num_threads)));
  std::vector<Run> runs;
  for (int i = 0, n = static_cast<int>(items.size()); i < n; ++i) {
    const bool extend =
        !runs.empty() && keyed[i].first == keyed[i - 1].first && runs.back().end - runs.back().begin < max_run;
    if (!extend) runs.push_back({i, i, 0.0});
    runs.back().end = i + 1;
    runs.back().cost += items[i].cost;
  }
  std::stable_sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.cost > b.cost; });
  return runs;
}

// Merges the unsplit decode items of one sequence's consecutive kv heads (made in that order)
// into items of up to kMaxKvPerItem heads, which read each key row whole (see decode_item).
inline void group_kv_heads(const Problem& p, std::vector<Item>& items) {
  std::vector<Item> grouped;
  grouped.reserve(items.size());
  for (const Item& it : items) {
    if (is_decode(p, it.seq) && it.partial < 0 && !grouped.empty()) {
      Item& last = grouped.back();  // of the same sequence, hence a decode item too
      if (last.seq == it.seq && last.partial < 0 && last.kv_head + last.num_kv == it.kv_head &&
          last.num_kv < kMaxKvPerItem && last.begin == it.begin && last.end == it.end) {
        ++last.num_kv;
        last.cost += it.cost;
        continue;
      }
    }
    grouped.push_back(it);
  }
  items.swap(grouped);
}

template <int D, typename T>
void run(const Problem& p, int num_seqs, int num_threads) {
  const int group = p.num_heads / p.num_kv_heads;
  const int num_chunks = (group + kMaxGroup - 1) / kMaxGroup;
  std::vector<Item> items;
  int max_context = 0;  // keys of the longest decode context or prefill tile
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int context_len = p.seq_lens[s];
    if (q_len == 0) continue;
    const int decode_begin = p.window > 0 ? std::max(0, context_len - p.window) : 0;  // a decode's window start
    for (int kh = 0; kh < p.num_kv_heads; ++kh) {
      for (int c = 0; c < num_chunks; ++c) {
        const int h0 = kh * group + c * kMaxGroup;
        const int g = std::min(kMaxGroup, group - c * kMaxGroup);
        if (q_len == 1) {
          items.push_back(
              {s, kh, h0, g, decode_begin, context_len, -1, static_cast<double>(context_len - decode_begin) * g});
        } else {
          const int tile_tokens = std::max(1, kTileRows / g);
          const int first_pos = context_len - q_len;
          for (int t0 = 0; t0 < q_len; t0 += tile_tokens) {
            const int t1 = std::min(q_len, t0 + tile_tokens);
            const int key_begin = p.window > 0 ? std::max(0, first_pos + t0 - p.window + 1) : 0;
            items.push_back(
                {s, kh, h0, g, t0, t1, -1, static_cast<double>(first_pos + t1 - key_begin) * (t1 - t0) * g});
          }
        }
      }
    }
    if (q_len == 1) max_context = std::max(max_context, context_len - decode_begin);
  }
  // Too few items to keep every thread busy: split long decode contexts, and the keys of short
  // prefill tiles (a verification's few tokens after a long context), into partitions whose
  // partial softmax states are merged afterwards. Splitting a tile's rows instead would read
  // every key once per part, and per-key work dominates a tile of a few rows.
  std::vector<Item> split_items, prefill_parts;
  // per original split item: [first partial, count)
  std::vector<std::pair<int, int>> split_ranges, prefill_ranges;
  std::vector<Item> originals, prefill_originals;
  const int min_items = 4 * num_threads;
  for (const Item& it : items)
    if (!is_decode(p, it.seq)) {
      const auto [first, end] = tile_keys(p, it);
      max_context = std::max(max_context, end - first);
    }
  if (num_threads > 1 && static_cast<int>(items.size()) < min_items && max_context >= 512) {
    const int parts_wanted = (min_items + static_cast<int>(items.size()) - 1) / static_cast<int>(items.size());
    std::vector<Item> kept;
    for (const Item& it : items) {
      const bool decode = is_decode(p, it.seq);
      const auto [first_key, end_key] = decode ? std::pair<int, int>{it.begin, it.end} : tile_keys(p, it);
      const int len = end_key - first_key;
      const int unit = decode ? kDecodeChunk : kKeyChunk;
      int part_len = (len + parts_wanted - 1) / parts_wanted;
      part_len = std::max(decode ? 256 : 128, (part_len + unit - 1) / unit * unit);
      if (part_len >= len) {
        kept.push_back(it);
        continue;
      }
      std::vector<Item>& parts = decode ? split_items : prefill_parts;
      const int first = static_cast<int>(parts.size());
      for (int b = first_key; b < end_key; b += part_len) {
        Item part = it;
        const int e = std::min(end_key, b + part_len);
        if (decode) {
          part.begin = b;
          part.end = e;
        } else {
          part.key_begin = b;
          part.key_end = e;
        }
        part.partial = static_cast<int>(parts.size());
        part.cost = it.cost * (e - b) / len;
        parts.push_back(part);
      }
      (decode ? split_ranges : prefill_ranges).push_back({first, static_cast<int>(parts.size()) - first});
      (decode ? originals : prefill_originals).push_back(it);
    }
    items.swap(kept);
    items.insert(items.end(), split_items.begin(), split_items.end());
    items.insert(items.end(), prefill_parts.begin(), prefill_parts.end());
  }
  if (num_chunks == 1) group_kv_heads(p, items);
  const std::vector<Run> runs = shared_block_runs(p, items, num_threads);
  std::vector<float> partials(split_items.size() * (2 + D) * kMaxGroup);
  std::vector<float> tile_partials(prefill_parts.size() * prefill_partial_floats(D));
  const int num_runs = static_cast<int>(runs.size());
  const int threads = std::max(1, std::min(num_threads, num_runs));
#pragma omp parallel num_threads(threads)
  {
    TileScratch scratch(D);
#pragma omp for schedule(dynamic, 1)
    for (int r = 0; r < num_runs; ++r) {
      for (int i = runs[r].begin; i < runs[r].end; ++i) {
        const Item& it = items[i];
        if (is_decode(p, it.seq))
          decode_dispatch<D, T>(p, it, reinterpret_cast<const T*>(scratch.zero_row.data()), partials.data());
        else
          prefill_item<D, T>(p, it, scratch, tile_partials.data());
      }
    }
  }
  // Split decode items cover one kv head: their partials have kMaxGroup rows and the value scale applied.
  constexpr int64_t kDecodePart = (2 + D) * kMaxGroup;
  const int num_merges = static_cast<int>(originals.size());
  at::parallel_for(0, num_merges, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& it = originals[i];
      const auto [first, count] = split_ranges[i];
      const int token = p.query_start_loc[it.seq];
      float* dst = p.out + static_cast<int64_t>(token) * p.num_heads * D + static_cast<int64_t>(it.head_begin) * D;
      for (int j = 0; j < it.num_group; ++j)
        merge_row<D>(partials.data() + first * kDecodePart, count, kDecodePart, kMaxGroup, j,
                     head_sink(p, it.head_begin + j), 1.f, dst + j * D);
    }
  });
  // Split prefill tiles: kTileRows rows a part, the value scale left to the merge.
  constexpr int64_t kPart = prefill_partial_floats(D);
  for (size_t i = 0; i < prefill_originals.size(); ++i) {
    const Item& it = prefill_originals[i];
    const auto [first, count] = prefill_ranges[i];
    const int g = it.num_group;
    const int token0 = p.query_start_loc[it.seq];
    for (int r = 0, used_rows = (it.end - it.begin) * g; r < used_rows; ++r) {
      const int t = r / g, j = r % g;
      float* dst = p.out + static_cast<int64_t>(token0 + it.begin + t) * p.num_heads * D +
                   static_cast<int64_t>(it.head_begin + j) * D;
      merge_row<D>(tile_partials.data() + first * kPart, count, kPart, kTileRows, r, head_sink(p, it.head_begin + j),
                   p.value_scale, dst);
    }
  }
}

bool supported_head_dim(int64_t d) {
  return std::find(std::begin(kHeadDims), std::end(kHeadDims), d) != std::end(kHeadDims);
}

std::vector<int64_t> paged_attention_head_dims() { return {std::begin(kHeadDims), std::end(kHeadDims)}; }

bool supported_cache_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2 ||
         t == at::kChar;
}

// Cache elements after each head row's values: an int8 row's float16 scale.
int64_t row_extra(at::ScalarType t) { return t == at::kChar ? 2 : 0; }

// Cache elements from one token's row to the next, for a cache [2, blocks, block_size, kv_heads,
// row] that is contiguous, or whose token rows are wider than kv_heads * row (a narrow layer's view
// into a wider layer's tensor); -1 for any other layout.
int64_t cache_token_stride(const at::Tensor& kv_cache) {
  const int64_t heads = kv_cache.size(3), row = kv_cache.size(4);
  if (kv_cache.is_contiguous()) return heads * row;
  const int64_t token = kv_cache.stride(2);
  const bool padded = kv_cache.stride(4) == 1 && kv_cache.stride(3) == row && token >= heads * row &&
                      kv_cache.stride(1) == kv_cache.size(2) * token &&
                      kv_cache.stride(0) == kv_cache.size(1) * kv_cache.stride(1);
  return padded ? token : -1;
}

// run<D> for the kHeadDims entry equal to p.head_dim (checked by supported_head_dim first).
template <typename T, size_t... I>
void run_for_head_dim(const Problem& p, int num_seqs, int threads, std::index_sequence<I...>) {
  (void)((p.head_dim == kHeadDims[I] && (run<kHeadDims[I], T>(p, num_seqs, threads), true)) || ...);
}

template <typename T>
void run_for_head_dim(const Problem& p, int num_seqs, int threads) {
  run_for_head_dim<T>(p, num_seqs, threads, std::make_index_sequence<std::size(kHeadDims)>{});
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, double k_scale, double v_scale, bool prefetch_to_l2, int64_t sliding_window,
                     double logits_soft_cap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK_VALUE(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK_VALUE(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                        supported_cache_type(kv_cache.scalar_type()),
                    "paged_attention: float32 query and output, float32/float16/bfloat16/fp8/int8 cache only");
  TORCH_CHECK_VALUE(query.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "paged_attention: bad shapes");
  TORCH_CHECK_VALUE(cache_token_stride(kv_cache) > 0 && out.is_contiguous(),
                    "paged_attention: kv_cache must be contiguous (or padded rows of one), out contiguous");
  TORCH_CHECK_VALUE(query.stride(2) == 1 && query.stride(1) == query.size(2),
                    "paged_attention: each token's query heads must be contiguous");
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                        query_start_loc.scalar_type() == at::kInt,
                    "paged_attention: block_table, seq_lens and query_start_loc must be int32");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.stride(1) == 1,
                    "paged_attention: block_table rows must be contiguous");
  TORCH_CHECK_VALUE(seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
                    "paged_attention: metadata must be contiguous");
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t head_dim = query.size(2);
  TORCH_CHECK_VALUE(supported_head_dim(head_dim), "paged_attention: unsupported head_dim ", head_dim);
  TORCH_CHECK_VALUE(
      kv_cache.size(4) == head_dim + row_extra(kv_cache.scalar_type()) && query.size(1) % kv_cache.size(3) == 0,
      "paged_attention: head shapes do not match");
  TORCH_CHECK_VALUE(query_start_loc.size(0) == num_seqs + 1 && block_table.size(0) >= num_seqs,
                    "paged_attention: metadata sizes do not match");
  TORCH_CHECK_VALUE(out.sizes() == query.sizes(), "paged_attention: out must be shaped like query");
  TORCH_CHECK_VALUE(sliding_window >= 0 && sliding_window <= std::numeric_limits<int32_t>::max(),
                    "paged_attention: sliding_window must be >= 0 (0: none)");
  TORCH_CHECK_VALUE(logits_soft_cap >= 0 && std::isfinite(logits_soft_cap),
                    "paged_attention: logits_soft_cap must be finite and >= 0 (0: none)");
  std::vector<float> sinks_log2;
  if (sinks.has_value()) {
    const at::Tensor& t = *sinks;
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 &&
                          t.size(0) == query.size(1) && t.is_contiguous(),
                      "paged_attention: sinks must be a contiguous float32 CPU tensor of one value per query head");
    const float* src = t.data_ptr<float>();
    for (int64_t h = 0; h < t.size(0); ++h) sinks_log2.push_back(src[h] * kLog2e);
  }

  Problem p;
  p.query = query.data_ptr<float>();
  p.query_token_stride = query.stride(0);
  p.out = out.data_ptr<float>();
  p.key_cache = kv_cache.data_ptr();
  p.value_cache = static_cast<const char*>(p.key_cache) + kv_cache.stride(0) * kv_cache.element_size();
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(kv_cache.size(3));
  p.head_dim = static_cast<int>(head_dim);
  p.head_stride = static_cast<int>(kv_cache.size(4));
  p.token_stride = cache_token_stride(kv_cache);
  p.block_size = static_cast<int>(kv_cache.size(2));
  // Only fp8 caches are stored under the layer's scales; the others hold values as they are.
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  const float unit = kv_cache.scalar_type() == at::kFloat8_e4m3fn ? kKvUnit<c10::Float8_e4m3fn> : 1.f;
  p.scale_log2 = static_cast<float>(scale * (fp8 ? k_scale : 1.0)) * unit * kLog2e;
  p.value_scale = static_cast<float>(fp8 ? v_scale : 1.0) * unit;
  p.prefetch_to_l2 = prefetch_to_l2;
  p.window = static_cast<int>(sliding_window);
  // Scores are kept in log2 units, the scale folded into the query: so is the cap.
  p.cap_log2 = static_cast<float>(logits_soft_cap) * kLog2e;
  p.sinks_log2 = sinks.has_value() ? sinks_log2.data() : nullptr;

  // Every block a sequence reaches must exist: a bad table would otherwise read out of bounds.
  const int64_t num_blocks = kv_cache.size(1);
  TORCH_CHECK_VALUE(p.query_start_loc[0] == 0 && p.query_start_loc[num_seqs] == query.size(0),
                    "paged_attention: query_start_loc must run from 0 to the number of tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int q_len = p.query_start_loc[s + 1] - p.query_start_loc[s];
    const int context_len = p.seq_lens[s];
    TORCH_CHECK_VALUE(q_len >= 0 && context_len >= q_len, "paged_attention: sequence ", s, " has ", q_len,
                      " new tokens but a context of ", context_len);
    const int64_t blocks = (context_len + p.block_size - 1) / p.block_size;
    TORCH_CHECK_VALUE(blocks <= block_table.size(1), "paged_attention: block_table too narrow for sequence ", s);
    const int32_t* row = p.block_table + s * p.block_table_stride;
    // Entries before the first window are never read (their blocks may be freed).
    for (int64_t b = first_visible_key(p, static_cast<int>(s)) / p.block_size; b < blocks; ++b)
      TORCH_CHECK_VALUE(row[b] >= 0 && row[b] < num_blocks, "paged_attention: sequence ", s, " uses block ", row[b],
                        " of ", num_blocks);
  }
  const int threads = at::get_num_threads();
  switch (kv_cache.scalar_type()) {
    case at::kHalf: return run_for_head_dim<c10::Half>(p, static_cast<int>(num_seqs), threads);
    case at::kBFloat16: return run_for_head_dim<c10::BFloat16>(p, static_cast<int>(num_seqs), threads);
    case at::kFloat8_e4m3fn: return run_for_head_dim<c10::Float8_e4m3fn>(p, static_cast<int>(num_seqs), threads);
    case at::kFloat8_e5m2: return run_for_head_dim<c10::Float8_e5m2>(p, static_cast<int>(num_seqs), threads);
    case at::kChar: return run_for_head_dim<int8_t>(p, static_cast<int>(num_seqs), threads);
    default: return run_for_head_dim<float>(p, static_cast<int>(num_seqs), threads);
  }
}

// Scatter this step's keys and values into their cache slots (what write_kv_cache does, without
// the generic index_copy_ machinery: one memcpy per token row, spread over the threads). A
// float16 / bfloat16 cache takes float32 rows, converted on the way in; an 8-bit cache takes
// float32 rows, quantized one head row at a time (kv_types.h's quantize_row).
template <typename T>
void scatter_converted(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value, const int64_t* slots,
                       int64_t num_tokens, float k_scale, float v_scale) {
  T* key_cache = static_cast<T*>(kv_cache.data_ptr());
  T* value_cache = key_cache + kv_cache.stride(0);
  const float* key_src = key.data_ptr<float>();
  const float* value_src = value.data_ptr<float>();
  const int64_t num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t row = kv_cache.size(3) * kv_cache.size(4);    // cache elements per token
  const int64_t token_stride = cache_token_stride(kv_cache);  // row, or more for a narrow layer's view
  constexpr bool kQuantized = sizeof(T) == 1;
  at::parallel_for(0, num_tokens, kQuantized ? 16 : 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if constexpr (kQuantized) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          T* dst = key_cache + slots[t] * token_stride + h * kv_cache.size(4);
          quantize_row(dst, key_src + t * key.stride(0) + h * head_dim, head_dim, k_scale);
          quantize_row(dst + kv_cache.stride(0), value_src + t * value.stride(0) + h * head_dim, head_dim, v_scale);
        }
      } else {
        convert_row(key_cache + slots[t] * token_stride, key_src + t * key.stride(0), row);
        convert_row(value_cache + slots[t] * token_stride, value_src + t * value.stride(0), row);
      }
    }
  });
}

void write_kv_cache(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                    const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK_VALUE(
      kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && cache_token_stride(kv_cache) > 0,
      "write_kv_cache: kv_cache must be a contiguous CPU [2, blocks, block_size, kv_heads, row_width] "
      "(or padded rows of one)");
  const at::ScalarType cache_type = kv_cache.scalar_type();
  const bool quantizes = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2 || cache_type == at::kChar;
  const bool converts =
      (cache_type == at::kHalf || cache_type == at::kBFloat16 || quantizes) && key.scalar_type() == at::kFloat;
  TORCH_CHECK_VALUE(
      key.scalar_type() == value.scalar_type() && (converts || (key.scalar_type() == cache_type && !quantizes)),
      "write_kv_cache: key/value dtype must match the cache, or be float32 for a 16- or 8-bit cache");
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.dim() == 1,
                    "write_kv_cache: slot_mapping must be contiguous int64");
  TORCH_CHECK_VALUE(k_scale > 0 && v_scale > 0, "write_kv_cache: scales must be positive");
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_kv_heads = kv_cache.size(3), head_dim = kv_cache.size(4) - row_extra(cache_type);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == num_kv_heads && t->size(2) == head_dim,
                      "write_kv_cache: key/value must be [tokens, kv_heads, head_dim] matching the cache");
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) == head_dim,
                      "write_kv_cache: each token's heads must be contiguous");
  }
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "write_kv_cache: slot ", slots[t], " out of ", num_slots);
  if (converts) {
    const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
    switch (cache_type) {
      case at::kHalf: return scatter_converted<c10::Half>(kv_cache, key, value, slots, num_tokens, ks, vs);
      case at::kBFloat16: return scatter_converted<c10::BFloat16>(kv_cache, key, value, slots, num_tokens, ks, vs);
      case at::kFloat8_e4m3fn:
        return scatter_converted<c10::Float8_e4m3fn>(kv_cache, key, value, slots, num_tokens, ks, vs);
      case at::kFloat8_e5m2:
        return scatter_converted<c10::Float8_e5m2>(kv_cache, key, value, slots, num_tokens, ks, vs);
      default: return scatter_converted<int8_t>(kv_cache, key, value, slots, num_tokens, ks, vs);
    }
  }
  const int64_t row_bytes = num_kv_heads * head_dim * static_cast<int64_t>(kv_cache.element_size());
  const int64_t token_bytes = cache_token_stride(kv_cache) * static_cast<int64_t>(kv_cache.element_size());
  char* key_cache = static_cast<char*>(kv_cache.data_ptr());
  char* value_cache = key_cache + kv_cache.stride(0) * kv_cache.element_size();
  const char* key_src = static_cast<const char*>(key.data_ptr());
  const char* value_src = static_cast<const char*>(value.data_ptr());
  const int64_t key_stride = key.stride(0) * key.element_size(), value_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(key_cache + slots[t] * token_bytes, key_src + t * key_stride, row_bytes);
      std::memcpy(value_cache + slots[t] * token_bytes, value_src + t * value_stride, row_bytes);
    }
  });
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_attn, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, float k_scale, float v_scale, bool prefetch_to_l2, "
      "int sliding_window=0, float logits_soft_cap=0., Tensor? sinks=None) -> ()");
  m.def(
      "write_kv_cache(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, float k_scale, "
      "float v_scale) -> ()");
  m.def("paged_attention_head_dims() -> int[]", &pagellm::paged_attention_head_dims);
}

TORCH_LIBRARY_IMPL(pagellm_attn, CPU, m) {
  m.impl("paged_attention", &pagellm::paged_attention);
  m.impl("write_kv_cache", &pagellm::write_kv_cache);
}
