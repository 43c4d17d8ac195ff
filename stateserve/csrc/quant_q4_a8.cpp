// Q4_0, Q4_1 and Q4_K products with int8 activations (quant_q4.h has the packed layout and the float steps): each
// row of x quantized per block of 32 as llama.cpp's quantize_row_q8_0 (signed codes, and each block's code sum s),
// then per block the exact integer dot product of the 32 weight codes (0 .. 15) with x's codes, and fixed float32
// steps with the block's parameters. The integer step is exact in every path and the float steps are the same for
// every output, so a row's result does not depend on the tile, the rows beside it or M.
// The paths (one per build, the same choice as quant_a8.cpp's):
//   avx512_vnni: vpdpbusd takes unsigned bytes times signed bytes, four products per int32 lane: the unpacked
//     nibbles times x's codes as they are. Q4_0's block sum starts at -8 s, so it ends at sum (q - 8) x exactly.
//   avx512bw: vpmaddubsw (unsigned nibbles, signed codes) gives pairs of products in int16 lanes; a block's eight
//     are added in int16 (|sum| <= 8 * 2 * 15 * 127 = 30480 < 32768: no saturation anywhere), then one vpmaddwd by
//     ones into int32 lanes.
//   avx2: the same on 8 lanes, a panel in two halves.
//   scalar: the loops.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include "quant_q4.h"

