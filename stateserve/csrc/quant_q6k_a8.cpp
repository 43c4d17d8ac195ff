// Q6_K products with int8 activations (quant_q6k.h has the packed layout): each row of x quantized per block of 32
// as llama.cpp's quantize_row_q8_0 (signed codes, and the code sum s of each half block), then per block of 32 the
// exact integer isum = sc_0 (dot_0 - 32 s_0) + sc_1 (dot_1 - 32 s_1) over its two sub-blocks of 16 (dot_h the sum of
// the unsigned 6-bit weight codes times x's codes, |isum| <= 2 * 128 * 16 * 32 * 127 < 2^24, so float32(isum) is
// exact too), and one float32 step: acc = fma(float32(d_x * d), float32(isum), acc), d_x * d exact (11 by 11 bits).
// The integer step is exact in every path and the float step is the same for every output, so a row's result does
// not depend on the tile, the rows beside it or M.
// The paths (one per build, the same choice as quant_a8.cpp's):
//   avx512_vnni: vpdpbusd takes the unsigned codes times x's signed codes, four products per int32 lane, from
//     -32 s; one vpmulld by the rows' sc per sub-block.
//   avx512bw: vpmaddubsw gives pairs of products in int16 lanes; two groups' are added in int16 (|sum| <= 2 * 2 *
//     63 * 127 = 32004 < 32768: no saturation anywhere), then vpmaddwd by (sc, sc) into int32 lanes; the -32 s
//     term by one vpmulld.
//   avx2: the same on 8 lanes, a panel in two halves.
//   scalar: the loops.
// A tile goes panel by panel (vector by vector) within a block, all its rows of x per decoded sub-block: the live
// registers are the accumulators, one int32 sum per row and the four code vectors. The -32 s start and vpmulld cost
// 3 operations per row, panel and 16 values, against Q8_0's one vpdpbusd per 4 values of a row: at M >= 2 the
// products, not the memory, bound a Q6_K weight's streaming (~1.5x Q8_0's vector work per weight byte).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include "quant_q6k.h"

namespace stateserve_q6k {
namespace {

#if SS_HAS_AVX512_BW || SS_HAS_AVX2
#if SS_HAS_AVX512_VNNI
struct Ops : Lanes16 {
  struct Scales {
    I s32;
  };
  static Scales scales(const uint8_t* p) {
    return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
  }
  // isum + sc (sum_t w[t] . x[4t .. 4t + 4) - 32 s)
  static I sub_block(I isum, const I w[4], const uint8_t* x, const Scales& sc, int32_t s) {
    I dot = _mm512_set1_epi32(-32 * s);
    for (int t = 0; t < 4; ++t) dot = _mm512_dpbusd_epi32(dot, w[t], broadcast4(x + 4 * t));
    return _mm512_add_epi32(isum, _mm512_mullo_epi32(sc.s32, dot));
  }
};
// 2 rows by 3 panels at any M (more rows: the same panels again, from L1 / L2): per row ~16 vector operations per
// panel and block, 8 of them vpdpbusd, and 2 rows keep the tile in registers; with 4 rows by 3 the compiler spills
// (AMD EPYC Zen 4, one thread, weights from DRAM: 2 x 3 twice streams ~1.5x faster than 4 x 3 at M = 4); 3 panels
// at once stream ~2x faster than one after the other at M = 1.
constexpr TileShape kFew = {2, 3}, kMany = {2, 3};
#elif SS_HAS_AVX512_BW
struct Ops : Lanes16 {
  struct Scales {
    I s32, s16;  // sc per int32 lane; (sc, sc) as its two int16 halves
  };
  static Scales scales(const uint8_t* p) {
    const I s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {s, _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(s, 16))};
  }
  static I sub_block(I isum, const I w[4], const uint8_t* x, const Scales& sc, int32_t s) {
    I sum = _mm512_mullo_epi32(sc.s32, _mm512_set1_epi32(-32 * s));
    for (int t = 0; t < 4; t += 2) {
      const I pairs = _mm512_add_epi16(_mm512_maddubs_epi16(w[t], broadcast4(x + 4 * t)),
                                       _mm512_maddubs_epi16(w[t + 1], broadcast4(x + 4 * t + 4)));
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, sc.s16));
    }
    return _mm512_add_epi32(isum, sum);
  }
};
constexpr TileShape kFew = {4, 2}, kMany = {4, 2};
#else
struct Ops : Lanes8 {
  struct Scales {
    I s32, s16;
  };
  static Scales scales(const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    const I s = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(v));
    return {s, _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(s, 16))};
  }
  static I sub_block(I isum, const I w[4], const uint8_t* x, const Scales& sc, int32_t s) {
    I sum = _mm256_mullo_epi32(sc.s32, _mm256_set1_epi32(-32 * s));
    for (int t = 0; t < 4; t += 2) {
      const I pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w[t], broadcast4(x + 4 * t)),
                                       _mm256_maddubs_epi16(w[t + 1], broadcast4(x + 4 * t + 4)));
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, sc.s16));
    }
    return _mm256_add_epi32(isum, sum);
  }
};
constexpr TileShape kFew = {2, 1}, kMany = {2, 1};  // 16 registers
#endif

