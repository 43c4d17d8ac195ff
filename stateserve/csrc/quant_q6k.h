// llama.cpp's Q6_K weights as the kernels of quant_q6k_linear.cpp (entry points, packing), quant_q6k_a8.cpp (int8
// activations, integer dot products) and quant_q6k_exact.cpp (float activations, weights dequantized in registers)
// keep them: the packed layout, the decoding of a sub-block's codes in registers, and what the three files call of
// each other. The row loop, the trailer and the last panel's widening: quant_tiles.h.
//
// Q6_K: W [N, K], K a multiple of 256, as codes q in 0 .. 63, an int8 scale sc per sub-block of 16 values of k and a
// float16 d per super-block of 256: w = d * sc * (q - 32). In float32 each factor and each product is exact (11, 7
// and 5 significant bits), so any order gives gguf.quants' value bit for bit.
//
// A panel (quant_tiles.h's segments) of R rows (16, or N % 16 for the last one), B = K / 32 blocks of 32 values:
//   codes: B x 6 units of 4 bytes per row. Sub-block h (0, 1) of block b, its groups t = 0 .. 3 of 4 values
//     (k = 32b + 16h + 4t + i, i = 0 .. 3), in byte i of row r of
//       unit 6b + 2h + t / 2: the code's low 4 bits (t even: the low nibble, t odd: the high nibble),
//       unit 6b + 4 + h: its top 2 bits, at bits 2t .. 2t + 1;
//     with R = 16 a unit is one vector, four bytes per int32 lane r as vpdpbusd / vpmaddubsw + vpmaddwd take them,
//     and a block's units are 6 aligned cache lines;
//   then 2B units of bytes, sc per sub-block (k / 16); then K / 256 units of float16, d per super-block.
// Size per 16 x 256 weights: 3360 bytes, GGUF's 210 per 256 values exactly, plus the trailer and a full panel's
// padding to 64 bytes (32 bytes where K / 256 is odd).
#pragma once
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstdint>
#include "quant_lanes.h"
#include "quant_tiles.h"

