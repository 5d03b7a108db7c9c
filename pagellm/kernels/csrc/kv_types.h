// The element types a KV cache may hold: float32, or float16 / bfloat16 (half the bytes, and
// decode attention is bound by the bytes it reads). Kernels compute in float32 either way:
// load_kv() widens W elements into one vector, store_kv() narrows one back, rounding to nearest
// even as torch's .to() does, so a row written here equals the same row converted by torch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagellm {

typedef uint32_t vuint __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));

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

// bfloat16 is the upper half of a float32, so widening is a shift.
inline vfloat load_kv(const c10::BFloat16* p) {
  vu16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return (vfloat)(__builtin_convertvector(bits, vuint) << 16);
}

inline void store_kv(c10::BFloat16* p, vfloat x) {
  const vuint bits = (vuint)x;
  // Round to nearest even on the 16 dropped bits; NaN stays a (quiet) NaN, as in c10.
  vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = x != x ? vuint{} + 0x7FC0u : rounded;
  const vu16 narrow = __builtin_convertvector(rounded, vu16);
  std::memcpy(p, &narrow, sizeof(narrow));
}

// n elements from float32 into the cache's type; n need not be a multiple of W.
template <typename T>
inline void convert_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store_kv(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace pagellm
