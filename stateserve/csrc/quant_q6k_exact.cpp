// Q6_K products with float32 activations (no activation rounding; quant_q6k.h has the packed layout): each weight
// dequantized in registers as (d * sc) * (q - 32), exact in float32 and so gguf.quants' value bit for bit, and
// multiplied into float32 sums with FMA. As quant_q4_exact.cpp: each output is four chains over k, one per position
// of k within its group of 4 (the four bytes of a lane), each in increasing k, added as (s0 + s1) + (s2 + s3) at the
// end: the same order for every output, whatever the tile or M.
// Vectors of 16 lanes (AVX-512F) or 8 (AVX2; a panel's two halves one after the other): a sub-block's code vectors
// (quant_q6k.h), 32 subtracted from each byte, each byte sign-extended into its int32 lane and converted; the
// portable loops otherwise.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include "quant_q6k.h"

namespace stateserve_q6k {
namespace {

#if SS_HAS_AVX512
struct Ops : Lanes16 {
  static I centered(I g) { return _mm512_sub_epi8(g, _mm512_set1_epi8(32)); }  // q - 32 as signed bytes
  template <int B>
  static F byte(I v) {  // signed byte B of each lane as float32
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(B == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * B), 24));
  }
  static F scales(const uint8_t* p) {  // 16 int8 sc as float32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
constexpr TileShape kShape = {4, 1};
#elif SS_HAS_AVX2
struct Ops : Lanes8 {
  static I centered(I g) { return _mm256_sub_epi8(g, _mm256_set1_epi8(32)); }
  template <int B>
  static F byte(I v) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(B == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * B), 24));
  }
  static F scales(const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v)));
  }
};
constexpr TileShape kShape = {2, 1};
#endif

#if SS_HAS_SIMD
// MR rows of x by one vector of kLanes rows of W (row0 on in its panel).
template <int MR>
void tile(const float* x, int64_t ldx, const uint8_t* panel, int row0, int64_t blocks, float* c) {
  using FV = Ops::F;
  FV acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const FV dw = Ops::load_f16(d_at(panel, blocks, b / 8, row0));
    for (int h = 0; h < 2; ++h) {
      Ops::I g[4];
      sub_block_codes(panel, b, h, row0, g);
      const FV a = Ops::mul(dw, Ops::scales(sc_at(panel, blocks, 2 * b + h, row0)));  // d * sc, exact
      for (int t = 0; t < 4; ++t) {
        const Ops::I w = Ops::centered(g[t]);
        const FV wf[4] = {Ops::mul(a, Ops::byte<0>(w)), Ops::mul(a, Ops::byte<1>(w)), Ops::mul(a, Ops::byte<2>(w)),
                          Ops::mul(a, Ops::byte<3>(w))};
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + b * kBlock + 16 * h + 4 * t;
          for (int i = 0; i < 4; ++i) acc[r][i] = Ops::fmadd(Ops::set1(xr[i]), wf[i], acc[r][i]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    Ops::store(c + r * kTileStride, Ops::add(Ops::add(acc[r][0], acc[r][1]), Ops::add(acc[r][2], acc[r][3])));
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

void exact_tile(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks, float* c) {
#if SS_HAS_SIMD
  constexpr int L = Ops::kLanes;
  dispatch_tile<kShape.rows, 1, kShape.rows, 1>(mr, 1, [&](auto rows, auto) {
    for (int v = 0; v < np * (kPanelRows / L); ++v)  // one vector of rows of W after the other
      tile<decltype(rows)::value>(x, ldx, panels[v * L / kPanelRows], v * L % kPanelRows, blocks, c + v * L);
  });
#else
  for (int r = 0; r < mr; ++r)
    for (int col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int row = col % kPanelRows;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t b = 0; b < blocks; ++b) {
        const float dw = half_at(d_at(p, blocks, b / 8, row));
        for (int k = 0; k < kBlock; ++k) {
          const float a = dw * static_cast<float>(static_cast<int8_t>(*sc_at(p, blocks, 2 * b + k / 16, row)));
          const float w = a * static_cast<float>(code_at(p, b, row, k) - 32);  // exact
          s[k % 4] = s[k % 4] + x[r * ldx + b * kBlock + k] * w;
        }
      }
      c[r * kTileStride + col] = (s[0] + s[1]) + (s[2] + s[3]);
    }
#endif
}

}  // namespace stateserve_q6k
