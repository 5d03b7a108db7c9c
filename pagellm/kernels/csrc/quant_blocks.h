// The shapes the packed kernels share (gemm.cpp, gemm_int8.cpp): QK inputs per GGUF block and NR
// output columns per panel; and widening a block's bytes to int32 lanes.
#pragma once

#include <cstdint>
#include <type_traits>

#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagellm {

constexpr int QK = 32;     // inputs per block
constexpr int NR = 2 * W;  // output columns per panel

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

}  // namespace pagellm