namespace stateserve_q4 {
namespace {

#if SS_HAS_AVX512_BW || SS_HAS_AVX2
// A block's integer sums: begin(start) for each output, step(sum, weights, x) per group of 4 values of k,
// finish(sum, start) the int32 lanes.
#if SS_HAS_AVX512_VNNI
struct Ops : Lanes16 {
  using Sum = I;
  static Sum begin(I start) { return start; }
  static Sum step(Sum s, I w, I x) { return _mm512_dpbusd_epi32(s, w, x); }
  static I finish(Sum s, I) { return s; }
};
// Up to 4 rows by 3 panels (decode), 6 rows by 2 panels from 5 rows on, as quant_a8.cpp's tiles.
constexpr TileShape kFew = {4, 3}, kMany = {6, 2};
#elif SS_HAS_AVX512_BW
struct Ops : Lanes16 {
  using Sum = I;
  static Sum begin(I) { return _mm512_setzero_si512(); }
  static Sum step(Sum s, I w, I x) { return _mm512_add_epi16(s, _mm512_maddubs_epi16(w, x)); }
  static I finish(Sum s, I start) { return _mm512_add_epi32(start, _mm512_madd_epi16(s, _mm512_set1_epi16(1))); }
};
constexpr TileShape kFew = {4, 2}, kMany = {4, 2};
#else
struct Ops : Lanes8 {
  using Sum = I;
  static Sum begin(I) { return _mm256_setzero_si256(); }
  static Sum step(Sum s, I w, I x) { return _mm256_add_epi16(s, _mm256_maddubs_epi16(w, x)); }
  static I finish(Sum s, I start) { return _mm256_add_epi32(start, _mm256_madd_epi16(s, _mm256_set1_epi16(1))); }
};
constexpr TileShape kFew = {4, 1}, kMany = {4, 1};
#endif

// MR rows of x by NV vectors (kLanes rows of W each; vector v: panel v / kPer, its rows kLanes * (v % kPer) on).
template <Format F, int MR, int NV>
void tile(const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd, const uint8_t* const* panels,
          int64_t blocks, float* c) {
  using I = Ops::I;
  constexpr int L = Ops::kLanes, kPer = kPanelRows / L;
  Ops::F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = q + b * kBlock;
    const uint8_t* nib[NV];
    for (int v = 0; v < NV; ++v) nib[v] = panels[v / kPer] + b * kNibbleBytes + (v % kPer) * L * 4;
    I start[MR];
    Ops::Sum sum[MR][NV];
    for (int r = 0; r < MR; ++r) {
      start[r] = F == Format::kQ4_0 ? Ops::set1i(-8 * s[r * ldd + b]) : Ops::zeroi();
      for (int v = 0; v < NV; ++v) sum[r][v] = Ops::begin(start[r]);
    }
    // unit j: the low nibbles are group j (x's codes 4j ..), the high nibbles group j + 4 (x's codes 16 + 4j ..)
    const auto groups = [&](auto high) {
      for (int j = 0; j < 4; ++j) {
        I w[NV];
        for (int v = 0; v < NV; ++v)
          w[v] = Ops::and_bytes(Ops::shift_right<decltype(high)::value>(Ops::load(nib[v] + j * kUnitBytes)), 15);
        for (int r = 0; r < MR; ++r) {
          const I x = Ops::broadcast4(qb + r * ldq + 4 * j + 4 * decltype(high)::value);
          for (int v = 0; v < NV; ++v) sum[r][v] = Ops::step(sum[r][v], w[v], x);
        }
      }
    };
    groups(std::integral_constant<int, 0>());
    groups(std::integral_constant<int, 4>());
    Ops::F xs[MR];  // float32(d_x * s): x's block sum, for c
    for (int r = 0; r < MR; ++r)
      if constexpr (F != Format::kQ4_0) xs[r] = Ops::set1(d[r * ldd + b] * static_cast<float>(s[r * ldd + b]));
    for (int v = 0; v < NV; ++v) {
      Ops::F a, cw;
      block_params<F, Ops>(panels[v / kPer], blocks, b, (v % kPer) * L, &a, &cw);
      for (int r = 0; r < MR; ++r) {
        acc[r][v] = Ops::fma(d[r * ldd + b], a, Ops::finish(sum[r][v], start[r]), acc[r][v]);
        if constexpr (F != Format::kQ4_0) acc[r][v] = Ops::fmadd(cw, xs[r], acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) Ops::store(c + r * kTileStride + v * L, acc[r][v]);
}

template <Format F>
void tile_rows(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
               const uint8_t* const* panels, int64_t blocks, float* c) {
  constexpr int kPer = kPanelRows / Ops::kLanes;
  dispatch_tile<kFew.rows, kFew.panels, kMany.rows, kMany.panels>(mr, np, [&](auto rows, auto nps) {
    tile<F, decltype(rows)::value, decltype(nps)::value * kPer>(q, ldq, d, s, ldd, panels, blocks, c);
  });
}
#else
// The portable loops: per output and block the integer dot product, then the float steps.
template <Format F>
void tile_rows(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
               const uint8_t* const* panels, int64_t blocks, float* c) {
  for (int r = 0; r < mr; ++r)
    for (int col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int row = col % kPanelRows;
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q + r * ldq + b * kBlock);
        int32_t dot = 0;
        for (int k = 0; k < kBlock; ++k) dot += nibble_at(p, b, row, k) * qb[k];
        float a, cw;
        block_params<F>(p, blocks, b, row, &a, &cw);
        const float dx = d[r * ldd + b];
        const int32_t xs = s[r * ldd + b];
        if constexpr (F == Format::kQ4_0) {
          acc = acc + (dx * a) * static_cast<float>(dot - 8 * xs);
        } else {
          acc = acc + (dx * a) * static_cast<float>(dot);
          acc = acc + cw * (dx * static_cast<float>(xs));
        }
      }
      c[r * kTileStride + col] = acc;
    }
}
#endif

}  // namespace

TileShape a8_tile_shape(int64_t M) {
#if SS_HAS_AVX512_BW || SS_HAS_AVX2
  return M <= kFew.rows ? kFew : kMany;
#else
  return {4, 1};
#endif
}

void a8_tile(Format f, int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c) {
  switch (f) {
    case Format::kQ4_0: return tile_rows<Format::kQ4_0>(mr, np, q, ldq, d, s, ldd, panels, blocks, c);
    case Format::kQ4_1: return tile_rows<Format::kQ4_1>(mr, np, q, ldq, d, s, ldd, panels, blocks, c);
    case Format::kQ4_K: return tile_rows<Format::kQ4_K>(mr, np, q, ldq, d, s, ldd, panels, blocks, c);
  }
}

}  // namespace stateserve_q4
