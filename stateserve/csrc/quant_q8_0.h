// llama.cpp's Q8_0 weights as the kernels of quant_linear.cpp (entry points, packing), quant_a8.cpp (int8
// activations, integer dot products) and quant_exact.cpp (float activations, weights dequantized in registers) keep
// them: the packed layout and what the three files call of each other. The row loop, the trailer and the last
// panel's widening are quant_tiles.h's, shared with the Q4 formats.
//
// Q8_0: W [N, K], K a multiple of 32, as int8 codes [N, K] and float16 scales [N, K / 32]; block b of row n is
// codes[n, 32b .. 32b + 32) * scales[n, b].
//
// The packed tensor (quant_tiles.h): ceil(N / 16) panels of 16 rows of W, then the trailer (kMagic, N, K, the panel
// size in bytes). A panel of R rows (16, or N % 16 for the last one) holds, with B = K / 32:
//   B records of 36 R bytes, block b's record: its codes as 8 groups of 4 values of k, a group's 4 R bytes the
//     R rows' 4 codes in row order (byte g * 4R + r * 4 + j = code of row r at k = 32b + 4g + j: with R = 16 the
//     four bytes of int32 lane r of a vector, which vpdpbusd / vpmaddubsw + vpmaddwd add in one step), then the R
//     rows' scales as float32;
//   then B x R int16: the sums of each row's 32 codes per block (the correction of the u8 x s8 products, see
//   quant_a8.cpp). A full panel is padded with zeros to a multiple of 64 bytes.
// Full panels are the kernels' layout: records of 9 cache lines, every vector load of codes aligned.
// Size: 608 bytes per 16 x 32 weights against Q8_0's 544 (1.12x), plus the padding and the trailer.
#pragma once
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstdint>
#include "quant_tiles.h"

namespace stateserve_q8 {
using namespace stateserve_quant;

constexpr int64_t kGroups = kBlock / 4;                          // groups of 4 values of k per block
constexpr int64_t kGroupBytes = kPanelRows * 4;                  // 64
constexpr int64_t kCodeBytes = kGroups * kGroupBytes;            // 512
constexpr int64_t kRecordBytes = kCodeBytes + kPanelRows * 4;    // codes + float32 scales: 576
constexpr int64_t kSumBytes = kPanelRows * 2;                    // int16 code sums of one block: 32
constexpr int64_t kMagic = 0x32765f3038515353;                   // "SSQ80_v2"
constexpr bool kOffsetCodes = SS_HAS_AVX512_VNNI;                // x's codes stored + 128 (vpdpbusd's unsigned side)

inline int64_t sums_offset(int64_t blocks, int64_t b) { return blocks * kRecordBytes + b * kSumBytes; }

// The panel as quant_tiles.h's segments: B records of 9 units of 4 bytes per row (8 groups of codes, the scales),
// then B units of the int16 sums.
inline PanelFormat panel_format(int64_t K) {
  const int64_t blocks = K / kBlock;
  return {kMagic, {{9 * blocks, 4}, {blocks, 2}, {0, 0}}, 2};
}

// Where a panel of `rows` rows keeps block b's values (rows 16: the offsets above).
struct PanelLayout {
  PanelFormat f;
  int64_t rows;
  int64_t code(int64_t b, int64_t r, int64_t k) const { return f.at(0, 9 * b + k / 4, r, rows) + k % 4; }
  int64_t scale(int64_t b, int64_t r) const { return f.at(0, 9 * b + 8, r, rows); }
  int64_t sum(int64_t b, int64_t r) const { return f.at(1, b, r, rows); }
};

// ---- quant_a8.cpp: int8 activations (x quantized by quant_tiles.h's a8_quantize_row, offset where kOffsetCodes)
// The integer product this build uses: "avx512_vnni", "avx512bw", "avx2" or "scalar".
const char* a8_path();
TileShape a8_tile_shape(int64_t M);
// c = the tile's sums: rows of quantized x (q: ldq bytes apart, d: ldd floats apart) by the np full panels at
// panels[0 .. np), over all `blocks` blocks. Each output: per block in increasing order d_x * d_w (rounded to
// float32) times the exact integer dot product, added into one float32 sum.
void a8_tile(int mr, int np, const uint8_t* q, int64_t ldq, const float* d, int64_t ldd,
             const uint8_t* const* panels, int64_t blocks, float* c);

// ---- quant_exact.cpp: float32 activations, weights dequantized (code * scale, exact in float32)
TileShape exact_tile_shape(int64_t M);
// c = the tile's sums: rows of float32 x (ldx apart) by the np full panels at panels[0 .. np). Each output: four
// float32 chains over k (k mod 4 = 0, 1, 2, 3; each in increasing k), added as (s0 + s1) + (s2 + s3).
void exact_tile(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks,
                float* c);

}  // namespace stateserve_q8
