// y = x W^T (+ b) with integer dot products, on a GGUF model's weights repacked straight from the
// file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K), as llama.cpp computes them.
//
// A float32 matmul spends one FMA per weight and row. Here the activations are quantized too, on
// the fly, once per call: every 32 inputs of a row become qa = round(x / da) with da = amax / 127,
// and the product of a weight block with an activation block is one int32 sum of byte products,
// which `vpdpbusd` (AVX512-VNNI, or the 256-bit AVX-VNNI form) computes four at a time per lane:
// 64 multiply-adds per instruction where an FMA does 16.
//
// Every type holds, per weight, a small integer stored unsigned as u = q + bias (u of 4 bits,
// "nibbles", of 5 or 6 as nibbles and a plane of high bits, or of 8, "bytes"), and per group of
// 32 (or 16) inputs a scale D and for some an offset M: w = D (u - bias) + M. The int32 sum
// starts at -bias sum(qa) (vpdpbusd multiplies unsigned bytes by signed ones, so the offset goes
// there), then sum w x ~ D da isum + M da sum(qa) once per group. D and M come in three kinds
// ("scales" below):
//   half    (Q4_0 ... Q8_0): the file's fp16 d (and m) per 32 inputs, converted by vcvtph2ps.
//   super32 (Q4_K, Q5_K): per 256 inputs fp16 d and -dmin, per 32 6-bit sc and mn: D = d sc, M = -dmin mn.
//   super16 (Q2_K, Q3_K, Q6_K): per 256 fp16 d (and -dmin), per 16 an 8-bit sc (and mn): a 32-block
//     is two groups, with their own int32 sums and activation sums.
// Without VNNI the K-quants take x per 256 inputs instead (llama.cpp's Q8_K): a superblock then sums
// in int32 with its group scales in the widening vpmaddwd (micro-tiles below).
// Each packed weight is exactly the float32 that gguf's dequantize gives: an fp16 times a 6- or
// 8-bit integer is exact in float32, and so is that times the quant (24 bits at most); the result
// is exactly the product of W with the quantized x up to float rounding, so the error against
// float32 is that of 8-bit activations.
//
// Weights are packed into panels of NR = 2 W output columns, superblock-major: per superblock a
// header (fp16 d[NR], m[NR]), then per 32 inputs its scales and quants. The quants are ordered so
// that one vector load holds, for the W columns of one vector, 4 consecutive k of each column (a
// "k-quad"), the order vpdpbusd sums in; nibbles hold two k-quads per byte (low and high). The
// activations are stored by row block, k-quad-major, so a micro-tile's broadcasts are fixed offsets
// from one pointer. A micro-tile multiplies one panel by one row block over the whole K (a panel
// is at most a few hundred KiB: it stays in L2 for the next row block).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_tiles.h"
#include "parallel_panels.h"
#include "quant_blocks.h"
#include "vec.h"

// Without VNNI (AVX2, or AVX-512 before Cascade Lake) a byte dot product is llama.cpp's AVX2 form:
// vpmaddubsw (pairs into saturating int16), vpmaddwd by ones (pairs into int32), an add.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGELLM_INT8 1
#if defined(__AVX512VNNI__)
#define PAGELLM_VNNI 1
#else
#define PAGELLM_VNNI 0
#endif
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define PAGELLM_INT8 1
#if defined(__AVXVNNI__)
#define PAGELLM_VNNI 1
#else
#define PAGELLM_VNNI 0
#endif
#else
#define PAGELLM_INT8 0
#define PAGELLM_VNNI 0
#endif

