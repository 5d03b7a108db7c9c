// The element types a KV cache may hold: float32, float16 / bfloat16 (half the bytes, and
// decode attention is bound by the bytes it reads), or 8 bits (a quarter): fp8 e4m3 / e5m2 under
// a per-layer scale, or int8 rows with a float16 scale each (pagellm/attention/kv_quant.py).
// Kernels compute in float32 either way: load_kv() widens W elements into one vector, store_kv()
// and quantize_row() narrow, rounding to nearest even as torch's .to() and round() do, so a row
// written here equals the same row written by torch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagellm {

typedef uint32_t vuint __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));
typedef uint8_t vu8 __attribute__((vector_size(W)));
typedef int8_t vi8 __attribute__((vector_size(W)));

// W float16 bit patterns widened to float32 (exact, subnormals included).
inline vfloat half_bits_to_float(vu16 bits) {
#if defined(__AVX512F__)
  __m256i raw;
  std::memcpy(&raw, &bits, sizeof(bits));
  return (vfloat)_mm512_cvtph_ps(raw);
#elif defined(__F16C__) && defined(__AVX__)
  __m128i raw;
  std::memcpy(&raw, &bits, sizeof(bits));
  return (vfloat)_mm256_cvtph_ps(raw);
#else
  vfloat x;
  for (int i = 0; i < W; ++i) x[i] = static_cast<float>(c10::Half(bits[i], c10::Half::from_bits()));
  return x;
#endif
}

inline vfloat load_kv(const float* p) { return vload(p); }
inline void store_kv(float* p, vfloat x) { vstore(p, x); }

inline vfloat load_kv(const c10::Half* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && defined(__AVX__)
  return (vfloat)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vfloat x;
  for (int i = 0; i < W; ++i) x[i] = static_cast<float>(p[i]);
  return x;
#endif
}

inline void store_kv(c10::Half* p, vfloat x) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && defined(__AVX__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < W; ++i) p[i] = c10::Half(x[i]);
#endif
}

// bfloat16 is the upper half of a float32, so widening is a shift. (GCC splits the generic
// widening into halves and reinserts them; the x86 forms load and widen in one instruction.)
inline vfloat load_kv(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(__AVX2__)
  return (vfloat)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#else
  vu16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (vfloat)(__builtin_convertvector(bits, vuint) << 16);
#endif
}

inline void store_kv(c10::BFloat16* p, vfloat x) {
  const vuint bits = (vuint)x;
  // Round to nearest even on the 16 dropped bits; NaN stays a (quiet) NaN, as in c10.
  vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = x != x ? vuint{} + 0x7FC0u : rounded;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Each lane is below 2^16, so the saturating pack is exact (the generic narrowing masks and permutes).
  const __m256i r = (__m256i)rounded;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
#else
  const vu16 narrow = __builtin_convertvector(rounded, vu16);
  std::memcpy(p, &narrow, sizeof(narrow));
#endif
}

// W bytes zero-extended to 16 bits. (GCC's generic __builtin_convertvector between element
// sizes is scalarised for some of these widenings, so the x86 forms are spelled out.)
inline vu16 widen_bytes(const void* p) {
#if defined(__AVX512F__)
  const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
#else
  vu8 bytes;
  std::memcpy(&bytes, p, sizeof(bytes));
  return __builtin_convertvector(bytes, vu16);
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  vu16 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
#endif
}

// fp8 e5m2 is the top byte of a float16 (same exponent bias): widening is a shift.
inline vfloat load_kv(const c10::Float8_e5m2* p) { return half_bits_to_float(widen_bytes(p) << 8); }

// fp8 e4m3's exponent and mantissa placed in a float16's give the value / 2^8 (exactly, also for
// subnormals): kernels fold kKvUnit into the layer's scale instead of multiplying every element.
// The byte goes to the top, then one arithmetic shift puts the exponent in place and copies the
// sign into bit 14, which the mask clears.
inline vfloat load_kv(const c10::Float8_e4m3fn* p) {
  typedef int16_t vi16 __attribute__((vector_size(W * 2)));
  const vi16 top = (vi16)(widen_bytes(p) << 8);
  return half_bits_to_float((vu16)(top >> 1) & 0xBFFF);
}

// int8 rows: the raw integers; their row's scale (row_scale) is applied to scores and weights.
inline vfloat load_kv(const int8_t* p) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat x;
  for (int i = 0; i < W; ++i) x[i] = static_cast<float>(p[i]);
  return x;
#endif
}

// What load_kv() returns times kKvUnit<T> is the stored value (before the layer's scale).
template <typename T>
constexpr float kKvUnit = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;
// Whether each head row carries its own scale, as a float16 in kRowExtra<T> elements after its values.
template <typename T>
constexpr bool kRowScaled = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int kRowExtra = kRowScaled<T> ? 2 : 0;

// The scale of the head row starting at `row` (head_dim D); 1 for types without row scales.
template <int D, typename T>
inline float row_scale(const T* row) {
  if constexpr (kRowScaled<T>) {
    uint16_t bits;
    std::memcpy(&bits, row + D, sizeof(bits));
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  } else {
    return 1.f;
  }
}

// One head row of n float32 values into the cache's form: int8 with its float16 scale (absmax /
// 127) after the values, fp8 divided by the layer's `scale` and saturated, else rounded.
template <typename T>
inline void quantize_row(T* dst, const float* src, int64_t n, float scale) {
  if constexpr (kRowScaled<T>) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(src[i]));
    const c10::Half half_scale(std::min(amax / 127.f, 65504.f));
    const float s = static_cast<float>(half_scale);
    for (int64_t i = 0; i < n; ++i) {
      const float q = s > 0.f ? std::nearbyint(src[i] / s) : 0.f;
      dst[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
    }
    std::memcpy(dst + n, &half_scale.x, sizeof(half_scale.x));
  } else {
    constexpr float kMax = std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;
    for (int64_t i = 0; i < n; ++i) dst[i] = T(std::clamp(src[i] / scale, -kMax, kMax));
  }
}

// n elements from float32 into the cache's type; n need not be a multiple of W.
template <typename T>
inline void convert_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store_kv(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// n elements of a float32 or 16-bit type into float32: convert_row's inverse.
template <typename T>
inline void widen_row(float* dst, const T* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(dst + i, load_kv(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace pagellm
