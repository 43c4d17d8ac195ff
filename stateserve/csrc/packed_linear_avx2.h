// The panel kernel's tiles for AVX2 (packed_linear.cpp; the AVX-512 ones are there): x rows widened to float32,
// 8 columns per vector, every output summed chain by chain in the few-row kernel's order (panel_layout.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include "panel_layout.h"
#include "simd.h"

namespace stateserve_panels {
#if SS_HAS_AVX2
struct F32Words8 {  // float32 on AVX2: one k per 32-bit word, 8 columns per vector
  using T = float;
  using X = T;
  static constexpr int64_t kStep = 1;
  // tile rows: 6 rows by 2 vectors, 12 accumulators of AVX2's 16 registers
  static constexpr int max_mr(bool) { return 6; }
  static __m256 value(__m256i words, int) { return _mm256_castsi256_ps(words); }
};
// bfloat16 on AVX2 (no vdpbf16ps): two consecutive k per word, split into two float32 vectors (k = 2s: the low
// halves shifted up; 2s + 1: the high halves masked) and multiplied with FMA by x, which packed_linear widens to
// float32 first (a broadcast from float32 memory costs no shuffle; widening x is M * K work against the product's
// M * K * N). In the lane order the even and the odd k are two chains of their own, added at the chain's end, as the
// few-row kernel adds them (so twice the accumulators per output).
struct Bf16Words8 {
  using T = at::BFloat16;
  using X = float;
  static constexpr int64_t kStep = 2;
  static constexpr int max_mr(bool lanes) { return lanes ? 3 : 6; }  // lanes: 3 rows x 2 vectors x 2 halves
  static __m256 value(__m256i words, int half) {
    return _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(words, 16)
                                         : _mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

// c[r][0 .. 8 NV) = x row r times 8 NV of the panel's columns (r < MR), chain by chain as the AVX-512 tile: panel
// and c point at the first of the columns, rows of the panel still kPanel words apart; tree: as there.
template <typename L, bool kLanes, int MR, int NV>
void tile8(const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c, float* tree) {
  using O = SumOrder<kLanes>;
  constexpr int kSets = kLanes ? static_cast<int>(L::kStep) : 1;  // accumulators per output
  const ChainLayout layout(steps, O::kCount);
  const int32_t* w = panel;
  const float* xs = x;
  int depth = 0;
  for (int i = 0; i < O::kCount; ++i) {
    const int j = O::chain(i);
    __m256 acc[kSets][MR][NV];
    for (int h = 0; h < kSets; ++h)
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[h][r][v] = _mm256_setzero_ps();
    const int64_t n = layout.length(j);
    for (int64_t t = 0; t < n; ++t, w += kPanel, xs += L::kStep) {
      const __m256i* wp = reinterpret_cast<const __m256i*>(w);
      for (int h = 0; h < L::kStep; ++h) {
        __m256 wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = L::value(_mm256_loadu_si256(wp + v), h);
        for (int r = 0; r < MR; ++r) {
          const __m256 xb = _mm256_broadcast_ss(xs + r * ldx + h);
          for (int v = 0; v < NV; ++v) acc[h % kSets][r][v] = _mm256_fmadd_ps(wv[v], xb, acc[h % kSets][r][v]);
        }
      }
    }
    const __m256 zero = _mm256_setzero_ps();
    __m256 sum[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) {
        if (layout.padded(j))
          for (int h = 0; h < kSets; ++h) acc[h][r][v] = _mm256_fmadd_ps(zero, zero, acc[h][r][v]);
        sum[r][v] = kSets == 2 ? _mm256_add_ps(acc[0][r][v], acc[kSets - 1][r][v]) : acc[0][r][v];
      }
    for (int closed = i + 1; (closed & 1) == 0; closed >>= 1) {
      const float* left = tree + (--depth) * MR * kPanel;
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) sum[r][v] = _mm256_add_ps(_mm256_loadu_ps(left + r * kPanel + 8 * v), sum[r][v]);
    }
    float* dst = i + 1 < O::kCount ? tree + (depth++) * MR * kPanel : c;
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(dst + r * kPanel + 8 * v, sum[r][v]);
  }
}

template <typename L, bool kLanes, int MR>
void tile8_groups(int nv, const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c, float* tree) {
  for (int g = 0; g < nv; ++g)  // nv groups of 16 columns (the panel's columns past N are zero)
    tile8<L, kLanes, MR, 2>(x, ldx, panel + 16 * g, steps, c + 16 * g, tree + 16 * g);
}

// The AVX-512 tile_any's counterpart: nv counts 16-column groups as there; mr <= L::max_mr(kLanes).
template <typename L, bool kLanes>
void tile_any(int mr, int nv, const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c,
              float* tree) {
  constexpr int kMax = L::max_mr(kLanes);
  switch (mr) {
    case 6: if constexpr (kMax >= 6) return tile8_groups<L, kLanes, 6>(nv, x, ldx, panel, steps, c, tree); break;
    case 5: if constexpr (kMax >= 5) return tile8_groups<L, kLanes, 5>(nv, x, ldx, panel, steps, c, tree); break;
    case 4: if constexpr (kMax >= 4) return tile8_groups<L, kLanes, 4>(nv, x, ldx, panel, steps, c, tree); break;
    case 3: return tile8_groups<L, kLanes, 3>(nv, x, ldx, panel, steps, c, tree);
    case 2: return tile8_groups<L, kLanes, 2>(nv, x, ldx, panel, steps, c, tree);
    default: return tile8_groups<L, kLanes, 1>(nv, x, ldx, panel, steps, c, tree);
  }
}
#endif
}  // namespace stateserve_panels