namespace pagellm {
namespace {

#if PAGELLM_INT8

constexpr int QUADS = QK / 4;      // k-quads per 32-block
constexpr int kQuadBytes = 4 * W;  // one k-quad of one column vector: one vector load

#if defined(__AVX512F__)
using ivec = __m512i;
// Rows per micro-tile: 4 accumulators a row (2 int, 2 float) x 6, 4 weight vectors and a mask use
// 29 of the 32 registers. A batch of up to 8 rows is one tile even so: reading and unpacking the
// panel once outweighs the spills (docs/kernels.md).
constexpr int MR = 6, MR_MAX = 8;
inline ivec load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec splat_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline ivec high_nibbles(ivec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
// v shifted by `left` bits (negative: right) in 16-bit lanes, then masked per byte: a quant's high
// bits moved from their plane to above its nibble.
inline ivec place_high(ivec v, int left, uint8_t mask) {
  const ivec t = left >= 0 ? _mm512_slli_epi16(v, left) : _mm512_srli_epi16(v, -left);
  return _mm512_and_si512(t, _mm512_set1_epi8(static_cast<char>(mask)));
}
inline ivec or_bytes(ivec a, ivec b) { return _mm512_or_si512(a, b); }
inline ivec and_bytes(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec splat_i8(char v) { return _mm512_set1_epi8(v); }
inline ivec shift_right16(ivec v, int n) { return _mm512_srli_epi16(v, n); }
#if PAGELLM_VNNI
inline ivec dpbusd(ivec acc, ivec u8, ivec s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else
inline ivec xor_bytes(ivec a, uint8_t b) { return _mm512_xor_si512(a, _mm512_set1_epi8(static_cast<char>(b))); }
inline ivec pairs16(ivec u8, ivec s8) { return _mm512_maddubs_epi16(u8, s8); }
inline ivec add16(ivec a, ivec b) { return _mm512_add_epi16(a, b); }
inline ivec add_pairs32(ivec acc, ivec s16) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(s16, _mm512_set1_epi16(1)));
}
inline ivec scaled_pairs32(ivec acc, ivec s16, ivec scale16) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(s16, scale16));
}
inline ivec abs_bytes(ivec q) { return _mm512_abs_epi8(q); }
inline ivec sign_of(ivec a, ivec q) {
  return _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(q), _mm512_setzero_si512(), a);
}
#endif
inline vint round_to_int(vfloat v) { return (vint)_mm512_cvtps_epi32((__m512)v); }
inline vfloat load_half(const uint16_t* p) {
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#else
using ivec = __m256i;
// 16 registers: a row's 2 int32 sums stay in registers, its 2 float ones are touched once per
// group (once per superblock for the K-quants) and live in memory; 4 rows share each unpacked step
// (3 and 5 measured slower or no faster, docs/kernels.md).
constexpr int MR = 4, MR_MAX = 4;
inline ivec load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec splat_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline ivec high_nibbles(ivec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline ivec place_high(ivec v, int left, uint8_t mask) {
  const ivec t = left >= 0 ? _mm256_slli_epi16(v, left) : _mm256_srli_epi16(v, -left);
  return _mm256_and_si256(t, _mm256_set1_epi8(static_cast<char>(mask)));
}
inline ivec or_bytes(ivec a, ivec b) { return _mm256_or_si256(a, b); }
inline ivec and_bytes(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec splat_i8(char v) { return _mm256_set1_epi8(v); }
inline ivec shift_right16(ivec v, int n) { return _mm256_srli_epi16(v, n); }
#if PAGELLM_VNNI
inline ivec dpbusd(ivec acc, ivec u8, ivec s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#else
inline ivec xor_bytes(ivec a, uint8_t b) { return _mm256_xor_si256(a, _mm256_set1_epi8(static_cast<char>(b))); }
inline ivec pairs16(ivec u8, ivec s8) { return _mm256_maddubs_epi16(u8, s8); }
inline ivec add16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
inline ivec add_pairs32(ivec acc, ivec s16) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}
inline ivec scaled_pairs32(ivec acc, ivec s16, ivec scale16) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, scale16));
}
inline ivec abs_bytes(ivec q) { return _mm256_sign_epi8(q, q); }
inline ivec sign_of(ivec a, ivec q) { return _mm256_sign_epi8(a, q); }
#endif
inline vint round_to_int(vfloat v) { return (vint)_mm256_cvtps_epi32((__m256)v); }
inline vfloat load_half(const uint16_t* p) {
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif
static_assert(sizeof(ivec) == kQuadBytes, "one k-quad of a column vector is one register");

// Makes v a register value here: without it GCC reassociates a group's int16 sums into one tree
// at the group's end, and spills every product until then.
inline void computed_here(ivec& v) { asm("" : "+x"(v)); }

// acc + the lanes' dot products of two k-quad pairs of unsigned quants (at most 6 bits) with signed
// activations. Without VNNI the two pairs meet in int16: 2 x 2 x 63 x 127 = 32004 does not saturate.
inline ivec dot_quads2(ivec acc, ivec u_a, ivec a_a, ivec u_b, ivec a_b) {
#if PAGELLM_VNNI
  return dpbusd(dpbusd(acc, u_a, a_a), u_b, a_b);
#else
  return add_pairs32(acc, add16(pairs16(u_a, a_a), pairs16(u_b, a_b)));
#endif
}
// Byte quants, stored u = q + 128: VNNI sums u a (the activations' start carries -128 sum a);
// without it u a could saturate int16, so the sum is q a, as |q| times a with q's sign.
inline ivec dot_bytes(ivec acc, ivec u, ivec a) {
#if PAGELLM_VNNI
  return dpbusd(acc, u, a);
#else
  const ivec q = xor_bytes(u, 0x80);
  return add_pairs32(acc, pairs16(abs_bytes(q), sign_of(a, q)));
#endif
}
// The bias the activations' int32 start carries for a form: 8-bit quants' only with VNNI.
template <typename F>
constexpr int activation_bias(int bias) {
  return F::kBits < 8 || PAGELLM_VNNI ? bias : 0;
}

typedef int8_t vbyte __attribute__((vector_size(W)));

// 4 bytes as one int32 lane value; memcpy, which the compiler folds into the broadcast's load.
inline int32_t quad_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- Packed layouts ---------------------------------------------------------------------------

enum class Scales { kHalf, kSuper32, kSuper16 };

// Where a type's values sit in a panel. The kernel is instantiated per form (bits, scales, offsets),
// not per type: the bias a type stores its quants with is carried by the activations.
//   superblock: fp16 d[NR], if kHasMin fp16 m[NR] (offsets stored negated where the file subtracts)
//   per 32-block: super32 uint8 sc[NR], mn[NR]; super16 int8 sc[2][NR], if kHasMin uint8 mn[2][NR]
//                 then for 8 bits bytes uint8 [QUADS][2 vectors][W][4], for 6 bits summed fused
//                 triples uint8 [QUADS / 2][3][W][4] (kTriples), else the low 4 bits as nibbles
//                 uint8 [QUADS / 2][2][W][4] and, for 5 and 6 bits, the high bits in a plane
//                 uint8 [QUADS / 2 / kStepsPerPlane][W][4] (see kernel below)
// 5- and 6-bit quants stay as small as in the file (a whole byte each would read 1.3-1.6x the
// bytes a decode step streams); unpacking their high bits costs shifts, not memory.
template <int Bits, Scales S, bool HasMin>
struct Form {
  static_assert(S != Scales::kSuper32 || HasMin, "super32 types all have mins");
  static_assert(Bits == 4 || Bits == 5 || Bits == 6 || Bits == 8, "quants of 4, 5, 6 or 8 bits");
  // Without VNNI a K-quant's products meet its integer group scales in vpmaddwd (which widens them
  // to int32 anyway): a superblock sums in int32 under one activation scale, as llama.cpp's Q8_K,
  // and its float epilogue runs once per 256 inputs instead of per group. VNNI keeps the per-group form.
  static constexpr bool kFused = S != Scales::kHalf && !PAGELLM_VNNI;
  static constexpr int kBits = Bits;
  // 6-bit quants summed fused (Q6_K without VNNI) as triples: a step's 4 vectors of quants (k-quads
  // 2i and 2i + 1 of column vectors 0 and 1) in 3, the first three whole in bits 0-5 and the fourth
  // split over their bits 6-7. They unpack in 11 vector ops where nibbles and a plane take 18, and
  // stay as small as the file's (whole bytes were faster at many rows, slower at one: docs/kernels.md).
  static constexpr bool kTriples = Bits == 6 && kFused;
  static constexpr bool kNibbles = Bits < 8 && !kTriples, kHasMin = HasMin;
  static constexpr int kHighBits = kNibbles ? Bits - 4 : 0;
  // A nibble vector holds 2 k-quads of W columns; a plane vector holds their high bits for both
  // column vectors of kStepsPerPlane such steps: 4 fields of kHighBits bits per step and byte.
  static constexpr int kStepsPerPlane = kHighBits == 0 ? 1 : 2 / kHighBits;
  static constexpr Scales kScales = S;
  static constexpr int kBlocks = S == Scales::kHalf ? 1 : 8;      // 32-blocks per superblock
  static constexpr int kGroup = S == Scales::kSuper16 ? 16 : 32;  // inputs per scale
  static constexpr int kGroups = QK / kGroup;
  // 32-blocks of a row sharing one activation scale: a superblock where it is summed as one, else
  // one block (a scale per 32 follows the local magnitude: closer to float32, and as fast with VNNI).
  static constexpr int kActSpan = kFused ? 8 : 1;
  // Steps (2 k-quads of each column vector) whose vpmaddubsw pair sums, at most 2 x 2 x (2^Bits - 1)
  // x 127 a step, add up in int16 without saturating: 4 for 4 bits, 2 for 5, 1 for 6.
  static constexpr int kSumSteps = std::min(32767 / (4 * ((1 << std::min(Bits, 6)) - 1) * 127), kGroup / 8);
  static_assert((kGroup / 8) % kStepsPerPlane == 0, "a plane vector does not straddle two groups");
  static_assert((kGroup / 8) % kSumSteps == 0, "int16 sums do not straddle two groups");
  static constexpr int64_t kHeaderBytes = NR * 2 * (HasMin ? 2 : 1);
  static constexpr int64_t kScaleBytes = S == Scales::kHalf      ? 0
                                         : S == Scales::kSuper32 ? 2 * NR
                                                                 : kGroups * NR * (HasMin ? 2 : 1);
  static constexpr int64_t kQuantBytes = kNibbles ? QK * W : kTriples ? QK * W * 3 / 2 : QK * NR;
  static constexpr int64_t kBlockBytes = kScaleBytes + kQuantBytes + kHighBits * QK * W / 4;
  static constexpr int64_t kSuperBytes = kHeaderBytes + kBlocks * kBlockBytes;
  // Byte offset in a 32-block's quants of the plane vector holding step i's high bits, and where
  // in its byte those of column vector `cv` sit (the low k-quad's; the high one's follow).
  static constexpr int64_t plane_at(int i) { return kQuantBytes + i / kStepsPerPlane * kQuadBytes; }
  static constexpr int plane_shift(int i, int cv) { return ((i % kStepsPerPlane) * 4 + cv * 2) * kHighBits; }
};

// Nibble step i of a 32-block's quants `qs`: the unsigned quants of k-quads 2i (lo) and 2i + 1 (hi)
// for column vectors 0 and 1, each plane's high bits moved above its nibble.
struct NibbleStep {
  ivec lo0, hi0, lo1, hi1;
};
template <typename F>
__attribute__((always_inline)) inline NibbleStep unpack_step(const uint8_t* qs, int i) {
  const ivec w0 = load_bytes(qs + (2 * i) * kQuadBytes), w1 = load_bytes(qs + (2 * i + 1) * kQuadBytes);
  NibbleStep u{low_nibbles(w0), high_nibbles(w0), low_nibbles(w1), high_nibbles(w1)};
  if constexpr (F::kHighBits > 0) {
    // The plane's fields for this step: (column vector, k-quad) at plane_shift, moved to bit 4.
    const ivec h = load_bytes(qs + F::plane_at(i));
    constexpr uint8_t kMask = ((1 << F::kHighBits) - 1) << 4;
    const int s0 = F::plane_shift(i, 0), s1 = F::plane_shift(i, 1);
    u.lo0 = or_bytes(u.lo0, place_high(h, 4 - s0, kMask));
    u.hi0 = or_bytes(u.hi0, place_high(h, 4 - s0 - F::kHighBits, kMask));
    u.lo1 = or_bytes(u.lo1, place_high(h, 4 - s1, kMask));
    u.hi1 = or_bytes(u.hi1, place_high(h, 4 - s1 - F::kHighBits, kMask));
  }
  return u;
}
// The same step from triples (Form::kTriples): lo0, hi0, lo1 in bits 0-5 of vectors 0, 1, 2, and
// bits 2v, 2v + 1 of hi1 in bits 6-7 of vector v (masked before the 16-bit shifts: no bit crosses
// into the next byte).
template <typename F>
__attribute__((always_inline)) inline NibbleStep quants_step(const uint8_t* qs, int i) {
  if constexpr (F::kNibbles) {
    return unpack_step<F>(qs, i);
  } else {
    static_assert(F::kTriples, "a step of nibbles or triples");
    const ivec v0 = load_bytes(qs + (3 * i) * kQuadBytes), v1 = load_bytes(qs + (3 * i + 1) * kQuadBytes),
               v2 = load_bytes(qs + (3 * i + 2) * kQuadBytes);
    const ivec low = splat_i8(0x3F), top = splat_i8(static_cast<char>(0xC0));
    const ivec hi1 = or_bytes(or_bytes(shift_right16(and_bytes(v0, top), 6), shift_right16(and_bytes(v1, top), 4)),
                              shift_right16(and_bytes(v2, top), 2));
    return {and_bytes(v0, low), and_bytes(v1, low), and_bytes(v2, low), hi1};
  }
}

// One column's superblock of a file's block, decoded: u[] = q + bias per input, d and m as fp16
// bits (m with the sign that makes w = D (u - bias) + M), sc/mn per group of the superblock.
struct Decoded {
  uint8_t u[256];
  uint16_t d, m;
  uint8_t sc[16], mn[16];
};

inline uint16_t half_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
constexpr uint16_t kHalfSign = 0x8000;

// One traits row per GGML type: its block (inputs, bytes), the bias of its stored quants, its
// form and how one block decodes; the layouts are gguf/quants.py's dequantize_blocks.
struct Q4_0 {
  static constexpr int kType = 2, kBlock = 32, kTypeSize = 18, kBias = 8;
  using F = Form<4, Scales::kHalf, false>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    for (int i = 0; i < 16; ++i) o.u[i] = s[2 + i] & 15, o.u[i + 16] = s[2 + i] >> 4;
  }
};
struct Q4_1 {
  static constexpr int kType = 3, kBlock = 32, kTypeSize = 20, kBias = 0;
  using F = Form<4, Scales::kHalf, true>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    o.m = half_at(s + 2);
    for (int i = 0; i < 16; ++i) o.u[i] = s[4 + i] & 15, o.u[i + 16] = s[4 + i] >> 4;
  }
};
// Q5_0/Q5_1: the fifth bits in a little-endian uint32, bit j for input j.
inline void decode_q5(const uint8_t* qh_bytes, const uint8_t* qs, uint8_t* u) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, sizeof(qh));
  for (int j = 0; j < 32; ++j)
    u[j] = static_cast<uint8_t>((j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | ((qh >> j) & 1) << 4);
}
struct Q5_0 {
  static constexpr int kType = 6, kBlock = 32, kTypeSize = 22, kBias = 16;
  using F = Form<5, Scales::kHalf, false>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    decode_q5(s + 2, s + 6, o.u);
  }
};
struct Q5_1 {
  static constexpr int kType = 7, kBlock = 32, kTypeSize = 24, kBias = 0;
  using F = Form<5, Scales::kHalf, true>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    o.m = half_at(s + 2);
    decode_q5(s + 4, s + 8, o.u);
  }
};
struct Q8_0 {
  static constexpr int kType = 8, kBlock = 32, kTypeSize = 34, kBias = 128;
  using F = Form<8, Scales::kHalf, false>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    for (int i = 0; i < 32; ++i) o.u[i] = s[2 + i] ^ 0x80;  // int8 q + 128
  }
};
// Q2_K/Q3_K: 2-bit quants, input a * 128 + j * 32 + l at bits 2j of byte a * 32 + l. The loops
// are spelled out with constant shifts so that they vectorize: packing must keep up with the disk.
inline void two_bits(const uint8_t* qs, uint8_t* u) {
  for (int a = 0; a < 2; ++a)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) u[a * 128 + j * 32 + l] = (qs[a * 32 + l] >> (2 * j)) & 3;
}
// Q3_K/Q5_K: one more bit per input, input j * 32 + l at bit j of byte l, worth `value`.
inline void high_bit(const uint8_t* qh, uint8_t value, uint8_t* u) {
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l) u[j * 32 + l] = static_cast<uint8_t>(u[j * 32 + l] + ((qh[l] >> j) & 1) * value);
}
struct Q2_K {
  static constexpr int kType = 10, kBlock = 256, kTypeSize = 84, kBias = 0;
  using F = Form<4, Scales::kSuper16, true>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s + 80);
    o.m = half_at(s + 82) ^ kHalfSign;  // w = d sc q - dmin mn
    for (int g = 0; g < 16; ++g) o.sc[g] = s[g] & 15, o.mn[g] = s[g] >> 4;
    two_bits(s + 16, o.u);
  }
};
struct Q3_K {
  static constexpr int kType = 11, kBlock = 256, kTypeSize = 110, kBias = 4;
  using F = Form<4, Scales::kSuper16, false>;
  static void decode(const uint8_t* s, Decoded& o) {
    const uint8_t *hmask = s, *qs = s + 32, *scales = s + 96;
    o.d = half_at(s + 108);
    // 6-bit scales - 32: low 4 bits in nibbles of bytes 0..7, high 2 in bit pairs of bytes 8..11.
    for (int g = 0; g < 16; ++g) {
      const int low = g < 8 ? scales[g] & 15 : scales[g - 8] >> 4, high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
      o.sc[g] = static_cast<uint8_t>((low | high << 4) - 32);
    }
    // q = low 2 bits - 4 where the hmask bit is clear: u = q + 4.
    two_bits(qs, o.u);
    high_bit(hmask, 4, o.u);
  }
};
// Q4_K/Q5_K: 6-bit scales and mins of 8 sub-blocks in 12 bytes (gguf's get_scale_min).
inline void k_scale_min(const uint8_t* q, Decoded& o) {
  for (int j = 0; j < 4; ++j) {
    o.sc[j] = q[j] & 63;
    o.mn[j] = q[j + 4] & 63;
    o.sc[j + 4] = static_cast<uint8_t>((q[j + 8] & 15) | (q[j] >> 6) << 4);
    o.mn[j + 4] = static_cast<uint8_t>((q[j + 8] >> 4) | (q[j + 4] >> 6) << 4);
  }
}
// Input a * 64 + h * 32 + l of the 4-bit quants: nibble h of byte a * 32 + l.
inline void k_nibbles(const uint8_t* qs, uint8_t* u) {
  for (int a = 0; a < 4; ++a)
    for (int l = 0; l < 32; ++l) u[a * 64 + l] = qs[a * 32 + l] & 15, u[a * 64 + 32 + l] = qs[a * 32 + l] >> 4;
}
struct Q4_K {
  static constexpr int kType = 12, kBlock = 256, kTypeSize = 144, kBias = 0;
  using F = Form<4, Scales::kSuper32, true>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    o.m = half_at(s + 2) ^ kHalfSign;
    k_scale_min(s + 4, o);
    k_nibbles(s + 16, o.u);
  }
};
struct Q5_K {
  static constexpr int kType = 13, kBlock = 256, kTypeSize = 176, kBias = 0;
  using F = Form<5, Scales::kSuper32, true>;
  static void decode(const uint8_t* s, Decoded& o) {
    o.d = half_at(s);
    o.m = half_at(s + 2) ^ kHalfSign;
    k_scale_min(s + 4, o);
    k_nibbles(s + 48, o.u);
    high_bit(s + 16, 16, o.u);
  }
};
struct Q6_K {
  static constexpr int kType = 14, kBlock = 256, kTypeSize = 210, kBias = 32;
  using F = Form<6, Scales::kSuper16, false>;
  static void decode(const uint8_t* s, Decoded& o) {
    const uint8_t *ql = s, *qh = s + 128;
    o.d = half_at(s + 208);
    std::memcpy(o.sc, s + 192, 16);
    // Per half a of 128 inputs: low 4 bits in nibbles of ql[a * 64 ..], high 2 in bit pairs of qh[a * 32 ..].
    for (int a = 0; a < 2; ++a) {
      uint8_t* u = o.u + a * 128;
      for (int l = 0; l < 64; ++l) u[l] = ql[a * 64 + l] & 15, u[64 + l] = ql[a * 64 + l] >> 4;
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l)
          u[j * 32 + l] = static_cast<uint8_t>(u[j * 32 + l] | ((qh[a * 32 + l] >> (2 * j)) & 3) << 4);
    }
  }
};

