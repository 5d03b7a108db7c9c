// Weights kept as blocks of small integers, for the packed matmul (gemm.cpp).
//
// A GGUF model's weights were quantized before we ever saw them: in Q4_1 every 32 consecutive
// inputs of an output row are d * q + m with one half-precision scale d and offset m and 4-bit q,
// in Q8_0 they are d * q with 8-bit q. Dequantized to float32 they take 4 bytes a weight, and a
// decode step streams all of them from memory. Kept as blocks they take 0.75 (4-bit) or 1.125
// (8-bit) bytes a weight here, and turning them back into float32 panels just before use gives the
// very same float32 values: d * q is exact in float32 (an 11-bit scale times a 4- or 8-bit integer),
// so d * q + m has a single rounding whichever way it is computed.
//
// Packing starts from the float32 weights and keeps a block form only where it reproduces every
// value bit for bit; the search below finds the scale as llama.cpp's quantizers set it (Q4_1:
// m = the block's minimum, its maximum has q = 15; Q8_0: the largest magnitude has |q| = 127).
// One block that does not fit leaves the whole matrix without a block copy.
//
// Layouts, per panel of NR = 2 W output columns and block of QK = 32 inputs (k):
//   4-bit: float d[NR], float m[NR], uint8 q[QK][W]   (byte j: column j low nibble, j + W high)
//   8-bit: float d[NR], int8 q[QK][NR]
// stored as uint8 [panels, K / QK, block bytes]; the block size tells the two apart.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagellm {

constexpr int QK = 32;                               // inputs per block
constexpr int NR = 2 * W;                            // output columns per panel
constexpr int64_t kQ4BlockBytes = NR * 8 + QK * W;   // 768 with AVX-512
constexpr int64_t kQ8BlockBytes = NR * 4 + QK * NR;  // 1,152 with AVX-512

// W bytes from p (uint8_t or int8_t), widened to W int32 lanes. Spelled out for x86: GCC turns the
// generic __builtin_convertvector of a byte vector into a scalar loop.
template <typename Byte>
inline vint widen(const Byte* p) {
  static_assert(sizeof(Byte) == 1, "bytes only");
  constexpr bool kSigned = std::is_signed_v<Byte>;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vint)(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vint)(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
  vint out;
  for (int i = 0; i < W; ++i) out[i] = p[i];
  return out;
#endif
}
inline vfloat to_float(vint v) { return __builtin_convertvector(v, vfloat); }

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Half-precision neighbours of x (x itself rounded, then one step down and up): the scale as the
// quantizer stored it is the half nearest (max - min) / 15 or amax / 127 in every block seen, the
// neighbours cover a last-bit difference in that division.
template <typename Fn>
inline bool try_half_scales(float x, Fn&& fits) {
  const c10::Half nearest(x);
  for (const int step : {0, -1, 1}) {
    c10::Half h = nearest;
    h.x = static_cast<uint16_t>(h.x + step);
    const float d = static_cast<float>(h);
    if (d > 0.f && std::isfinite(d) && fits(d)) return true;
  }
  return false;
}

// v[0..QK) == d * q + m bit for bit with q in [0, 15]; fills d, m and q when so.
inline bool find_q4_block(const float* v, float& d_out, float& m_out, uint8_t* q) {
  float lo = v[0], hi = v[0];
  for (int i = 1; i < QK; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
  }
  if (!std::isfinite(lo) || !std::isfinite(hi)) return false;
  const float m = lo;
  auto fits = [&](float d) {
    for (int i = 0; i < QK; ++i) {
      const float t = std::nearbyint((v[i] - m) / d);
      if (!(t >= 0.f && t <= 15.f) || !same_bits(d * t + m, v[i])) return false;
      q[i] = static_cast<uint8_t>(t);
    }
    d_out = d;
    m_out = m;
    return true;
  };
  if (hi == lo) return fits(1.f);  // every q is 0
  return try_half_scales((hi - lo) / 15.f, fits);
}

// v[0..QK) == d * q bit for bit with q in [-128, 127]; fills d and q when so.
inline bool find_q8_block(const float* v, float& d_out, int8_t* q) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!std::isfinite(amax)) return false;
  auto fits = [&](float d) {
    for (int i = 0; i < QK; ++i) {
      const float t = std::nearbyint(v[i] / d);
      if (!(t >= -128.f && t <= 127.f) || !same_bits(d * t, v[i])) return false;
      q[i] = static_cast<int8_t>(t);
    }
    d_out = d;
    return true;
  };
  if (amax == 0.f) return fits(1.f);
  return try_half_scales(amax / 127.f, fits);
}

// Expands `num_blocks` consecutive blocks of one panel into float32 rows out[k][NR], the layout
// the micro-tile reads; `ahead` (the next slice's blocks) is pulled towards the cache meanwhile.
inline void dequant_q4_slice(const uint8_t* blocks, int num_blocks, float* out, const uint8_t* ahead) {
  for (int b = 0; b < num_blocks; ++b) {
    const uint8_t* block = blocks + b * kQ4BlockBytes;
    for (int64_t line = 0; line < kQ4BlockBytes; line += 64) __builtin_prefetch(ahead + b * kQ4BlockBytes + line, 0, 2);
    const float* d = reinterpret_cast<const float*>(block);
    const vfloat d0 = vload(d), d1 = vload(d + W), m0 = vload(d + NR), m1 = vload(d + NR + W);
    const uint8_t* qs = block + NR * 8;
    for (int k = 0; k < QK; ++k) {
      const vint bytes = widen(qs + k * W);
      float* row = out + (b * QK + k) * NR;
      vstore(row, to_float(bytes & 0xF) * d0 + m0);
      vstore(row + W, to_float(bytes >> 4) * d1 + m1);
    }
  }
}

inline void dequant_q8_slice(const uint8_t* blocks, int num_blocks, float* out, const uint8_t* ahead) {
  for (int b = 0; b < num_blocks; ++b) {
    const uint8_t* block = blocks + b * kQ8BlockBytes;
    for (int64_t line = 0; line < kQ8BlockBytes; line += 64) __builtin_prefetch(ahead + b * kQ8BlockBytes + line, 0, 2);
    const float* d = reinterpret_cast<const float*>(block);
    const vfloat d0 = vload(d), d1 = vload(d + W);
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + NR * 4);
    for (int k = 0; k < QK; ++k) {
      float* row = out + (b * QK + k) * NR;
      vstore(row, to_float(widen(qs + k * NR)) * d0);
      vstore(row + W, to_float(widen(qs + k * NR + W)) * d1);
    }
  }
}

}  // namespace pagellm
