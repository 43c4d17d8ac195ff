// llama.cpp's 4-bit weights (Q4_0, Q4_1, Q4_K) as the kernels of quant_q4_linear.cpp (entry points, packing),
// quant_q4_a8.cpp (int8 activations, integer dot products) and quant_q4_exact.cpp (float activations, weights
// dequantized in registers) keep them: the packed layout, each block's float32 (a, c) with w = a * q + c, and what
// the three files call of each other. The row loop, the trailer and the last panel's widening: quant_tiles.h.
//
// W [N, K] as codes q in 0 .. 15 per value; block b of a row is its 32 values k = 32b .. 32b + 32 (B = K / 32):
//   Q4_0: w = d * (q - 8)                      d float16 per block                  a = d,      c = -8 d
//   Q4_1: w = d * q + m                        d, m float16 per block               a = d,      c = m
//   Q4_K: w = (d * sc) * q - dmin * mn         d, dmin float16 per super-block of 256 values (8 blocks), sc, mn
//                                              6-bit unsigned per block             a = d * sc, c = -(dmin * mn)
// In float32 a and c are exact (11 by 6 significant bits at most) and so is a * q: w = fma(a, q, c) is gguf.quants'
// float32 value bit for bit (one rounding, in the addition; none for Q4_0).
//
// A panel (quant_tiles.h's segments) of R rows (16, or N % 16 for the last one):
//   nibbles: B x 4 units of 4 bytes per row; unit 4b + j holds, in byte i of row r, the code of row r at
//     k = 32b + 4j + i in its low nibble and at k = 32b + 4(j + 4) + i in its high nibble (with R = 16 a unit is
//     one vector: its low nibbles the codes of group j of 4 values of k, its high nibbles group j + 4, four
//     bytes per int32 lane r as vpdpbusd / vpmaddubsw + vpmaddwd take them);
//   then the parameters, as float16 or bytes, R rows per unit:
//     Q4_0: B units of d;  Q4_1: 2B units, d then m per block;
//     Q4_K: 2B units of bytes, sc then mn per block; then 2 (K / 256) units, d then dmin per super-block.
// Size per 16 x 32 weights: Q4_0 288 bytes, Q4_1 320 (GGUF's bytes exactly), Q4_K 296 (1.028x GGUF's 288), plus
// the trailer and a full panel's padding to 64 bytes (none for K a multiple of 64).
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

