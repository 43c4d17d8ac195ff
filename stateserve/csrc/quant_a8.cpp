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
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include "quant_q8_0.h"
#include "simd.h"

namespace stateserve_q8 {
namespace {

// llama.cpp's rounding of one block: d = amax / 127, id = 1 / d (0 when d is 0), code = roundf(x * id).
inline float block_scale(float amax, float* id) {
  const float d = amax / 127.f;
  *id = d != 0.f ? 1.f / d : 0.f;
  return static_cast<float>(static_cast<at::Half>(d));  // the product uses the float16 scale, as block_q8_0
}

constexpr bool kOffsetCodes = SS_HAS_AVX512_VNNI;  // x's codes stored + 128 as unsigned bytes

template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* q, float* d) {
  const int64_t blocks = K / kBlock;
#if SS_HAS_AVX512
  using stateserve_simd::load16;
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v[2] = {load16(x + b * kBlock), load16(x + b * kBlock + 16)};
    float id;
    d[b] = block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))), &id);
    for (int h = 0; h < 2; ++h) {
      // roundf: the whole part, then one away from zero where the (exact) fraction is at least a half
      const __m512 p = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
      __m512 r = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m512 frac = _mm512_sub_ps(p, r);
      r = _mm512_mask_add_ps(r, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ), r, _mm512_set1_ps(1.f));
      r = _mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), r,
                             _mm512_set1_ps(1.f));
      __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r));
      if (kOffsetCodes) bytes = _mm_xor_si128(bytes, _mm_set1_epi8(static_cast<char>(0x80)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h), bytes);
    }
  }
#elif SS_HAS_AVX2
  using stateserve_simd::load8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kBlock + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
    }
    float id;
    d[b] = block_scale(stateserve_simd::hmax8(m), &id);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
      __m256 r = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 frac = _mm256_sub_ps(p, r), one = _mm256_set1_ps(1.f);
      r = _mm256_add_ps(r, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one));
      r = _mm256_sub_ps(r, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ), one));
      n[i] = _mm256_cvttps_epi32(r);
    }
    // int32 -> int8 (in range, no saturation): the packs interleave 128-bit lanes, the permute puts them back
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
#else
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[b * kBlock + j])));
    float id;
    d[b] = block_scale(amax, &id);
    for (int64_t j = 0; j < kBlock; ++j) {
      const int code = static_cast<int>(std::roundf(static_cast<float>(x[b * kBlock + j]) * id));
      q[b * kBlock + j] = static_cast<uint8_t>(kOffsetCodes ? code + 128 : code);
    }
  }
#endif
}

#if SS_HAS_AVX512_BW || SS_HAS_AVX2
// The vector paths, written once over Ops: kLanes rows of a panel per vector, W what a group's vector of codes is
// turned into once for all rows of x (dot), start the int32 sums a block begins from.
#if SS_HAS_AVX512_BW
struct Lanes16 {  // float32 steps on 16 lanes
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static I broadcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi32(v);
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F scales(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F fma(float dx, F dw, I dot, F acc) {  // acc + (dx * dw) * dot, two roundings as ggml's vec_dot
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dx), dw), _mm512_cvtepi32_ps(dot), acc);
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#endif

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
struct Avx2 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  struct W {
    __m256i abs, w;
  };
  static W weights(const uint8_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_abs_epi8(w), w};
  }
  static I broadcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi32(v);
  }
  static I start(const uint8_t*) { return _mm256_setzero_si256(); }
  static I dot(I acc, const W& w, I x) {
    const __m256i pairs = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(x, w.w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F scales(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F fma(float dx, F dw, I dot, F acc) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dx), dw), _mm256_cvtepi32_ps(dot), acc);
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
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
      const typename Ops::F dw = Ops::scales(rec[v] + kCodeBytes);
      for (int r = 0; r < MR; ++r) acc[r][v] = Ops::fma(d[r * ldd + b], dw, dot[r][v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) Ops::store(c + r * kTileStride + v * L, acc[r][v]);
}

template <int MR>
void tile_np(int np, const uint8_t* q, int64_t ldq, const float* d, int64_t ldd, const uint8_t* const* panels,
             int64_t blocks, float* c) {
  constexpr int kPer = kPanelRows / Ops::kLanes;
  // the panels of the widest tile of MR rows: only the tiles the two shapes call are compiled
  constexpr int kMaxNp = std::max(MR <= kFew.rows ? kFew.panels : 0, MR <= kMany.rows ? kMany.panels : 0);
  if constexpr (kMaxNp >= 3) if (np == 3) return tile<MR, 3 * kPer>(q, ldq, d, ldd, panels, blocks, c);
  if constexpr (kMaxNp >= 2) if (np == 2) return tile<MR, 2 * kPer>(q, ldq, d, ldd, panels, blocks, c);
  tile<MR, kPer>(q, ldq, d, ldd, panels, blocks, c);
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

void a8_quantize_row(const float* x, int64_t K, uint8_t* q, float* d) { quantize_row(x, K, q, d); }
void a8_quantize_row(const at::BFloat16* x, int64_t K, uint8_t* q, float* d) { quantize_row(x, K, q, d); }

void a8_tile(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c) {
#if SS_HAS_AVX512_BW || SS_HAS_AVX2
  constexpr int kRows = std::max(kFew.rows, kMany.rows);
  static_assert(kRows <= 6 && kRows <= kMaxTileRows && std::max(kFew.panels, kMany.panels) <= kMaxTilePanels,
                "the switch below");
  switch (std::min(mr, kRows)) {  // (the tiles of more rows than kRows are never called)
    case 6: return tile_np<std::min(6, kRows)>(np, q, ldq, d, ldd, panels, blocks, c);
    case 5: return tile_np<std::min(5, kRows)>(np, q, ldq, d, ldd, panels, blocks, c);
    case 4: return tile_np<std::min(4, kRows)>(np, q, ldq, d, ldd, panels, blocks, c);
    case 3: return tile_np<3>(np, q, ldq, d, ldd, panels, blocks, c);
    case 2: return tile_np<2>(np, q, ldq, d, ldd, panels, blocks, c);
    default: return tile_np<1>(np, q, ldq, d, ldd, panels, blocks, c);
  }
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
