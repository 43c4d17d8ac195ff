// Q8_0 products with float32 activations (no activation rounding; quant_q8_0.h has the packed layout): each weight
// dequantized in registers as float(code) * float(scale), which is exact in float32 (8 by 11 significant bits), and
// multiplied into float32 sums with FMA. Each output is four chains over k, one per position j of k within its group
// of 4 (the four bytes of a lane: four independent chains keep a single row of x from waiting on FMA latency),
// added as (s0 + s1) + (s2 + s3) at the end: the same order for every output, whatever the tile or M. Each chain
// has K / 4 terms, so the sum errs by well under gamma_K * sum |x w| before the output's rounding.
// Vectors of 16 lanes (AVX-512F) or 8 (AVX2: a panel's two halves one after the other); the portable loops
// otherwise.
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

#if SS_HAS_AVX512
struct Ops : Lanes16 {
  template <int J>
  static F code(I w) {  // byte J of each lane, sign-extended, as float32
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(J == 3 ? w : _mm512_slli_epi32(w, 24 - 8 * J), 24));
  }
};
constexpr TileShape kShape = {4, 1};
#elif SS_HAS_AVX2
struct Ops : Lanes8 {
  template <int J>
  static F code(I w) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(J == 3 ? w : _mm256_slli_epi32(w, 24 - 8 * J), 24));
  }
};
constexpr TileShape kShape = {2, 1};  // 16 registers: 8 chains, 4 dequantized vectors, the scales, a broadcast
#endif

#if SS_HAS_SIMD
// MR rows of x by one vector of kLanes rows of W: rec0 is that vector's place in block 0's record (its codes, and
// kCodeBytes on its scales).
template <int MR>
void tile(const float* x, int64_t ldx, const uint8_t* rec0, int64_t blocks, float* c) {
  using F = Ops::F;
  F acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = Ops::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = rec0 + b * kRecordBytes;
    const F scale = Ops::load_f32(rec + kCodeBytes);
    for (int g = 0; g < kGroups; ++g) {
      const Ops::I w = Ops::load(rec + g * kGroupBytes);
      const F wf[4] = {Ops::mul(Ops::code<0>(w), scale), Ops::mul(Ops::code<1>(w), scale),
                       Ops::mul(Ops::code<2>(w), scale), Ops::mul(Ops::code<3>(w), scale)};
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + b * kBlock + 4 * g;
        for (int j = 0; j < 4; ++j) acc[r][j] = Ops::fmadd(Ops::set1(xr[j]), wf[j], acc[r][j]);
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

void exact_tile(int mr, int np, const float* x, int64_t ldx, const uint8_t* const* panels, int64_t blocks,
                float* c) {
#if SS_HAS_SIMD
  constexpr int L = Ops::kLanes;
  dispatch_tile<kShape.rows, 1, kShape.rows, 1>(mr, 1, [&](auto rows, auto) {
    for (int v = 0; v < np * (kPanelRows / L); ++v)  // one vector of rows of W after the other
      tile<decltype(rows)::value>(x, ldx, panels[v * L / kPanelRows] + (v * L % kPanelRows) * 4, blocks, c + v * L);
  });
#else
  for (int r = 0; r < mr; ++r)
    for (int64_t col = 0; col < np * kPanelRows; ++col) {
      const uint8_t* p = panels[col / kPanelRows];
      const int64_t row = col % kPanelRows;
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* rec = p + b * kRecordBytes;
        float scale;
        std::memcpy(&scale, rec + kCodeBytes + row * 4, sizeof(scale));
        for (int64_t k = 0; k < kBlock; ++k) {
          const float w = static_cast<float>(static_cast<int8_t>(rec[(k / 4) * kGroupBytes + row * 4 + k % 4])) * scale;
          s[k % 4] = s[k % 4] + x[r * ldx + b * kBlock + k] * w;
        }
      }
      c[r * kTileStride + col] = (s[0] + s[1]) + (s[2] + s[3]);
    }
#endif
}

}  // namespace stateserve_q8
