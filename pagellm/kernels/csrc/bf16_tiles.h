// Bfloat16 products shared by gemm_bf16.cpp and gemm_int8.cpp: x rounded to bfloat16 pairs, a
// panel's sums stored with their epilogue, and on CPUs with AMX (amx.h) the product of whole
// 16-row tiles of x with panels of 32 output columns laid out [K / 2, 32, 2] (each column's inputs
// k and k + 1 side by side: already the layout of a B tile). gemm_int8.cpp takes it for wide
// products (prefill), its blocks dequantized to such a panel first, once per panel and call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "parallel_panels.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGELLM_BF16_ROWS 1
#endif

namespace pagellm {

#if defined(PAGELLM_BF16_ROWS)

constexpr int kBf16PanelCols = 32;

// Rows [begin, end) of x rounded to bfloat16 (to nearest even), each padded with a zero to an even
// length `kp`: one 32-bit pair per k step of the panels.
inline void round_rows_bf16(const float* x, int64_t ldx, int64_t k, int64_t kp, int64_t begin, int64_t end,
                            uint16_t* dst) {
  for (int64_t r = begin; r < end; ++r) {
    const float* src = x + r * ldx;
    uint16_t* row = dst + r * kp;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    }
    if (i < k) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - i)) - 1);
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
      _mm256_mask_storeu_epi16(row + i, mask, rounded);
    }
    if (kp > k) row[k] = 0;
  }
}

// One row of a panel's sums (columns 0-15 in a0, 16-31 in a1) into `row`, biases b0 / b1 (each 16
// values, or null) added: with kGated act(a0) * a1 (16 outputs), else the first `ncols` of 32.
template <bool kGated>
inline void store_row(float* row, __m512 a0, __m512 a1, int ncols, const float* b0, const float* b1, int64_t act) {
  if constexpr (kGated) {
    if (b0 != nullptr) {
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(b0));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(b1));
    }
    _mm512_storeu_ps(row, (__m512)gated(act, (vfloat)a0, (vfloat)a1));
    return;
  }
  const __mmask16 m0 = static_cast<__mmask16>(ncols >= 16 ? 0xFFFF : (1u << ncols) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (1u << (ncols - 16)) - 1);
  if (b0 != nullptr) {
    a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, b0));
    a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, b1));
  }
  _mm512_mask_storeu_ps(row, m0, a0);
  _mm512_mask_storeu_ps(row + 16, m1, a1);
}

#if defined(PAGELLM_AMX)

// x as AMX takes it: rows rounded to bfloat16 and padded with zero rows to whole 16-row tiles.
struct AmxRows {
  const uint16_t* data;
  int64_t m, kp;  // real rows; values a row (a multiple of 32)
};

// rows [m0, m0 + rows) (rows <= 16 * RT) of x against one panel of `k2` pairs, into `out`: C tiles
// 0-1 hold rows 0-15 by the panel's two 16-column halves, 2-3 rows 16-31; A tiles 4-5, B tiles 6-7.
template <int RT, bool kGated>
void amx_tile_bf16(const uint16_t* x, int64_t kp, const uint16_t* panel, int64_t k2, float* out, int64_t ldo, int rows,
                   int ncols, const float* b0, const float* b1, int64_t act) {
  constexpr int64_t kPanelStride = kBf16PanelCols * 2 * sizeof(uint16_t);
  const int64_t x_stride = kp * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t i = 0; i < k2; i += 16) {
    _tile_loadd(6, panel + i * kBf16PanelCols * 2, kPanelStride);
    _tile_loadd(7, panel + i * kBf16PanelCols * 2 + 32, kPanelStride);
    _tile_loadd(4, x + 2 * i, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, x + 16 * kp + 2 * i, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[16 * RT * 32];  // [16 * RT rows][32 columns]
  _tile_stored(0, sums, 128);
  _tile_stored(1, sums + 16, 128);
  if constexpr (RT == 2) {
    _tile_stored(2, sums + 16 * 32, 128);
    _tile_stored(3, sums + 16 * 32 + 16, 128);
  }
  for (int r = 0; r < rows; ++r) {
    store_row<kGated>(out + r * ldo, _mm512_load_ps(sums + r * 32), _mm512_load_ps(sums + r * 32 + 16), ncols, b0, b1,
                      act);
  }
}

// Every row of x against panels [begin, end): `panel_of(p)` gives panel p's bfloat16 pairs, and
// `place(p, &ncols, &dst, &b0, &b1)` where its outputs go (columns, first output, biases or null).
template <bool kGated, typename PanelOf, typename Place>
void amx_panels(const AmxRows& x, int64_t begin, int64_t end, float* c, int64_t ldc, int64_t act,
                const PanelOf& panel_of, const Place& place) {
  const int64_t k2 = x.kp / 2;
  TileScope tiles;
  for (int64_t p = begin; p < end; ++p) {
    const uint16_t* panel = panel_of(p);
    int ncols = 0;
    float* dst = nullptr;
    const float *b0 = nullptr, *b1 = nullptr;
    place(p, &ncols, &dst, &b0, &b1);
    for (int64_t m0 = 0; m0 < x.m; m0 += 32) {
      const int rows = static_cast<int>(std::min<int64_t>(32, x.m - m0));
      if (rows > 16) {
        amx_tile_bf16<2, kGated>(x.data + m0 * x.kp, x.kp, panel, k2, dst + m0 * ldc, ldc, rows, ncols, b0, b1, act);
      } else {
        amx_tile_bf16<1, kGated>(x.data + m0 * x.kp, x.kp, panel, k2, dst + m0 * ldc, ldc, rows, ncols, b0, b1, act);
      }
    }
  }
}

// x (float32 rows) rounded into `buffer` as AMX takes it; kp = k (a multiple of 32).
inline AmxRows amx_rows(const float* x, int64_t ldx, int64_t m, int64_t k, std::vector<uint16_t>& buffer) {
  const int64_t m_pad = (m + 15) / 16 * 16;
  buffer.resize(m_pad * k);
  uint16_t* dst = buffer.data();
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) { round_rows_bf16(x, ldx, k, k, r0, r1, dst); });
  std::fill(dst + m * k, dst + m_pad * k, uint16_t{0});
  return {dst, m, k};
}

#endif  // PAGELLM_AMX
#endif  // PAGELLM_BF16_ROWS

}  // namespace pagellm