// Panel p (columns [p NR, p NR + NR) of n) of raw rows (`rows[i]`: row i's blocks) into `dst`, laid out as Form says.
template <typename T>
void pack_panel(const uint8_t* const* rows, int64_t n, int64_t p, int64_t num_super, uint8_t* dst) {
  using F = typename T::F;
  const int64_t cols = std::min<int64_t>(NR, n - p * NR);
  // A whole panel's bytes are all written below, the high-bit planes and triples by OR; an edge
  // panel's missing columns stay zero.
  if (cols < NR || F::kHighBits > 0 || F::kTriples) std::memset(dst, 0, num_super * F::kSuperBytes);
  Decoded dec;
  for (int64_t sb = 0; sb < num_super; ++sb) {
    uint8_t* super = dst + sb * F::kSuperBytes;
    uint16_t* header = reinterpret_cast<uint16_t*>(super);
    for (int64_t j = 0; j < cols; ++j) {
      T::decode(rows[p * NR + j] + sb * T::kTypeSize, dec);
      header[j] = dec.d;
      if constexpr (F::kHasMin) header[NR + j] = dec.m;
      for (int b = 0; b < F::kBlocks; ++b) {
        uint8_t* block = super + F::kHeaderBytes + b * F::kBlockBytes;
        for (int g = 0; g < F::kGroups && F::kScales != Scales::kHalf; ++g) {
          block[g * NR + j] = dec.sc[b * F::kGroups + g];
          if (F::kHasMin) block[(F::kGroups + g) * NR + j] = dec.mn[b * F::kGroups + g];
        }
        // Column j is byte lane (j % W) * 4 of the vectors of column vector j / W.
        uint8_t* lane = block + F::kScaleBytes + (j / W) * kQuadBytes + (j % W) * 4;
        const uint8_t* u = dec.u + b * QK;
        if constexpr (F::kNibbles) {
          // k-quads 2i (low nibbles) and 2i + 1 (high) share the vector of 8i..8i + 7. Four bytes
          // at a time in one 32-bit word: no field crosses a byte (shift + 2 kHighBits <= 8).
          constexpr uint32_t kNibble = 0x0F0F0F0Fu, kHigh = 0x01010101u * ((1u << F::kHighBits) - 1);
          for (int i = 0; i < QUADS / 2; ++i) {
            uint32_t lo, hi;
            std::memcpy(&lo, u + 8 * i, 4);
            std::memcpy(&hi, u + 8 * i + 4, 4);
            const uint32_t nibbles = (lo & kNibble) | (hi & kNibble) << 4;
            std::memcpy(lane + i * 2 * kQuadBytes, &nibbles, 4);
            if constexpr (F::kHighBits > 0) {
              uint8_t* plane = block + F::kScaleBytes + F::plane_at(i) + (j % W) * 4;
              const int shift = F::plane_shift(i, static_cast<int>(j / W));
              uint32_t bits;
              std::memcpy(&bits, plane, 4);
              bits |= ((lo >> 4) & kHigh) << shift | ((hi >> 4) & kHigh) << (shift + F::kHighBits);
              std::memcpy(plane, &bits, 4);
            }
          }
        } else if constexpr (F::kTriples) {
          // Step i's vectors 3i .. 3i + 2 (quants_step): this column's lane in each.
          uint8_t* lanes = block + F::kScaleBytes + (j % W) * 4;
          for (int i = 0; i < QUADS / 2; ++i)
            for (int r = 0; r < 4; ++r) {
              uint8_t* v = lanes + 3 * i * kQuadBytes + r;
              const uint8_t lo = u[8 * i + r], hi = u[8 * i + 4 + r];
              if (j < W) {
                v[0] |= lo;
                v[kQuadBytes] |= hi;
              } else {
                v[2 * kQuadBytes] |= lo;
                for (int part = 0; part < 3; ++part) v[part * kQuadBytes] |= ((hi >> (2 * part)) & 3) << 6;
              }
            }
        } else {
          for (int q = 0; q < QUADS; ++q) std::memcpy(lane + q * 2 * kQuadBytes, u + 4 * q, 4);
        }
      }
    }
  }
}

