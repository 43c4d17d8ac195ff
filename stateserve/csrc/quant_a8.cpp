// Q8_0 products with int8 activations (quant_q8_0.h has the packed layout): each row of x quantized per block of 32
// as llama.cpp quantizes it, then per block an exact integer dot product of 32 codes, scaled by both blocks' float16
// scales and added into a float32 sum, blocks in increasing order. The integer step is exact in every path, and the
// float steps are the same for every output, so a row's result does not depend on the tile, the rows beside it or M.
// The paths (one per build, a8_path()):
//   avx512_vnni: vpdpbusd multiplies unsigned by signed bytes, four products per int32 lane: x is stored as
//     q + 128 (unsigned) and each block's sum starts at -128 * (the sum of its 32 codes, kept in the panel), so
//     sum (q + 128) w - 128 sum w = sum q w. One instruction per 64 products.
//   avx512bw (AVX-512 without VNNI, Skylake-SP): vpmaddubsw on |w| (unsigned; -128 gives 128) and x with w's sign
//     (|q| <= 127, so no pair of products saturates int16: 2 * 128 * 127 < 32768), then vpmaddwd by ones into
//     int32 lanes.
//   avx2: the same on 8 lanes (vpsignb gives x w's sign), a panel in two halves.
//   scalar: the loops.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "quant_lanes.h"
#include "quant_q8_0.h"

namespace stateserve_q8 {
namespace {

#if SS_HAS_AVX512_BW || SS_HAS_AVX2
// The vector paths, written once over Ops (quant_lanes.h's lanes and the product): W what a group's vector of codes
// is turned into once for all rows of x (dot), start the int32 sums a block begins from.
#if SS_HAS_AVX512_VNNI
struct Vnni : Lanes16 {
  using W = __m512i;
  static W weights(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I start(const uint8_t* sums) {  // -128 * sum of the block's codes, per row
    const __m512i s = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)));
    return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7));
  }
  static I dot(I acc, const W& w, I x) { return _mm512_dpbusd_epi32(acc, x, w); }
};
using Ops = Vnni;
// Up to 4 rows (decode), 3 panels per tile: 12 dot products, 12 sums, 3 weight vectors and a broadcast of x in 32
// registers; with one or two rows the weights stream faster from 3 panels at once than from 1 or 2. From 5 rows
// on, 6 rows by 2 panels: ~10% faster at 8-512 rows (fewer loads per vpdpbusd).
constexpr TileShape kFew = {4, 3}, kMany = {6, 2};
#elif SS_HAS_AVX512_BW
struct Bw : Lanes16 {
  struct W {
    __m512i abs;
    __mmask64 negative;
  };
  static W weights(const uint8_t* p) {
    const __m512i w = _mm512_loadu_si512(p);
    return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
  }
  static I start(const uint8_t*) { return _mm512_setzero_si512(); }
  static I dot(I acc, const W& w, I x) {
    const __m512i signed_x = _mm512_mask_sub_epi8(x, w.negative, _mm512_setzero_si512(), x);
    const __m512i pairs = _mm512_maddubs_epi16(w.abs, signed_x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
  }
};
using Ops = Bw;
constexpr TileShape kFew = {4, 2}, kMany = {4, 2};
#else
struct Avx2 : Lanes8 {
  struct W {
    __m256i abs, w;
  };
  static W weights(const uint8_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_abs_epi8(w), w};
  }
  static I start(const uint8_t*) { return _mm256_setzero_si256(); }
  static I dot(I acc, const W& w, I x) {
    const __m256i pairs = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};
using Ops = Avx2;
constexpr TileShape kFew = {4, 1}, kMany = {4, 1};
#endif

// MR rows of x by NV vectors (kLanes rows of W each; vector v: panel v / kPer, its rows kLanes * (v % kPer) on).
template <int MR, int NV>
void tile(const uint8_t* q, int64_t ldq, const float* d, int64_t ldd, const uint8_t* const* panels, int64_t blocks,
          float* c) {
  constexpr int L = Ops::kLanes, kPer = kPanelRows / L;
  typename Ops::F acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec[NV];
    typename Ops::I dot[MR][NV];
    for (int v = 0; v < NV; ++v) {
      const uint8_t* p = panels[v / kPer];
      rec[v] = p + b * kRecordBytes + (v % kPer) * L * 4;
      const typename Ops::I start = Ops::start(p + sums_offset(blocks, b) + (v % kPer) * L * 2);
      for (int r = 0; r < MR; ++r) dot[r][v] = start;
    }
    const uint8_t* qb = q + b * kBlock;
    for (int g = 0; g < kGroups; ++g) {
      typename Ops::W w[NV];
      for (int v = 0; v < NV; ++v) w[v] = Ops::weights(rec[v] + g * kGroupBytes);
      for (int r = 0; r < MR; ++r) {
        const typename Ops::I x = Ops::broadcast4(qb + r * ldq + 4 * g);
        for (int v = 0; v < NV; ++v) dot[r][v] = Ops::dot(dot[r][v], w[v], x);
      }
    }
    for (int v = 0; v < NV; ++v) {
      const typename Ops::F dw = Ops::load_f32(rec[v] + kCodeBytes);
      for (int r = 0; r < MR; ++r) acc[r][v] = Ops::fma(d[r * ldd + b], dw, dot[r][v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) Ops::store(c + r * kTileStride + v * L, acc[r][v]);
}

#endif

}  // namespace

const char* a8_path() {
#if SS_HAS_AVX512_VNNI
  return "avx512_vnni";
#elif SS_HAS_AVX512_BW
  return "avx512bw";
#elif SS_HAS_AVX2
  return "avx2";
#else
  return "scalar";
#endif
}

TileShape a8_tile_shape(int64_t M) {
#if SS_HAS_AVX512_BW || SS_HAS_AVX2
  return M <= kFew.rows ? kFew : kMany;
#else
  return {4, 1};
#endif
}

void a8_tile(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c) {
#if SS_HAS_AVX512_BW || SS_HAS_AVX2
  constexpr int kPer = kPanelRows / Ops::kLanes;
  dispatch_tile<kFew.rows, kFew.panels, kMany.rows, kMany.panels>(mr, np, [&](auto rows, auto nps) {
    tile<decltype(rows)::value, decltype(nps)::value * kPer>(q, ldq, d, ldd, panels, blocks, c);
  });
#else
  // the portable loops (x's codes signed here): per output and block the integer dot product, then the float steps
  static_assert(!kOffsetCodes, "unsigned codes are for vpdpbusd");
  for (int r = 0; r < mr; ++r)
    for (int64_t col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int64_t row = col % kPanelRows;
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rec = p + b * kRecordBytes;
        const uint8_t* qb = q + r * ldq + b * kBlock;
        int32_t dot = 0;
        for (int64_t k = 0; k < kBlock; ++k)
          dot += static_cast<int8_t>(rec[(k / 4) * kGroupBytes + row * 4 + k % 4]) * static_cast<int8_t>(qb[k]);
        float dw;
        std::memcpy(&dw, rec + kCodeBytes + row * 4, sizeof(dw));
        const float scale = d[r * ldd + b] * dw;
        acc = acc + scale * static_cast<float>(dot);
      }
      c[r * kTileStride + col] = acc;
    }
#endif
}

}  // namespace stateserve_q8
