// Q4_0, Q4_1 and Q4_K products with float32 activations (no activation rounding; quant_q4.h has the packed layout):
// each weight dequantized in registers as fma(a, q, c), gguf.quants' float32 value bit for bit, and multiplied into
// float32 sums with FMA. As quant_exact.cpp's Q8_0 tiles: each output is four chains over k, one per position of
// k within its group of 4 (the four bytes of a lane), each in increasing k, added as (s0 + s1) + (s2 + s3) at the
// end: the same order for every output, whatever the tile or M. Each chain has K / 4 terms, so the sum errs by
// well under gamma_K * sum |x w| before the output's rounding.
// Vectors of 16 lanes (AVX-512F: a nibble becomes a float32 by vpermps from a table of 0 .. 15, which reads only
// the index's low 4 bits) or 8 (AVX2: mask and convert; a panel's two halves one after the other); the portable
// loops otherwise.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include "quant_q4.h"

namespace stateserve_q4 {
namespace {

#if SS_HAS_AVX512
struct Ops : Lanes16 {
  template <int S>
  static F nibble(I w) {  // bits S .. S + 3 of each lane as float32
    return _mm512_permutexvar_ps(shift_right<S>(w), _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f,
                                                                    10.f, 11.f, 12.f, 13.f, 14.f, 15.f));
  }
};
constexpr TileShape kShape = {4, 1};
#elif SS_HAS_AVX2
struct Ops : Lanes8 {
  template <int S>
  static F nibble(I w) {
    const I v = shift_right<S>(w);
    return _mm256_cvtepi32_ps(S == 28 ? v : _mm256_and_si256(v, _mm256_set1_epi32(15)));
  }
};
constexpr TileShape kShape = {2, 1};  // 16 registers: 8 chains, 4 dequantized vectors, a, c, a broadcast
#endif

#if SS_HAS_SIMD
// MR rows of x by one vector of kLanes rows of W (row0 on in its panel).
template <Format F, int MR>
void tile(const float* x, int64_t ldx, const uint8_t* panel, int row0, int64_t blocks, float* c) {
  using FV = Ops::F;
  FV acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    FV a, cw;
    block_params<F, Ops>(panel, blocks, b, row0, &a, &cw);
    const uint8_t* nib = panel + b * kNibbleBytes + row0 * 4;
    // groups 0 .. 3 from the units' low nibbles, then 4 .. 7 from their high nibbles: k in increasing order
    const auto groups = [&](auto high) {
      constexpr int H = decltype(high)::value;
      for (int j = 0; j < 4; ++j) {
        const Ops::I w = Ops::load(nib + j * kUnitBytes);
        const FV wf[4] = {Ops::fmadd(a, Ops::nibble<H>(w), cw), Ops::fmadd(a, Ops::nibble<8 + H>(w), cw),
                          Ops::fmadd(a, Ops::nibble<16 + H>(w), cw), Ops::fmadd(a, Ops::nibble<24 + H>(w), cw)};
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + b * kBlock + 4 * j + 4 * H;
          for (int i = 0; i < 4; ++i) acc[r][i] = Ops::fmadd(Ops::set1(xr[i]), wf[i], acc[r][i]);
        }
      }
    };
    groups(std::integral_constant<int, 0>());
    groups(std::integral_constant<int, 4>());
  }
  for (int r = 0; r < MR; ++r)
    Ops::store(c + r * kTileStride, Ops::add(Ops::add(acc[r][0], acc[r][1]), Ops::add(acc[r][2], acc[r][3])));
}

template <Format F>
void tile_rows(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks, float* c) {
  constexpr int L = Ops::kLanes;
  dispatch_tile<kShape.rows, 1, kShape.rows, 1>(mr, 1, [&](auto rows, auto) {
    for (int v = 0; v < np * (kPanelRows / L); ++v)  // one vector of rows of W after the other
      tile<F, decltype(rows)::value>(x, ldx, panels[v * L / kPanelRows], v * L % kPanelRows, blocks, c + v * L);
  });
}
#else
template <Format F>
void tile_rows(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks, float* c) {
  for (int r = 0; r < mr; ++r)
    for (int col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int row = col % kPanelRows;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t b = 0; b < blocks; ++b) {
        float a, cw;
        block_params<F>(p, blocks, b, row, &a, &cw);
        for (int k = 0; k < kBlock; ++k) {
          const float w = a * static_cast<float>(nibble_at(p, b, row, k)) + cw;  // a * q exact: one rounding
          s[k % 4] = s[k % 4] + x[r * ldx + b * kBlock + k] * w;
        }
      }
      c[r * kTileStride + col] = (s[0] + s[1]) + (s[2] + s[3]);
    }
}
#endif

}  // namespace

TileShape exact_tile_shape(int64_t) {
#if SS_HAS_SIMD
  return kShape;
#else
  return {4, 1};
#endif
}

void exact_tile(Format f, int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks,
                float* c) {
  switch (f) {
    case Format::kQ4_0: return tile_rows<Format::kQ4_0>(mr, np, x, ldx, panels, blocks, c);
    case Format::kQ4_1: return tile_rows<Format::kQ4_1>(mr, np, x, ldx, panels, blocks, c);
    case Format::kQ4_K: return tile_rows<Format::kQ4_K>(mr, np, x, ldx, panels, blocks, c);
  }
}

}  // namespace stateserve_q4