// Row j of panel `panel` back to float32: w = D (u - bias) + M with D = d (times the group's
// scale) and M = m (times its min), the very values the file's blocks dequantize to (an embedding
// looked up from the same panels a tied head multiplies by).
template <typename T>
void unpack_row(const uint8_t* panel, int64_t j, int64_t num_super, float* out) {
  using F = typename T::F;
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* super = panel + sb * F::kSuperBytes;
    const uint16_t* header = reinterpret_cast<const uint16_t*>(super);
    const float d = c10::detail::fp16_ieee_to_fp32_value(header[j]);
    const float m = F::kHasMin ? c10::detail::fp16_ieee_to_fp32_value(header[NR + j]) : 0.f;
    for (int b = 0; b < F::kBlocks; ++b) {
      const uint8_t* block = super + F::kHeaderBytes + b * F::kBlockBytes;
      const uint8_t* lane = block + F::kScaleBytes + (j / W) * kQuadBytes + (j % W) * 4;
      uint8_t u[QK];
      if constexpr (F::kNibbles) {
        for (int i = 0; i < QUADS / 2; ++i)
          for (int r = 0; r < 4; ++r) {
            const uint8_t byte = lane[i * 2 * kQuadBytes + r];
            u[8 * i + r] = byte & 15;
            u[8 * i + 4 + r] = byte >> 4;
            if constexpr (F::kHighBits > 0) {
              constexpr int kHighMask = (1 << F::kHighBits) - 1;
              const int shift = F::plane_shift(i, static_cast<int>(j / W));
              const int high = block[F::kScaleBytes + F::plane_at(i) + (j % W) * 4 + r];
              u[8 * i + r] = static_cast<uint8_t>(u[8 * i + r] | ((high >> shift) & kHighMask) << 4);
              u[8 * i + 4 + r] =
                  static_cast<uint8_t>(u[8 * i + 4 + r] | ((high >> (shift + F::kHighBits)) & kHighMask) << 4);
            }
          }
      } else if constexpr (F::kTriples) {
        const uint8_t* lanes = block + F::kScaleBytes + (j % W) * 4;
        for (int i = 0; i < QUADS / 2; ++i)
          for (int r = 0; r < 4; ++r) {
            const uint8_t* v = lanes + 3 * i * kQuadBytes + r;
            if (j < W) {
              u[8 * i + r] = v[0] & 63;
              u[8 * i + 4 + r] = v[kQuadBytes] & 63;
            } else {
              u[8 * i + r] = v[2 * kQuadBytes] & 63;
              u[8 * i + 4 + r] =
                  static_cast<uint8_t>(v[0] >> 6 | (v[kQuadBytes] >> 6) << 2 | (v[2 * kQuadBytes] >> 6) << 4);
            }
          }
      } else {
        for (int q = 0; q < QUADS; ++q) std::memcpy(u + 4 * q, lane + q * 2 * kQuadBytes, 4);
      }
      float* dst = out + (sb * F::kBlocks + b) * QK;
      for (int i = 0; i < QK; ++i) {
        float D = d, M = m;
        if constexpr (F::kScales == Scales::kSuper32) {
          D = d * static_cast<float>(block[j]);
          M = m * static_cast<float>(block[NR + j]);
        } else if constexpr (F::kScales == Scales::kSuper16) {
          const int g = i / F::kGroup;
          D = d * static_cast<float>(static_cast<int8_t>(block[g * NR + j]));
          if constexpr (F::kHasMin) M = m * static_cast<float>(block[(F::kGroups + g) * NR + j]);
        }
        // D q is exact (at most 21 bits), so D q + M rounds once, as gguf's d q + m, FMA or not.
        dst[i] = D * static_cast<float>(static_cast<int>(u[i]) - T::kBias) + M;
      }
    }
  }
}

// ---- Activations ------------------------------------------------------------------------------

// Per row and 32-block of x: da, and for the block, its first and its last 16 inputs (the groups
// of super16 types) the int32 sum's start -bias sum(qa), da sum(qa) (the offsets' factor) and da
// times that start (the bias term of a superblock summed from zero).
struct ActBlock {
  float da;
  int32_t init[3];
  float da_sum[3];
  float da_init[3];
};

// x quantized per 32 inputs, by row block of up to MR_MAX rows: qa [row blocks][K / 4][MR_MAX][4]
// and blocks [row blocks][K / 32][MR_MAX].
struct Activations {
  const int8_t* qa;
  const ActBlock* blocks;
  int64_t k, num_blocks;
};

// Rows [r0, r1) of x into the layout above, for weights stored with `bias`; `span` 32-blocks share
// one scale (8 for the K-quants whose kernel sums a superblock in int32: llama.cpp's Q8_K).
void quantize_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, const RowBlocks& blocks,
                   int32_t bias, int span, int8_t* qa, ActBlock* act) {
  const int64_t num_blocks = k / QK;
  constexpr int kVectors = QK / W;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t rb = blocks.block_of(r), lane = r - blocks.start(rb);
    const float* row = x + r * ldx;
    float d = 0.f, id = 0.f;
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (b % span == 0) {
        vfloat amax{};
        for (int i = 0; i < span * kVectors; ++i) {
          const vfloat v = vload(row + b * QK + i * W);
          amax = vmax(amax, v < vfloat{} ? -v : v);
        }
        // As llama.cpp's quantize_row_q8_1: the scale, then its inverse, so that |qa| <= 127.
        d = hmax(amax) / 127.f;
        id = d != 0.f ? 1.f / d : 0.f;
      }
      int8_t q[QK];
      vint sum[2] = {};
      for (int i = 0; i < kVectors; ++i) {
        const vint t = round_to_int(vload(row + b * QK + i * W) * id);
        sum[i >= kVectors / 2] += t;
        const vbyte bytes = __builtin_convertvector(t, vbyte);
        std::memcpy(q + i * W, &bytes, sizeof(bytes));
      }
      // |sum| < 2^24: exact in float, and a shuffle reduction rather than W lane extractions.
      const int32_t lo = static_cast<int32_t>(hsum(to_float(sum[0]))),
                    hi = static_cast<int32_t>(hsum(to_float(sum[1])));
      int8_t* dst = qa + (rb * (k / 4) + b * QUADS) * MR_MAX * 4 + lane * 4;
      for (int j = 0; j < QUADS; ++j) std::memcpy(dst + j * MR_MAX * 4, q + j * 4, 4);
      ActBlock& a = act[(rb * num_blocks + b) * MR_MAX + lane];
      const int32_t sums[3] = {lo + hi, lo, hi};
      a.da = d;
      for (int i = 0; i < 3; ++i) {
        a.init[i] = -bias * sums[i];
        a.da_sum[i] = d * static_cast<float>(sums[i]);
        a.da_init[i] = d * static_cast<float>(a.init[i]);
      }
    }
  }
}

// ---- Micro-tiles ------------------------------------------------------------------------------

// kGated: the panel's first W columns are gate sums, the other W the same outputs' up sums;
// stores act(gate) * up (vec.h's `gated`). kMulGated (W = 8, where a group of 16 gate rows fills a
// panel): this is an up panel, and c already holds the gate sums, stored by the gate panel's tile.
enum Epilogue { kStore, kGated, kMulGated };
constexpr Epilogue kPairEpilogue = W >= 16 ? kGated : kMulGated;

// The next panel's superblock, spread over this one's blocks: a fixed count per block, unrolled
// (a loop to the superblock's exact end cost as many instructions as the block's arithmetic).
template <typename F>
__attribute__((always_inline)) inline void prefetch_share(const uint8_t* ahead, int64_t sb, int j) {
  constexpr int kLines = static_cast<int>((F::kSuperBytes / 64 + F::kBlocks - 1) / F::kBlocks);
  if (ahead == nullptr) return;
  const uint8_t* next = ahead + sb * F::kSuperBytes + j * kLines * 64;
#pragma GCC unroll 32
  for (int line = 0; line < kLines; ++line) __builtin_prefetch(next + line * 64, 0, 2);
}

// acc += the panel's superblocks times the rows' activations (qa, ab: the row block's), a group's
// int32 sums folded into float once per group.
template <typename F, int R>
__attribute__((always_inline)) inline void group_superblocks(const uint8_t* panel, int64_t num_super, const int8_t* qa,
                                                             const ActBlock* ab, const uint8_t* ahead,
                                                             vfloat (&acc0)[R], vfloat (&acc1)[R]) {
  static_assert(!F::kTriples, "triples are summed fused");
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* super = panel + sb * F::kSuperBytes;
    const uint16_t* header = reinterpret_cast<const uint16_t*>(super);
    const uint8_t* block = super + F::kHeaderBytes;
    for (int j = 0; j < F::kBlocks; ++j, block += F::kBlockBytes, qa += QK * MR_MAX, ab += MR_MAX) {
      prefetch_share<F>(ahead, sb, j);
      const uint8_t* qs = block + F::kScaleBytes;
      // Unrolled whole, or the accumulators of a group live in memory (GCC keeps the super16 loops).
#pragma GCC unroll 2
      for (int g = 0; g < F::kGroups; ++g) {
        const int sum_index = F::kGroups == 1 ? 0 : 1 + g;
        ivec i0[R], i1[R];
        for (int r = 0; r < R; ++r) i0[r] = i1[r] = splat_i32(ab[r].init[sum_index]);
        if constexpr (F::kNibbles) {
#pragma GCC unroll 4
          for (int i = g * F::kGroup / 8; i < (g + 1) * F::kGroup / 8; ++i) {
            const NibbleStep u = unpack_step<F>(qs, i);
            for (int r = 0; r < R; ++r) {
              const ivec a_lo = splat_i32(quad_at(qa + ((2 * i) * MR_MAX + r) * 4));
              const ivec a_hi = splat_i32(quad_at(qa + ((2 * i + 1) * MR_MAX + r) * 4));
              i0[r] = dot_quads2(i0[r], u.lo0, a_lo, u.hi0, a_hi);
              i1[r] = dot_quads2(i1[r], u.lo1, a_lo, u.hi1, a_hi);
            }
          }
        } else {
#pragma GCC unroll 8
          for (int q = g * F::kGroup / 4; q < (g + 1) * F::kGroup / 4; ++q) {
            const ivec w0 = load_bytes(qs + (2 * q) * kQuadBytes), w1 = load_bytes(qs + (2 * q + 1) * kQuadBytes);
            for (int r = 0; r < R; ++r) {
              const ivec a = splat_i32(quad_at(qa + (q * MR_MAX + r) * 4));
              i0[r] = dot_bytes(i0[r], w0, a);
              i1[r] = dot_bytes(i1[r], w1, a);
            }
          }
        }
        // The group's D and M, shared by the rows.
        vfloat d0 = load_half(header), d1 = load_half(header + W), m0{}, m1{};
        if constexpr (F::kHasMin) {
          m0 = load_half(header + NR);
          m1 = load_half(header + NR + W);
        }
        if constexpr (F::kScales == Scales::kSuper32) {
          d0 *= to_float(widen(block));
          d1 *= to_float(widen(block + W));
          m0 *= to_float(widen(block + NR));
          m1 *= to_float(widen(block + NR + W));
        } else if constexpr (F::kScales == Scales::kSuper16) {
          const int8_t* sc = reinterpret_cast<const int8_t*>(block) + g * NR;
          d0 *= to_float(widen(sc));
          d1 *= to_float(widen(sc + W));
          if constexpr (F::kHasMin) {
            const uint8_t* mn = block + (F::kGroups + g) * NR;
            m0 *= to_float(widen(mn));
            m1 *= to_float(widen(mn + W));
          }
        }
        for (int r = 0; r < R; ++r) {
          const vfloat da = vsplat(ab[r].da);
          // Separate updates: FMAs, where one expression would take an FMA and an add.
          acc0[r] += to_float((vint)i0[r]) * (d0 * da);
          acc1[r] += to_float((vint)i1[r]) * (d1 * da);
          if constexpr (F::kHasMin) {
            const vfloat da_sum = vsplat(ab[r].da_sum[sum_index]);
            acc0[r] += m0 * da_sum;
            acc1[r] += m1 * da_sum;
          }
        }
      }
    }
  }
}

