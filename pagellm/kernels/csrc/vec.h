// Portable SIMD helpers shared by pagellm's CPU kernels: GCC vector extensions, so one source
// builds for AVX-512, AVX2 or NEON with -march=native.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace pagellm {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif

typedef float vfloat __attribute__((vector_size(W * 4)));
typedef int32_t vint __attribute__((vector_size(W * 4)));
typedef float vfloat_u __attribute__((vector_size(W * 4), aligned(4)));

inline vfloat vload(const float* p) { return *reinterpret_cast<const vfloat_u*>(p); }
inline void vstore(float* p, vfloat v) { *reinterpret_cast<vfloat_u*>(p) = v; }
template <size_t... I>
inline vfloat vsplat_impl(float x, std::index_sequence<I...>) {
  return vfloat{((void)I, x)...};
}
// Not `vfloat{} + x`: without -ffast-math that is a real addition (0 + -0 = +0).
inline vfloat vsplat(float x) { return vsplat_impl(x, std::make_index_sequence<W>{}); }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Shuffle masks are built at compile time so the compiler can pick fixed permutations.
template <typename Fn, size_t... I>
constexpr vint make_mask(Fn fn, std::index_sequence<I...>) {
  return vint{fn(static_cast<int>(I))...};
}
template <typename Fn>
constexpr vint make_mask(Fn fn) {
  return make_mask(fn, std::make_index_sequence<W>{});
}
template <int Step>
struct XorMask {
  static constexpr vint make() {
    return make_mask([](int i) { return i ^ Step; });
  }
};

// Butterfly reduction with `combine` (sum, max): every lane ends up holding the result.
template <int Step = W / 2, typename Combine>
inline vfloat butterfly(vfloat v, Combine combine) {
  if constexpr (Step == 0) {
    return v;
  } else {
    constexpr vint mask = XorMask<Step>::make();
    return butterfly<Step / 2>(combine(v, __builtin_shuffle(v, mask)), combine);
  }
}
inline vfloat allsum(vfloat v) {
  return butterfly(v, [](vfloat a, vfloat b) { return a + b; });
}
inline vfloat allmax(vfloat v) {
  return butterfly(v, [](vfloat a, vfloat b) { return vmax(a, b); });
}
inline float hsum(vfloat v) { return allsum(v)[0]; }
inline float hmax(vfloat v) { return allmax(v)[0]; }

// 2^x for x in [-127, 127] (clamped outside), relative error ~1e-7; -inf -> 0.
// Round-to-nearest via the 1.5 * 2^23 trick keeps the polynomial on [-0.5, 0.5].
inline vfloat vexp2(vfloat x) {
  x = x < vsplat(-127.f) ? vsplat(-127.f) : x;
  x = x > vsplat(127.f) ? vsplat(127.f) : x;
  const vfloat magic = vsplat(12582912.f);
  vfloat t = x + magic;
  vfloat n = t - magic;
  vfloat f = x - n;
  vint ni = (vint)t - (vint)magic;
  vfloat p = vsplat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  vint bits = (ni + 127) << 23;
  return p * (vfloat)bits;
}

constexpr float kLog2e = 1.4426950408889634f;

// e^x through 2^(x log2 e); the extra rounding of the product costs ~|x| * 6e-8 relative.
inline vfloat vexp(vfloat x) { return vexp2(x * kLog2e); }
// silu(g) = g / (1 + e^-g): one definition, so that the fused and the separate forms agree bit for bit.
inline vfloat silu(vfloat g) { return g / (vsplat(1.0f) + vexp(-g)); }

// The gated activations act(gate) * up that a gate/up product's epilogue (or gated_and_mul) applies;
// the codes are ops.py's FUSED_ACTIVATIONS. One definition each, shared by every kernel.
enum GatedAct : int64_t { kActNone = 0, kActSilu = 1, kActGeluTanh = 2, kActSwigluOai = 3 };
// gpt-oss's clamped SwiGLU (its config's swiglu_alpha and swiglu_limit; the model refuses others).
constexpr float kSwigluAlpha = 1.702f, kSwigluLimit = 7.0f;

// gelu_tanh(g) = g/2 (1 + tanh(u)) = g / (1 + e^-2u), u = sqrt(2/pi) (g + 0.044715 g^3).
inline vfloat gelu_tanh(vfloat g) {
  constexpr float kC = 0.7978845608028654f;
  const vfloat u2 = g * (vsplat(2.0f * kC) + vsplat(2.0f * kC * 0.044715f) * g * g);
  return g / (vsplat(1.0f) + vexp(-u2));
}

inline vfloat gated(int64_t act, vfloat g, vfloat u) {
  if (act == kActGeluTanh) return gelu_tanh(g) * u;
  if (act == kActSwigluOai) {
    const vfloat limit = vsplat(kSwigluLimit);
    g = g > limit ? limit : g;
    u = u > limit ? limit : u;
    u = u < -limit ? -limit : u;
    return (u + vsplat(1.0f)) * (g / (vsplat(1.0f) + vexp(-kSwigluAlpha * g)));
  }
  return silu(g) * u;
}

}  // namespace pagellm
