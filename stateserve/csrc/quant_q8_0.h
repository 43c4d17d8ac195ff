// llama.cpp's Q8_0 weights as the kernels of quant_linear.cpp (entry points, packing, the row loop), quant_a8.cpp
// (int8 activations, integer dot products) and quant_exact.cpp (float activations, weights dequantized in
// registers) keep them: the packed layout and what the three files call of each other.
//
// Q8_0: W [N, K], K a multiple of 32, as int8 codes [N, K] and float16 scales [N, K / 32]; block b of row n is
// codes[n, 32b .. 32b + 32) * scales[n, b].
//
// The packed tensor (uint8, 1-D): ceil(N / 16) panels of 16 rows of W, then a 32-byte trailer (kMagic, N, K, the
// panel size in bytes). A panel of R rows (16, or N % 16 for the last one) holds, with B = K / 32:
//   B records of 36 R bytes, block b's record: its codes as 8 groups of 4 values of k, a group's 4 R bytes the
//     R rows' 4 codes in row order (byte g * 4R + r * 4 + j = code of row r at k = 32b + 4g + j: with R = 16 the
//     four bytes of int32 lane r of a vector, which vpdpbusd / vpmaddubsw + vpmaddwd add in one step), then the R
//     rows' scales as float32;
//   then B x R int16: the sums of each row's 32 codes per block (the correction of the u8 x s8 products, see
//   quant_a8.cpp). A full panel is padded with zeros to a multiple of 64 bytes (panel_bytes(B)).
// Full panels are the kernels' layout: records of 9 cache lines, every vector load of codes aligned (the panels
// start the allocation). The last panel of N % 16 rows is stored with its rows only (a small weight's padding would
// be most of it) and widened to 16 rows (zeros) in a buffer for each product, which costs one panel's copy.
// Size: 608 bytes per 16 x 32 weights against Q8_0's 544 (1.12x), plus the padding and the trailer.
#pragma once
#include <torch/extension.h>
#include <cstdint>

namespace stateserve_q8 {

constexpr int64_t kBlock = 32;                                   // values of k per Q8_0 block
constexpr int64_t kPanelRows = 16;                               // rows of W (output columns) per panel
constexpr int64_t kGroups = kBlock / 4;                          // groups of 4 values of k per block
constexpr int64_t kGroupBytes = kPanelRows * 4;                  // 64
constexpr int64_t kCodeBytes = kGroups * kGroupBytes;            // 512
constexpr int64_t kRecordBytes = kCodeBytes + kPanelRows * 4;    // codes + float32 scales: 576
constexpr int64_t kSumBytes = kPanelRows * 2;                    // int16 code sums of one block: 32
constexpr int64_t kTrailerBytes = 32;
constexpr int64_t kMagic = 0x32765f3038515353;                   // "SSQ80_v2"

inline int64_t panel_bytes(int64_t blocks) { return (blocks * (kRecordBytes + kSumBytes) + 63) / 64 * 64; }
inline int64_t sums_offset(int64_t blocks, int64_t b) { return blocks * kRecordBytes + b * kSumBytes; }

// Where a panel of `rows` rows keeps block b's values (rows 16: the offsets above).
struct PanelLayout {
  int64_t rows, blocks;
  int64_t code(int64_t b, int64_t r, int64_t k) const { return b * 36 * rows + (k / 4) * 4 * rows + r * 4 + k % 4; }
  int64_t scale(int64_t b, int64_t r) const { return b * 36 * rows + 32 * rows + 4 * r; }
  int64_t sum(int64_t b, int64_t r) const { return blocks * 36 * rows + b * 2 * rows + 2 * r; }
  int64_t bytes() const { return rows == kPanelRows ? panel_bytes(blocks) : blocks * 38 * rows; }
};

// A register tile: up to `rows` rows of x by `panels` panels (the shape a product of M rows is cut into). The tiles
// write their float32 sums (no bias, not rounded) to c[r * kTileStride + column in the tile]; a tile is at most
// kMaxTileRows x kMaxTilePanels.
struct TileShape {
  int rows, panels;
};
constexpr int kMaxTileRows = 8;
constexpr int kMaxTilePanels = 3;
constexpr int64_t kTileStride = kMaxTilePanels * kPanelRows;

// ---- quant_a8.cpp: int8 activations
// The integer product this build uses: "avx512_vnni", "avx512bw", "avx2" or "scalar".
const char* a8_path();
TileShape a8_tile_shape(int64_t M);
// One row of x quantized as llama.cpp's quantize_row_q8_0: per block of 32, d = amax / 127, codes roundf(x / d)
// (0 when d is 0) into q [K] (stored + 128 as unsigned bytes where the build's product wants them: a8_path()
// avx512_vnni), and float(float16(d)) into d [K / 32].
void a8_quantize_row(const float* x, int64_t K, uint8_t* q, float* d);
void a8_quantize_row(const at::BFloat16* x, int64_t K, uint8_t* q, float* d);
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