// The same, for a K-quant without VNNI: a superblock sums in int32 under its one activation scale.
#if !PAGELLM_VNNI
template <typename F, int R>
__attribute__((always_inline)) inline void fused_superblocks(const uint8_t* panel, int64_t num_super, const int8_t* qa,
                                                             const ActBlock* ab, const uint8_t* ahead,
                                                             vfloat (&acc0)[R], vfloat (&acc1)[R]) {
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* super = panel + sb * F::kSuperBytes;
    const uint16_t* header = reinterpret_cast<const uint16_t*>(super);
    const uint8_t* block = super + F::kHeaderBytes;
    const ActBlock* ab_super = ab;
    // |sum| per lane: 32 steps x 2 int16 halves x (2 x 2 x 63 x 127) x 128 < 2^29.
    ivec s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = splat_i32(0);
    for (int j = 0; j < F::kBlocks; ++j, block += F::kBlockBytes, qa += QK * MR_MAX, ab += MR_MAX) {
      prefetch_share<F>(ahead, sb, j);
      const uint8_t* qs = block + F::kScaleBytes;
#pragma GCC unroll 2
      for (int g = 0; g < F::kGroups; ++g) {
        // A column's group scale in both int16 halves of its lanes: vpmaddwd scales the pair sums.
        vint w0, w1;
        if constexpr (F::kScales == Scales::kSuper32) {
          w0 = widen(block), w1 = widen(block + W);
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(block) + g * NR;
          w0 = widen(sc), w1 = widen(sc + W);
        }
        const ivec sc0 = (ivec)((w0 & 0xFFFF) | w0 * 0x10000), sc1 = (ivec)((w1 & 0xFFFF) | w1 * 0x10000);
        // The pair sums of up to F::kSumSteps steps meet in int16 before one vpmaddwd: the multiply
        // ports, which vpmaddubsw and vpmaddwd share, are what bounds this loop.
        ivec t0[R], t1[R];
#pragma GCC unroll 4
        for (int i = g * F::kGroup / 8; i < (g + 1) * F::kGroup / 8; ++i) {
          const NibbleStep u = quants_step<F>(qs, i);
          const bool first = i % F::kSumSteps == 0, last = (i + 1) % F::kSumSteps == 0;
          for (int r = 0; r < R; ++r) {
            const ivec a_lo = splat_i32(quad_at(qa + ((2 * i) * MR_MAX + r) * 4));
            const ivec a_hi = splat_i32(quad_at(qa + ((2 * i + 1) * MR_MAX + r) * 4));
            const ivec p0 = add16(pairs16(u.lo0, a_lo), pairs16(u.hi0, a_hi));
            const ivec p1 = add16(pairs16(u.lo1, a_lo), pairs16(u.hi1, a_hi));
            if constexpr (F::kSumSteps == 1) {  // spelled apart: the general form spills more here (Q6_K)
              s0[r] = scaled_pairs32(s0[r], p0, sc0);
              s1[r] = scaled_pairs32(s1[r], p1, sc1);
            } else {
              t0[r] = first ? p0 : add16(t0[r], p0);
              t1[r] = first ? p1 : add16(t1[r], p1);
              computed_here(t0[r]);
              computed_here(t1[r]);
              if (last) {
                s0[r] = scaled_pairs32(s0[r], t0[r], sc0);
                s1[r] = scaled_pairs32(s1[r], t1[r], sc1);
              }
            }
          }
        }
      }
    }
    // Once per superblock: d da times the scaled sums; then per group the terms of its offset,
    // M sum(x) with M = m mn (mins) or -bias D sum(qa) da (quants stored with a bias).
    const vfloat d0 = load_half(header), d1 = load_half(header + W);
    for (int r = 0; r < R; ++r) {
      const vfloat da = vsplat(ab_super[r].da);
      acc0[r] += to_float((vint)s0[r]) * (d0 * da);
      acc1[r] += to_float((vint)s1[r]) * (d1 * da);
    }
    vfloat m0{}, m1{};
    if constexpr (F::kHasMin) m0 = load_half(header + NR), m1 = load_half(header + NR + W);
    const uint8_t* scales = super + F::kHeaderBytes;
    for (int j = 0; j < F::kBlocks; ++j, scales += F::kBlockBytes) {
#pragma GCC unroll 2
      for (int g = 0; g < F::kGroups; ++g) {
        const int sum_index = F::kGroups == 1 ? 0 : 1 + g;
        if constexpr (F::kHasMin) {
          const uint8_t* mn = scales + (F::kGroups + g) * NR;
          const vfloat mn0 = m0 * to_float(widen(mn)), mn1 = m1 * to_float(widen(mn + W));
          for (int r = 0; r < R; ++r) {
            const vfloat da_sum = vsplat(ab_super[j * MR_MAX + r].da_sum[sum_index]);
            acc0[r] += mn0 * da_sum;
            acc1[r] += mn1 * da_sum;
          }
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(scales) + g * NR;
          const vfloat dsc0 = d0 * to_float(widen(sc)), dsc1 = d1 * to_float(widen(sc + W));
          for (int r = 0; r < R; ++r) {
            const vfloat da_init = vsplat(ab_super[j * MR_MAX + r].da_init[sum_index]);
            acc0[r] += dsc0 * da_init;
            acc1[r] += dsc1 * da_init;
          }
        }
      }
    }
  }
}
#else
template <typename F, int R>
inline void fused_superblocks(const uint8_t*, int64_t, const int8_t*, const ActBlock*, const uint8_t*, vfloat (&)[R],
                              vfloat (&)[R]) {
  static_assert(sizeof(F) == 0, "VNNI sums per group (Form::kFused is false)");
}
#endif

// out[r0 + r] = bias + x_r W^T for the R rows of row block `rb` (from row r0) and one panel (`ncols`
// of its columns stored), or as the epilogue says. `ahead` (the next panel, or null) is pulled
// towards the cache a block at a time while this one is multiplied.
template <typename F, int R, Epilogue E>
void micro_tile(const Activations& act, int64_t rb, int64_t r0, const uint8_t* panel, const float* bias0,
                const float* bias1, float* c, int64_t ldc, int ncols, const uint8_t* ahead, int64_t gated_act) {
  vfloat acc0[R], acc1[R];
  const vfloat b0 = bias0 != nullptr ? vload(bias0) : vfloat{}, b1 = bias1 != nullptr ? vload(bias1) : vfloat{};
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  const int8_t* qa = act.qa + rb * act.k * MR_MAX;
  const ActBlock* ab = act.blocks + rb * act.num_blocks * MR_MAX;
  const int64_t num_super = act.num_blocks / F::kBlocks;
  if constexpr (F::kFused) {
    fused_superblocks<F, R>(panel, num_super, qa, ab, ahead, acc0, acc1);
  } else {
    group_superblocks<F, R>(panel, num_super, qa, ab, ahead, acc0, acc1);
  }
  float edge[NR];
  for (int r = 0; r < R; ++r) {
    float* row = c + (r0 + r) * ldc;
    if constexpr (E == kGated) {
      vstore(row, gated(gated_act, acc0[r], acc1[r]));
    } else if constexpr (E == kMulGated) {
      vstore(row, gated(gated_act, vload(row), acc0[r]));
      vstore(row + W, gated(gated_act, vload(row + W), acc1[r]));
    } else if (ncols == NR) {
      vstore(row, acc0[r]);
      vstore(row + W, acc1[r]);
    } else {
      vstore(edge, acc0[r]);
      vstore(edge + W, acc1[r]);
      std::memcpy(row, edge, ncols * sizeof(float));
    }
  }
}

using MicroTile = void (*)(const Activations&, int64_t, int64_t, const uint8_t*, const float*, const float*, float*,
                           int64_t, int, const uint8_t*, int64_t);
// [plain, gate/up pair][rows - 1]
using TileTable = std::array<std::array<MicroTile, MR_MAX>, 2>;

template <typename F, Epilogue E, size_t... I>
constexpr std::array<MicroTile, sizeof...(I)> make_tiles(std::index_sequence<I...>) {
  return {&micro_tile<F, static_cast<int>(I) + 1, E>...};
}
template <typename F>
constexpr TileTable kTilesOf = {make_tiles<F, kStore>(std::make_index_sequence<MR_MAX>{}),
                                make_tiles<F, kPairEpilogue>(std::make_index_sequence<MR_MAX>{})};

// What the ops need of a type at run time.
struct TypeInfo {
  int type, block, type_size, bias, act_span;
  int64_t super_bytes;  // per panel and file block (superblock)
  const TileTable* tiles;
  void (*pack)(const uint8_t* const*, int64_t, int64_t, int64_t, uint8_t*);
  void (*unpack)(const uint8_t*, int64_t, int64_t, float*);
};
template <typename T>
constexpr TypeInfo info_of() {
  static_assert(!T::F::kFused || T::kBias == 0 || !T::F::kHasMin, "a fused superblock has a bias or mins, not both");
  return {T::kType,
          T::kBlock,
          T::kTypeSize,
          activation_bias<typename T::F>(T::kBias),
          T::F::kActSpan,
          T::F::kSuperBytes,
          &kTilesOf<typename T::F>,
          &pack_panel<T>,
          &unpack_row<T>};
}
constexpr std::array<TypeInfo, 10> kTypes = {info_of<Q4_0>(), info_of<Q4_1>(), info_of<Q5_0>(), info_of<Q5_1>(),
                                             info_of<Q8_0>(), info_of<Q2_K>(), info_of<Q3_K>(), info_of<Q4_K>(),
                                             info_of<Q5_K>(), info_of<Q6_K>()};