// MR rows of x by NV vectors (kLanes rows of W each; vector v: panel v / kPer, its rows kLanes * (v % kPer) on).
template <int MR, int NV>
void tile(const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd, const uint8_t* const* panels,
          int64_t blocks, float* c) {
  constexpr int L = Ops::kLanes, kPer = kPanelRows / L;
  const int64_t lds = 2 * ldd;
  Ops::F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = q + b * kBlock;
    for (int v = 0; v < NV; ++v) {
      const uint8_t* panel = panels[v / kPer];
      const int row0 = (v % kPer) * L;
      Ops::I isum[MR];
      for (int r = 0; r < MR; ++r) isum[r] = Ops::zeroi();
      for (int h = 0; h < 2; ++h) {
        Ops::I w[4];
        sub_block_codes(panel, b, h, row0, w);
        const Ops::Scales sc = Ops::scales(sc_at(panel, blocks, 2 * b + h, row0));
        for (int r = 0; r < MR; ++r)
          isum[r] = Ops::sub_block(isum[r], w, qb + r * ldq + 16 * h, sc, s[r * lds + 2 * b + h]);
      }
      const Ops::F dw = Ops::load_f16(d_at(panel, blocks, b / 8, row0));
      for (int r = 0; r < MR; ++r) acc[r][v] = Ops::fma(d[r * ldd + b], dw, isum[r], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) Ops::store(c + r * kTileStride + v * L, acc[r][v]);
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

void a8_tile(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c) {
#if SS_HAS_AVX512_BW || SS_HAS_AVX2
  constexpr int kPer = kPanelRows / Ops::kLanes;
  dispatch_tile<kFew.rows, kFew.panels, kMany.rows, kMany.panels>(mr, np, [&](auto rows, auto nps) {
    tile<decltype(rows)::value, decltype(nps)::value * kPer>(q, ldq, d, s, ldd, panels, blocks, c);
  });
#else
  // the portable loops: per output and block the integer sums, then the float step
  const int64_t lds = 2 * ldd;
  for (int r = 0; r < mr; ++r)
    for (int col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int row = col % kPanelRows;
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* qb = reinterpret_cast<const int8_t*>(q + r * ldq + b * kBlock);
        int32_t isum = 0;
        for (int h = 0; h < 2; ++h) {
          int32_t dot = -32 * s[r * lds + 2 * b + h];
          for (int k = 16 * h; k < 16 * h + 16; ++k) dot += code_at(p, b, row, k) * qb[k];
          isum += static_cast<int8_t>(*sc_at(p, blocks, 2 * b + h, row)) * dot;
        }
        acc = acc + (d[r * ldd + b] * half_at(d_at(p, blocks, b / 8, row))) * static_cast<float>(isum);
      }
      c[r * kTileStride + col] = acc;
    }
#endif
}

}  // namespace stateserve_q6k