namespace stateserve_q6k {
using namespace stateserve_quant;

constexpr int64_t kSuperBlock = 256;              // values per d
constexpr int64_t kSubBlock = 16;                 // values per sc
constexpr int64_t kUnitBytes = kPanelRows * 4;    // one vector of codes: 64
constexpr int64_t kBlockBytes = 6 * kUnitBytes;   // a block's codes in a full panel: 384
constexpr int64_t kMagic = 0x31765f4b36515353;    // "SSQ6K_v1"

inline PanelFormat panel_format(int64_t K) {
  const int64_t blocks = K / kBlock;
  return {kMagic, {{6 * blocks, 4}, {2 * blocks, 1}, {K / kSuperBlock, 2}}, 3};
}

// A full panel's sc of sub-block j (k / 16) and d of super-block s, for its rows from row0 on.
inline const uint8_t* sc_at(const uint8_t* panel, int64_t blocks, int64_t j, int row0) {
  return panel + blocks * kBlockBytes + j * kPanelRows + row0;
}
inline const uint8_t* d_at(const uint8_t* panel, int64_t blocks, int64_t s, int row0) {
  return panel + blocks * (kBlockBytes + 2 * kPanelRows) + s * 2 * kPanelRows + 2 * row0;
}

// Code of row r at k (0 .. 31) of block b in a full panel (the portable loops).
inline int code_at(const uint8_t* panel, int64_t b, int r, int k) {
  const int h = k / 16, t = k % 16 / 4, i = k % 4;
  const uint8_t* units = panel + b * kBlockBytes + r * 4 + i;
  const int low = (units[(2 * h + t / 2) * kUnitBytes] >> (4 * (t % 2))) & 15;
  return low | (((units[(4 + h) * kUnitBytes] >> (2 * t)) & 3) << 4);
}

#if SS_HAS_AVX512
// The codes of sub-block h of block b for the 16 rows of a full panel: g[t] holds group t, byte i of lane r the code
// at k = 32b + 16h + 4t + i. The top bits, masked to fields 0 and 2 (h1) or 1 and 3 (h2) of each byte, reach bits
// 4 .. 5 shifted by 4 or not at all (with zeros above); one vpternlogd takes bits 0 .. 3 from the nibbles, 4 .. 7
// from them (10 operations for 4 vectors of codes, 5 of them shifts).
inline void sub_block_codes(const uint8_t* panel, int64_t b, int h, int row0, __m512i g[4]) {
  const uint8_t* units = panel + b * kBlockBytes + row0 * 4;
  const __m512i m33 = _mm512_set1_epi8(0x33), low = _mm512_set1_epi8(0x0f);
  const __m512i l0 = _mm512_loadu_si512(units + 2 * h * kUnitBytes);
  const __m512i l1 = _mm512_loadu_si512(units + (2 * h + 1) * kUnitBytes);
  const __m512i hi = _mm512_loadu_si512(units + (4 + h) * kUnitBytes);
  const __m512i h1 = _mm512_and_si512(hi, m33), h2 = _mm512_and_si512(_mm512_srli_epi32(hi, 2), m33);
  // 0xe4: C ? A : B, A the nibbles (the destination register), B the top bits, C the mask of bits 0 .. 3
  g[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(l0, 4), _mm512_slli_epi32(h2, 4), low, 0xe4);
  g[0] = _mm512_ternarylogic_epi32(l0, _mm512_slli_epi32(h1, 4), low, 0xe4);
  g[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(l1, 4), h2, low, 0xe4);
  g[2] = _mm512_ternarylogic_epi32(l1, h1, low, 0xe4);
}
#elif SS_HAS_AVX2
// The same for the 8 rows of a panel from row0 on (0 or 8): bits 0 .. 3 and 4 .. 5 masked and joined.
inline void sub_block_codes(const uint8_t* panel, int64_t b, int h, int row0, __m256i g[4]) {
  const uint8_t* units = panel + b * kBlockBytes + row0 * 4;
  const auto load = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  const __m256i l0 = load(units + 2 * h * kUnitBytes), l1 = load(units + (2 * h + 1) * kUnitBytes);
  const __m256i hi = load(units + (4 + h) * kUnitBytes);
  const auto join = [&](__m256i nibbles, __m256i bits) {
    return _mm256_or_si256(_mm256_and_si256(nibbles, low), _mm256_and_si256(bits, top));
  };
  g[0] = join(l0, _mm256_slli_epi32(hi, 4));
  g[1] = join(_mm256_srli_epi32(l0, 4), _mm256_slli_epi32(hi, 2));
  g[2] = join(l1, hi);
  g[3] = join(_mm256_srli_epi32(l1, 4), _mm256_srli_epi32(hi, 2));
}
#endif

// ---- quant_q6k_a8.cpp: int8 activations (signed codes, and the code sums s of each sub-block of 16)
TileShape a8_tile_shape(int64_t M);
// c = the tile's sums: rows of quantized x (q: ldq bytes apart; d: ldd apart; s: 2 ldd apart) by the np full panels
// at panels[0 .. np), over all `blocks` blocks in increasing order. Per block the exact integer
//   isum = sc_0 (dot_0 - 32 s_0) + sc_1 (dot_1 - 32 s_1)      (dot_h = sum q_w q_x over sub-block h; |isum| < 2^24)
// then acc = fma(float32(d_x * d), float32(isum), acc), d_x * d and float32(isum) exact.
void a8_tile(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c);

// ---- quant_q6k_exact.cpp: float32 activations, weights dequantized as (d * sc) * (q - 32) (gguf's float32 values)
TileShape exact_tile_shape(int64_t M);
// c = the tile's sums: rows of float32 x (ldx apart) by the np full panels at panels[0 .. np). Each output: four
// float32 chains over k (k mod 4 = 0, 1, 2, 3; each in increasing k), added as (s0 + s1) + (s2 + s3).
void exact_tile(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks, float* c);

}  // namespace stateserve_q6k