const TypeInfo* find_type(int64_t ggml_type) {
  for (const TypeInfo& t : kTypes)
    if (t.type == ggml_type) return &t;
  return nullptr;
}

// Quantizing is a serial pass over x before the panels' threads start; from this many rows on it
// is split over the threads too (waking them costs less than the pass).
constexpr int64_t kQuantizeParallelRows = 16;

// One product's panels [first, last) over all its row blocks: what linear_int8 runs per chunk and
// moe_int8 per (expert, panel chunk) task, so both give the same sums in the same order.
struct PanelProduct {
  const Activations* act;
  const RowBlocks* row_blocks;
  const TileTable* tiles;
  const uint8_t* w;
  int64_t panel_bytes, n;  // n: output columns
  int64_t activation;      // vec.h's GatedAct; kActNone for a plain product
  const float* bias;       // or null
  float* c;
  int64_t ldc;
};

// With W < 16 a gate/up group of 32 rows is two panels, run by one thread: gate, then up.
inline bool pairs_of(bool gate_up) { return gate_up && kPairEpilogue == kMulGated; }

void run_panels(const PanelProduct& pr, int64_t first, int64_t last) {
  const bool gate_up = pr.activation != kActNone, pairs = pairs_of(gate_up);
  const float* bias_ptr = pr.bias;
  const int64_t n = pr.n;
  float* c = pr.c;
  float edge[NR];
  for (int64_t p = first; p < last; ++p) {
    const uint8_t* panel = pr.w + p * pr.panel_bytes;
    const bool up = pairs && p % 2 == 1;
    int ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR));
    float* c_panel = c + p * NR;
    const float *b0 = nullptr, *b1 = nullptr;
    if (pairs) {
      // Panel 2g holds gate outputs [16g, 16g + 16), panel 2g + 1 the same outputs' up rows.
      ncols = NR;
      c_panel = c + (p / 2) * NR;
      if (bias_ptr != nullptr) b0 = bias_ptr + (up ? n : 0) + (p / 2) * NR;
    } else if (gate_up) {
      c_panel = c + p * W;
      if (bias_ptr != nullptr) b0 = bias_ptr + p * W, b1 = bias_ptr + n + p * W;
    } else if (bias_ptr != nullptr) {
      std::memset(edge, 0, sizeof(edge));
      std::memcpy(edge, bias_ptr + p * NR, ncols * sizeof(float));
      b0 = edge;
    }
    if (b0 != nullptr && b1 == nullptr) b1 = b0 + W;
    const MicroTile* row_tiles = (*pr.tiles)[gate_up && (!pairs || up)].data();
    // The first row block pulls in the next panel (the hardware prefetcher stops at pages).
    const uint8_t* ahead = p + 1 < last ? panel + pr.panel_bytes : nullptr;
    for (int64_t rb = 0; rb < pr.row_blocks->count; ++rb) {
      row_tiles[pr.row_blocks->rows(rb) - 1](*pr.act, rb, pr.row_blocks->start(rb), panel, b0, b1, c_panel, pr.ldc,
                                             ncols, rb == 0 ? ahead : nullptr, pr.activation);
    }
  }
}

#if defined(PAGELLM_AMX) && defined(PAGELLM_BF16_ROWS)
static_assert(NR == kBf16PanelCols, "an int8 panel dequantizes to one bfloat16 panel");

// A wide product (a prefill's rows) is compute-bound, and AMX's bfloat16 tiles do about five times
// the int8 kernel's multiply-adds here: from this many rows each panel's blocks are dequantized to
// a bfloat16 panel (weights rounded once: relative error 2^-9, as a bfloat16 checkpoint's) and x
// rounded to bfloat16, instead of quantized to int8 per 32.
constexpr int64_t kAmxMinRowsInt8 = 64;

// Panel `panel` (NR columns, num_super file blocks of inputs) as bfloat16 pairs [k / 2, NR, 2]:
// w = D (u - bias) + M per weight, computed as the kernel's tiles decode it (one rounding: gguf's
// float32 value) and rounded to bfloat16. A k-quad vector holds 16 columns x 4 inputs; each of its
// quarters (4 columns) becomes 16 floats, and two permutes split their (k, k + 1) pairs into the
// panel's two pair rows.
template <typename T>
void dequantize_panel_bf16(const uint8_t* panel, int64_t num_super, uint16_t* dst) {
  using F = typename T::F;
  static_assert(!F::kTriples, "AMX builds have VNNI: no triples");
  uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i lane_column =
      _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2);
  const __m512i bias = _mm512_set1_epi32(T::kBias);
  __m512 dq[2][4], mq[2][4];  // per column vector and quarter: each lane's column's D and M
  auto weights = [&](__m128i u, __m512 d, __m512 m) {
    return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(u), bias)), m);
  };
  // The 64 quants of column vector cv at inputs [k0, k0 + 4).
  auto emit = [&](__m512i u, int cv, int64_t k0) {
    const __m512 f0 = weights(_mm512_extracti32x4_epi32(u, 0), dq[cv][0], mq[cv][0]);
    const __m512 f1 = weights(_mm512_extracti32x4_epi32(u, 1), dq[cv][1], mq[cv][1]);
    const __m512 f2 = weights(_mm512_extracti32x4_epi32(u, 2), dq[cv][2], mq[cv][2]);
    const __m512 f3 = weights(_mm512_extracti32x4_epi32(u, 3), dq[cv][3], mq[cv][3]);
    const __m512i a = (__m512i)_mm512_cvtne2ps_pbh(f1, f0), b = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);
    uint32_t* row = pairs + (k0 / 2) * NR + cv * W;
    _mm512_storeu_si512(row, _mm512_permutex2var_epi32(a, even, b));
    _mm512_storeu_si512(row + NR, _mm512_permutex2var_epi32(a, odd, b));
  };
  for (int64_t sb = 0; sb < num_super; ++sb) {
    const uint8_t* super = panel + sb * F::kSuperBytes;
    const uint16_t* header = reinterpret_cast<const uint16_t*>(super);
    const uint8_t* block = super + F::kHeaderBytes;
    for (int j = 0; j < F::kBlocks; ++j, block += F::kBlockBytes) {
      const uint8_t* qs = block + F::kScaleBytes;
      const int64_t kb = (sb * F::kBlocks + j) * QK;
      for (int g = 0; g < F::kGroups; ++g) {
        for (int cv = 0; cv < 2; ++cv) {
          vfloat d = load_half(header + cv * W), m{};
          if constexpr (F::kHasMin) m = load_half(header + NR + cv * W);
          if constexpr (F::kScales == Scales::kSuper32) {
            d *= to_float(widen(block + cv * W));
            m *= to_float(widen(block + NR + cv * W));
          } else if constexpr (F::kScales == Scales::kSuper16) {
            d *= to_float(widen(reinterpret_cast<const int8_t*>(block) + g * NR + cv * W));
            if constexpr (F::kHasMin) m *= to_float(widen(block + (F::kGroups + g) * NR + cv * W));
          }
          for (int q = 0; q < 4; ++q) {
            const __m512i columns = _mm512_add_epi32(lane_column, _mm512_set1_epi32(4 * q));
            dq[cv][q] = _mm512_permutexvar_ps(columns, (__m512)d);
            mq[cv][q] = _mm512_permutexvar_ps(columns, (__m512)m);
          }
        }
        if constexpr (F::kNibbles) {
          for (int i = g * F::kGroup / 8; i < (g + 1) * F::kGroup / 8; ++i) {
            const NibbleStep u = unpack_step<F>(qs, i);
            emit(u.lo0, 0, kb + 8 * i);
            emit(u.hi0, 0, kb + 8 * i + 4);
            emit(u.lo1, 1, kb + 8 * i);
            emit(u.hi1, 1, kb + 8 * i + 4);
          }
        } else {
          for (int q = g * F::kGroup / 4; q < (g + 1) * F::kGroup / 4; ++q) {
            emit(load_bytes(qs + (2 * q) * kQuadBytes), 0, kb + 4 * q);
            emit(load_bytes(qs + (2 * q + 1) * kQuadBytes), 1, kb + 4 * q);
          }
        }
      }
    }
  }
}

using PanelToBf16 = void (*)(const uint8_t*, int64_t, uint16_t*);
constexpr std::array<std::pair<int, PanelToBf16>, 10> kPanelToBf16 = {{
    {Q4_0::kType, &dequantize_panel_bf16<Q4_0>},
    {Q4_1::kType, &dequantize_panel_bf16<Q4_1>},
    {Q5_0::kType, &dequantize_panel_bf16<Q5_0>},
    {Q5_1::kType, &dequantize_panel_bf16<Q5_1>},
    {Q8_0::kType, &dequantize_panel_bf16<Q8_0>},
    {Q2_K::kType, &dequantize_panel_bf16<Q2_K>},
    {Q3_K::kType, &dequantize_panel_bf16<Q3_K>},
    {Q4_K::kType, &dequantize_panel_bf16<Q4_K>},
    {Q5_K::kType, &dequantize_panel_bf16<Q5_K>},
    {Q6_K::kType, &dequantize_panel_bf16<Q6_K>},
}};

PanelToBf16 panel_to_bf16(int type) {
  for (const auto& [t, fn] : kPanelToBf16)
    if (t == type) return fn;
  return nullptr;
}