namespace stateserve_q4 {
using namespace stateserve_quant;

enum class Format { kQ4_0, kQ4_1, kQ4_K };
constexpr int64_t kSuperBlock = 256;                  // Q4_K's values per (d, dmin)
constexpr int64_t kUnitBytes = kPanelRows * 4;        // one vector of nibbles: 64
constexpr int64_t kNibbleBytes = 4 * kUnitBytes;      // a block's nibbles in a full panel: 256
constexpr int64_t kHalves = kPanelRows * 2;           // a unit of float16 parameters: 32 bytes
constexpr int64_t kMagics[3] = {0x31765f3034515353,   // "SSQ40_v1"
                                0x31765f3134515353,   // "SSQ41_v1"
                                0x31765f4b34515353};  // "SSQ4K_v1"

inline int64_t values_per_scale(Format f) { return f == Format::kQ4_K ? kSuperBlock : kBlock; }

inline PanelFormat panel_format(Format f, int64_t K) {
  const int64_t blocks = K / kBlock;
  const int64_t magic = kMagics[static_cast<int>(f)];
  if (f == Format::kQ4_0) return {magic, {{4 * blocks, 4}, {blocks, 2}, {0, 0}}, 2};
  if (f == Format::kQ4_1) return {magic, {{4 * blocks, 4}, {2 * blocks, 2}, {0, 0}}, 2};
  return {magic, {{4 * blocks, 4}, {2 * blocks, 1}, {2 * (K / kSuperBlock), 2}}, 3};
}

// A full panel's parameters of block b for its `lanes` rows from row0 on: pointers to d (Q4_0, Q4_1: the block's;
// Q4_K: the super-block's), to m (Q4_1) or dmin (Q4_K), and Q4_K's sc and mn.
struct ParamsAt {
  const uint8_t *d, *m, *sc, *mn;
};
template <Format F>
inline ParamsAt params_at(const uint8_t* panel, int64_t blocks, int64_t b, int row0) {
  const uint8_t* p = panel + blocks * kNibbleBytes;
  if constexpr (F == Format::kQ4_0) return {p + b * kHalves + 2 * row0, nullptr, nullptr, nullptr};
  if constexpr (F == Format::kQ4_1) {
    const uint8_t* d = p + 2 * b * kHalves + 2 * row0;
    return {d, d + kHalves, nullptr, nullptr};
  }
  const uint8_t* d = p + 2 * blocks * kPanelRows + 2 * (b / 8) * kHalves + 2 * row0;
  const uint8_t* sc = p + 2 * b * kPanelRows + row0;
  return {d, d + kHalves, sc, sc + kPanelRows};
}

// (a, c) of block b for V::kLanes rows from row0 on (w = a * q + c).
template <Format F, class V>
inline void block_params(const uint8_t* panel, int64_t blocks, int64_t b, int row0, typename V::F* a,
                         typename V::F* c) {
  const ParamsAt at = params_at<F>(panel, blocks, b, row0);
  *a = V::load_f16(at.d);
  if constexpr (F == Format::kQ4_0) {
    *c = V::mul(*a, V::set1(-8.f));
  } else if constexpr (F == Format::kQ4_1) {
    *c = V::load_f16(at.m);
  } else {
    *a = V::mul(*a, V::load_u8(at.sc));
    *c = V::mul(V::mul(V::load_f16(at.m), V::set1(-1.f)), V::load_u8(at.mn));
  }
}

// The same for one row (the portable loops).
template <Format F>
inline void block_params(const uint8_t* panel, int64_t blocks, int64_t b, int row, float* a, float* c) {
  const ParamsAt at = params_at<F>(panel, blocks, b, row);
  *a = half_at(at.d);
  if constexpr (F == Format::kQ4_0) {
    *c = *a * -8.f;
  } else if constexpr (F == Format::kQ4_1) {
    *c = half_at(at.m);
  } else {
    *a = *a * static_cast<float>(*at.sc);
    *c = -half_at(at.m) * static_cast<float>(*at.mn);
  }
}

// Code of row r at k (0 .. 31) of block b in a full panel.
inline int nibble_at(const uint8_t* panel, int64_t b, int r, int k) {
  const uint8_t byte = panel[b * kNibbleBytes + (k / 4 % 4) * kUnitBytes + r * 4 + k % 4];
  return k < 16 ? byte & 15 : byte >> 4;
}

// ---- quant_q4_a8.cpp: int8 activations (signed codes, and each block's code sum s)
TileShape a8_tile_shape(int64_t M);
// c = the tile's sums: rows of quantized x (q: ldq bytes apart; d, s: ldd apart) by the np full panels at
// panels[0 .. np), over all `blocks` blocks in increasing order, dot the exact integer sum q_w x q_x of a block:
//   Q4_0: acc = fma(float32(d_x * d), float32(dot - 8 s), acc)
//   Q4_1, Q4_K: acc = fma(float32(d_x * a), float32(dot), acc), then acc = fma(c, float32(d_x * s), acc)
void a8_tile(Format f, int mr, int np, const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c);

// ---- quant_q4_exact.cpp: float32 activations, weights dequantized as w = fma(a, q, c) (gguf's float32 values)
TileShape exact_tile_shape(int64_t M);
// c = the tile's sums: rows of float32 x (ldx apart) by the np full panels at panels[0 .. np). Each output: four
// float32 chains over k (k mod 4 = 0, 1, 2, 3; each in increasing k), added as (s0 + s1) + (s2 + s3).
void exact_tile(Format f, int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks,
                float* c);

}  // namespace stateserve_q4