void linear_int8_amx(const TypeInfo& t, const float* x, int64_t ldx, int64_t m, int64_t k, const uint8_t* w,
                     int64_t panels, int64_t panel_bytes, int64_t n, const float* bias, int64_t activation, float* c,
                     int64_t ldc) {
  thread_local std::vector<uint16_t> xb;
  const AmxRows rows = amx_rows(x, ldx, m, k, xb);
  const bool gate_up = activation != kActNone;
  const PanelToBf16 to_bf16 = panel_to_bf16(t.type);
  auto run = [&](auto gated_tag) {
    constexpr bool kGated = decltype(gated_tag)::value;
    parallel_panels(panels, [&](int64_t begin, int64_t end) {
      // Per thread: one panel in bfloat16 (L2-sized at these widths).
      thread_local std::vector<uint16_t> panel_bf16;
      panel_bf16.resize(NR * k);
      auto panel_of = [&](int64_t p) {
        to_bf16(w + p * panel_bytes, k / t.block, panel_bf16.data());
        return static_cast<const uint16_t*>(panel_bf16.data());
      };
      auto place = [&](int64_t p, int* ncols, float** dst, const float** b0, const float** b1) {
        if constexpr (kGated) {
          // Panel p: gate outputs [16p, 16p + 16) in its first 16 columns, their up rows after.
          *ncols = W, *dst = c + p * W;
          if (bias != nullptr) *b0 = bias + p * W, *b1 = bias + n + p * W;
        } else {
          *ncols = static_cast<int>(std::min<int64_t>(NR, n - p * NR)), *dst = c + p * NR;
          if (bias != nullptr) *b0 = bias + p * NR, *b1 = *b0 + W;
        }
      };
      amx_panels<kGated>(rows, begin, end, c, ldc, activation, panel_of, place);
    });
  };
  if (gate_up) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
}
#endif  // PAGELLM_AMX

#else
struct TypeInfo {
  int type, block, type_size, bias, act_span;
};
const TypeInfo* find_type(int64_t) { return nullptr; }
#endif  // PAGELLM_INT8

bool int8_supported() { return PAGELLM_INT8 != 0; }

std::vector<int64_t> int8_types() {
  std::vector<int64_t> types;
#if PAGELLM_INT8
  for (const TypeInfo& t : kTypes) types.push_back(t.type);
#endif
  return types;
}

const TypeInfo& checked_type(int64_t ggml_type, const char* op) {
  const TypeInfo* t = find_type(ggml_type);
  TORCH_CHECK_VALUE(t != nullptr, op, ": GGML type ", ggml_type, " is not one this build's int8 kernel takes",
                    PAGELLM_INT8 ? "" : " (it has no int8 dot products: needs AVX2 or AVX512-BW)");
  return *t;
}

int64_t int8_activation_span(int64_t ggml_type) {
  return checked_type(ggml_type, "int8_activation_span").act_span * QK;
}

// parts: uint8 [N_i, row bytes] each, rows of one output's blocks as the file stores them; the
// weight is their rows one after another, read in place (a fused projection's shards are not
// concatenated first). interleave > 0: the rows' first half (gate) and second half (up) are
// taken alternately in groups of that many rows, the order a fused gated activation needs.
at::Tensor pack_weight_int8(const std::vector<at::Tensor>& parts, int64_t ggml_type, int64_t in_features,
                            int64_t interleave) {
  const TypeInfo& t = checked_type(ggml_type, "pack_weight_int8");
  TORCH_CHECK_VALUE(!parts.empty(), "pack_weight_int8: no rows");
  TORCH_CHECK_VALUE(in_features > 0 && in_features % t.block == 0, "pack_weight_int8: in_features (", in_features,
                    ") must be a positive multiple of the type's block of ", t.block);
  const int64_t num_super = in_features / t.block;
  std::vector<const uint8_t*> rows;
  for (const at::Tensor& raw : parts) {
    TORCH_CHECK_VALUE(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.stride(1) == 1 &&
                          raw.size(0) > 0,
                      "pack_weight_int8: raw must be a 2-D uint8 CPU tensor of rows of blocks, with contiguous rows");
    TORCH_CHECK_VALUE(raw.size(1) == num_super * t.type_size, "pack_weight_int8: rows of ", raw.size(1), " bytes, but ",
                      in_features, " inputs take ", num_super * t.type_size);
    const uint8_t* base = raw.data_ptr<uint8_t>();
    for (int64_t i = 0; i < raw.size(0); ++i) rows.push_back(base + i * raw.stride(0));
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  if (interleave > 0) {
    TORCH_CHECK_VALUE(n % (2 * interleave) == 0, "pack_weight_int8: ", n,
                      " rows do not split into gate and up groups of ", interleave);
    std::vector<const uint8_t*> order(n);
    const int64_t half = n / 2;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t group = r / (2 * interleave), within = r % (2 * interleave);
      order[r] = within < interleave ? rows[group * interleave + within]
                                     : rows[half + group * interleave + within - interleave];
    }
    rows.swap(order);
  }
#if PAGELLM_INT8
  const int64_t panels = (n + NR - 1) / NR, panel_bytes = num_super * t.super_bytes;
  at::Tensor packed = at::empty({panels, panel_bytes}, parts[0].options());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) t.pack(rows.data(), n, p, num_super, dst + p * panel_bytes);
  });
  return packed;
#else
  return at::Tensor();
#endif
}

void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, int64_t ggml_type,
                 const c10::optional<at::Tensor>& bias, int64_t activation) {
  const TypeInfo& t = checked_type(ggml_type, "linear_int8");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "linear_int8: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                        out.size(0) == x.size(0),
                    "linear_int8: out must be float32 [rows of x, N] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK_VALUE(k > 0 && k % t.block == 0, "linear_int8: the input width ", k,
                    " is not a positive multiple of the type's block of ", t.block);
#if PAGELLM_INT8
  const int64_t num_blocks = k / QK, panel_bytes = k / t.block * t.super_bytes;
  TORCH_CHECK_VALUE(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 2 &&
                        packed.is_contiguous() && packed.size(0) > 0 && packed.size(1) == panel_bytes,
                    "linear_int8: packed must come from pack_weight_int8 for this type and input width (", panel_bytes,
                    " bytes per panel of ", NR, " columns)");
  const int64_t panels = packed.size(0);
  TORCH_CHECK_VALUE(activation >= kActNone && activation <= kActSwigluOai, "linear_int8: unknown activation code ",
                    activation);
  const bool gate_up = activation != kActNone;
  if (gate_up) {
    TORCH_CHECK_VALUE(n % 16 == 0 && n == panels * W, "linear_int8: out has ", n, " columns, packed holds ",
                      panels * NR, " interleaved gate/up rows (a multiple of 32 for a fused gated activation)");
  } else {
    TORCH_CHECK_VALUE(n <= panels * NR && n > (panels - 1) * NR, "linear_int8: out has ", n, " columns, packed holds ",
                      panels, " panels of ", NR);
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(
        bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == (gate_up ? 2 * n : n),
        "linear_int8: bias must be contiguous float32 of ", gate_up ? 2 * n : n, " elements");
    bias_ptr = bias->data_ptr<float>();
  }
  if (m == 0) return;
#if defined(PAGELLM_AMX) && defined(PAGELLM_BF16_ROWS)
  if (m >= kAmxMinRowsInt8 && k % 32 == 0 && amx_enabled()) {
    linear_int8_amx(t, x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<uint8_t>(), panels, panel_bytes, n,
                    bias_ptr, activation, out.data_ptr<float>(), out.stride(0));
    return;
  }
#endif
  const RowBlocks row_blocks(m, MR, MR_MAX);
  // The worker threads reach these through pointers: their own thread_locals are other buffers.
  thread_local std::vector<int8_t> qa;
  thread_local std::vector<ActBlock> act_blocks;
  qa.resize(row_blocks.count * MR_MAX * k);
  act_blocks.resize(row_blocks.count * MR_MAX * num_blocks);
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  int8_t* qa_ptr = qa.data();
  ActBlock* act_ptr = act_blocks.data();
  auto quantize = [&](int64_t r0, int64_t r1) {
    quantize_rows(xp, ldx, r0, r1, k, row_blocks, t.bias, t.act_span, qa_ptr, act_ptr);
  };
  if (m >= kQuantizeParallelRows) {
    at::parallel_for(0, m, 8, quantize);
  } else {
    quantize(0, m);
  }
  const Activations act{qa_ptr, act_ptr, k, num_blocks};
  const PanelProduct pr{&act, &row_blocks, t.tiles,  packed.data_ptr<uint8_t>(), panel_bytes,
                        n,    activation,  bias_ptr, out.data_ptr<float>(),      out.stride(0)};
  const bool pairs = pairs_of(gate_up);
  parallel_panels(pairs ? panels / 2 : panels, [&](int64_t begin, int64_t end) {
    run_panels(pr, pairs ? 2 * begin : begin, pairs ? 2 * end : end);
  });
#else
  (void)m, (void)n, (void)packed, (void)bias, (void)activation;
  TORCH_CHECK(false, "linear_int8: this build has no int8 dot products (needs AVX2 or AVX512-BW)");
#endif
}

// A mixture-of-experts layer's experts in one call: x's rows sorted by expert (rows
// [s_e, s_e + counts[e]) are expert e's), each expert's gate_up (packed with interleave 16, stored as
// act(gate) * up for the activation code) then down into the same rows of out. One parallel region runs the whole
// layer, its tasks (expert, panel chunk) so that the threads share even experts of one row; per output element the sums
// are linear_int8's (the same quantization, tiles and order), so the result is bit for bit that of two linear_int8
// calls per expert.
void moe_int8(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& gate_up, int64_t gate_up_type,
              const std::vector<at::Tensor>& down, int64_t down_type, const at::Tensor& counts, int64_t activation) {
  const TypeInfo& tg = checked_type(gate_up_type, "moe_int8");
  const TypeInfo& td = checked_type(down_type, "moe_int8");
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "moe_int8: x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 &&
                        out.size(0) == x.size(0),
                    "moe_int8: out must be float32 [rows of x, N] with contiguous rows");
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK_VALUE(num_experts > 0 && static_cast<int64_t>(down.size()) == num_experts,
                    "moe_int8: gate_up and down must hold the same number (> 0) of experts");
  TORCH_CHECK_VALUE(activation >= kActSilu && activation <= kActSwigluOai, "moe_int8: unknown gated activation code ",
                    activation);
  TORCH_CHECK_VALUE(counts.device().is_cpu() && counts.scalar_type() == at::kLong && counts.dim() == 1 &&
                        counts.numel() == num_experts,
                    "moe_int8: counts must be int64 [experts] on the CPU");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK_VALUE(k > 0 && k % tg.block == 0, "moe_int8: the input width ", k,
                    " is not a positive multiple of the gate_up type's block of ", tg.block);
  const at::Tensor count_values = counts.contiguous();
  const int64_t* count = count_values.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    TORCH_CHECK_VALUE(count[e] >= 0, "moe_int8: expert ", e, " has a negative row count");
    total += count[e];
  }
  TORCH_CHECK_VALUE(total == m, "moe_int8: counts sum to ", total, ", x has ", m, " rows");
#if PAGELLM_INT8
  const int64_t gu_panel_bytes = k / tg.block * tg.super_bytes;
  const int64_t gu_panels = gate_up[0].dim() == 2 ? gate_up[0].size(0) : 0, inter = gu_panels * W;
  TORCH_CHECK_VALUE(gu_panels > 0 && inter % 16 == 0 && inter % td.block == 0, "moe_int8: gate_up holds ", gu_panels,
                    " panels: an intermediate width of ", inter,
                    ", which must be a multiple of 16 and of the down type's block of ", td.block);
  const int64_t d_panel_bytes = inter / td.block * td.super_bytes;
  const int64_t d_panels = (n + NR - 1) / NR;
  for (int64_t e = 0; e < num_experts; ++e) {
    const at::Tensor& g = gate_up[e];
    const at::Tensor& d = down[e];
    TORCH_CHECK_VALUE(g.device().is_cpu() && g.scalar_type() == at::kByte && g.dim() == 2 && g.is_contiguous() &&
                          g.size(0) == gu_panels && g.size(1) == gu_panel_bytes,
                      "moe_int8: gate_up[", e,
                      "] must come from pack_weight_int8 (interleave 16) for its type and x's width, ", "as [",
                      gu_panels, ", ", gu_panel_bytes, "] like expert 0's");
    TORCH_CHECK_VALUE(d.device().is_cpu() && d.scalar_type() == at::kByte && d.dim() == 2 && d.is_contiguous() &&
                          d.size(0) == d_panels && d.size(1) == d_panel_bytes,
                      "moe_int8: down[", e, "] must come from pack_weight_int8 for its type, ", inter, " inputs and ",
                      n, " outputs: [", d_panels, ", ", d_panel_bytes, "]");
  }
  if (m == 0) return;
  const int64_t k_blocks = k / QK, inter_blocks = inter / QK;
  // The experts that have rows, each with its row blocks and its share of the buffers below.
  struct Used {
    int64_t expert, start, rows, row_blocks_at;
  };
  std::vector<Used> used;
  std::vector<RowBlocks> blocks;
  int64_t row_block_total = 0;
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e], ++e) {
    if (count[e] == 0) continue;
    blocks.emplace_back(count[e], MR, MR_MAX);
    used.push_back({e, start, count[e], row_block_total});
    row_block_total += blocks.back().count;
  }
  const int64_t num_used = static_cast<int64_t>(used.size());
  std::vector<int32_t> row_owner(m);
  for (int64_t u = 0; u < num_used; ++u)
    for (int64_t r = 0; r < used[u].rows; ++r) row_owner[used[u].start + r] = static_cast<int32_t>(u);
  // The worker threads reach these through pointers: their own thread_locals are other buffers.
  thread_local std::vector<int8_t> qa, qh;
  thread_local std::vector<ActBlock> act_x, act_h;
  thread_local std::vector<float> hidden;
  qa.resize(row_block_total * MR_MAX * k);
  act_x.resize(row_block_total * MR_MAX * k_blocks);
  qh.resize(row_block_total * MR_MAX * inter);
  act_h.resize(row_block_total * MR_MAX * inter_blocks);
  hidden.resize(m * inter);
  std::vector<Activations> acts_x, acts_h;
  std::vector<PanelProduct> products_gu, products_d;
  acts_x.reserve(num_used), acts_h.reserve(num_used), products_gu.reserve(num_used), products_d.reserve(num_used);
  int8_t *const qa_ptr = qa.data(), *const qh_ptr = qh.data();
  ActBlock *const act_x_ptr = act_x.data(), *const act_h_ptr = act_h.data();
  float* const h = hidden.data();
  for (int64_t u = 0; u < num_used; ++u) {
    const int64_t at_rb = used[u].row_blocks_at, e = used[u].expert;
    acts_x.push_back({qa_ptr + at_rb * MR_MAX * k, act_x_ptr + at_rb * MR_MAX * k_blocks, k, k_blocks});
    acts_h.push_back({qh_ptr + at_rb * MR_MAX * inter, act_h_ptr + at_rb * MR_MAX * inter_blocks, inter, inter_blocks});
    products_gu.push_back({&acts_x[u], &blocks[u], tg.tiles, gate_up[e].data_ptr<uint8_t>(), gu_panel_bytes, inter,
                           activation, nullptr, h + used[u].start * inter, inter});
    products_d.push_back({&acts_h[u], &blocks[u], td.tiles, down[e].data_ptr<uint8_t>(), d_panel_bytes, n, kActNone,
                          nullptr, out.data_ptr<float>() + used[u].start * out.stride(0), out.stride(0)});
  }
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // Tasks (used expert, first and last unit): units are panels, or gate/up panel pairs where one
  // thread runs both. Chunks as parallel_panels sizes them, never across two experts.
  struct Task {
    int64_t used, first, last;
  };
  const bool pairs = pairs_of(true);
  auto make_tasks = [&](int64_t units) {
    std::vector<Task> tasks;
    const int64_t per_chunk = std::max<int64_t>(1, num_used * units / (threads * kChunksPerThread));
    for (int64_t u = 0; u < num_used; ++u)
      for (int64_t f = 0; f < units; f += per_chunk) tasks.push_back({u, f, std::min(units, f + per_chunk)});
    return tasks;
  };
  const std::vector<Task> tasks_gu = make_tasks(pairs ? gu_panels / 2 : gu_panels), tasks_d = make_tasks(d_panels);
  const int64_t num_gu = static_cast<int64_t>(tasks_gu.size()), num_d = static_cast<int64_t>(tasks_d.size());
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int unit = pairs ? 2 : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      const Used& u = used[row_owner[r]];
      quantize_rows(xp + u.start * ldx, ldx, r - u.start, r - u.start + 1, k, blocks[row_owner[r]], tg.bias,
                    tg.act_span, qa_ptr + u.row_blocks_at * MR_MAX * k,
                    act_x_ptr + u.row_blocks_at * MR_MAX * k_blocks);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_gu; ++i)
      run_panels(products_gu[tasks_gu[i].used], unit * tasks_gu[i].first, unit * tasks_gu[i].last);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {
      const Used& u = used[row_owner[r]];
      quantize_rows(h + u.start * inter, inter, r - u.start, r - u.start + 1, inter, blocks[row_owner[r]], td.bias,
                    td.act_span, qh_ptr + u.row_blocks_at * MR_MAX * inter,
                    act_h_ptr + u.row_blocks_at * MR_MAX * inter_blocks);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_d; ++i) run_panels(products_d[tasks_d[i].used], tasks_d[i].first, tasks_d[i].last);
  }
#else
  (void)out, (void)n, (void)tg, (void)td;
  TORCH_CHECK(false, "moe_int8: this build has no int8 dot products (needs AVX2 or AVX512-BW)");
#endif
}

// Rows `ids` of the weight in `packed` as float32 [ids, in_features]: an embedding table kept
// only in the int8 kernel's panels.
at::Tensor int8_rows(const at::Tensor& packed, int64_t ggml_type, int64_t in_features, const at::Tensor& ids) {
  const TypeInfo& t = checked_type(ggml_type, "int8_rows");
  TORCH_CHECK_VALUE(in_features > 0 && in_features % t.block == 0, "int8_rows: in_features (", in_features,
                    ") must be a positive multiple of the type's block of ", t.block);
  TORCH_CHECK_VALUE(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
                    "int8_rows: ids must be a 1-D int64 CPU tensor");
  at::Tensor out = at::empty({ids.size(0), in_features}, packed.options().dtype(at::kFloat));
#if PAGELLM_INT8
  const int64_t num_super = in_features / t.block, panel_bytes = num_super * t.super_bytes;
  TORCH_CHECK_VALUE(
      packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == panel_bytes,
      "int8_rows: packed must come from pack_weight_int8 for this type and input width");
  const at::Tensor index = ids.contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  const int64_t rows = packed.size(0) * NR;
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < rows, "int8_rows: row ", id[i], " is outside the ", rows, " packed rows");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, index.numel(), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      t.unpack(w + id[i] / NR * panel_bytes, id[i] % NR, num_super, o + i * in_features);
  });
#else
  (void)packed;
  TORCH_CHECK(false, "int8_rows: this build has no int8 dot products");
#endif
  return out;
}

}  // namespace
}  // namespace pagellm

TORCH_LIBRARY(pagellm_gemm_int8, m) {
  m.def("pack_weight_int8(Tensor[] parts, int ggml_type, int in_features, int interleave) -> Tensor");
  m.def("linear_int8(Tensor(a!) out, Tensor x, Tensor packed, int ggml_type, Tensor? bias, int activation) -> ()");
  // No tensor arguments to dispatch on: one kernel for every backend.
  m.def("int8_supported() -> bool", &pagellm::int8_supported);
  m.def("int8_types() -> int[]", &pagellm::int8_types);
  m.def("int8_activation_span(int ggml_type) -> int", &pagellm::int8_activation_span);
  m.def("int8_rows(Tensor packed, int ggml_type, int in_features, Tensor ids) -> Tensor");
  m.def(
      "moe_int8(Tensor(a!) out, Tensor x, Tensor[] gate_up, int gate_up_type, Tensor[] down, int down_type, Tensor "
      "counts, int activation) -> ()");
}

TORCH_LIBRARY_IMPL(pagellm_gemm_int8, CPU, m) {
  m.impl("pack_weight_int8", &pagellm::pack_weight_int8);
  m.impl("linear_int8", &pagellm::linear_int8);
  m.impl("int8_rows", &pagellm::int8_rows);
  m.impl("moe_int8", &pagellm::moe_int8);
}
