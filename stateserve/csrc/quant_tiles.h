// What the quantized linears share (Q8_0: quant_linear.cpp; Q4_0, Q4_1, Q4_K: quant_q4_linear.cpp; Q6_K:
// quant_q6k_linear.cpp): the packed tensor's panels and trailer, the widening of its last panel, the loop over rows of
// x and groups of panels that calls a format's register tiles, the two modes (int8 activations: x quantized per block
// of 32 as llama.cpp's quantize_row_q8_0, quant_activations.cpp; float32 activations) and the entry points' argument
// checks.
//
// A packed weight (uint8, 1-D): ceil(N / 16) panels of 16 rows of W (output columns), then a 32-byte trailer of
// four int64 (the format's magic, N, K, a full panel's bytes). A panel is a few segments one after the other;
// segment s is `units` units of the panel's rows' `width` bytes each, in row order ([units][rows][width]), so a
// unit of a full panel is one vector of 16 rows' values. Full panels are padded with zeros to a multiple of 64
// bytes (the tiles' vector loads of a unit stay aligned: the panels start the allocation). The last panel of
// N % 16 rows keeps its rows only (a small weight's padding would be most of it) and is widened to 16 rows (zeros)
// in a buffer for each product, a copy of one panel.
// Every output is computed by the same sequence of operations whatever the tile it falls in or the number of rows,
// so a row's result does not depend on what it is batched with.
#pragma once
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include "simd.h"

namespace stateserve_quant {

constexpr int64_t kBlock = 32;      // values of k per block (and per block of x's int8 quantization)
constexpr int64_t kPanelRows = 16;  // rows of W per panel
constexpr int64_t kTrailerBytes = 32;

struct Segment {
  int64_t units, width;
};
// A format's panel at one K: its segments (a full panel: 16 rows) and the trailer's magic.
struct PanelFormat {
  int64_t magic;
  Segment seg[3];
  int count;
  int64_t start(int s, int64_t rows) const {  // segment s's first byte in a panel of `rows` rows
    int64_t at = 0;
    for (int i = 0; i < s; ++i) at += seg[i].units * seg[i].width * rows;
    return at;
  }
  int64_t at(int s, int64_t unit, int64_t r, int64_t rows) const {  // row r's first byte of a unit
    return start(s, rows) + (unit * rows + r) * seg[s].width;
  }
  int64_t full_bytes() const { return (start(count, kPanelRows) + 63) / 64 * 64; }
  int64_t bytes(int64_t rows) const { return rows == kPanelRows ? full_bytes() : start(count, rows); }
  int64_t packed_size(int64_t N) const {
    const int64_t rest = N % kPanelRows;
    return N / kPanelRows * full_bytes() + (rest != 0 ? bytes(rest) : 0) + kTrailerBytes;
  }
};

// A zeroed packed tensor of N rows with its trailer written; the panels' bytes are the caller's.
inline at::Tensor new_packed(const PanelFormat& f, int64_t N, int64_t K) {
  const int64_t size = f.packed_size(N);
  auto packed = at::zeros({size}, at::dtype(at::kByte));  // zeros: the padding
  const int64_t trailer[4] = {f.magic, N, K, f.full_bytes()};
  std::memcpy(packed.data_ptr<uint8_t>() + size - kTrailerBytes, trailer, sizeof(trailer));
  return packed;
}

// The trailer's magic (0 where packed is too short to hold one), after checking packed is a uint8 vector.
inline int64_t packed_magic(const at::Tensor& packed, const char* fn, const char* pack_fn) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(), fn,
              ": packed must be the uint8 tensor ", pack_fn, " returned");
  int64_t magic = 0;
  if (packed.numel() >= kTrailerBytes)
    std::memcpy(&magic, packed.data_ptr<uint8_t>() + packed.numel() - kTrailerBytes, sizeof(magic));
  return magic;
}

// The rest of the trailer: the [N, K] weight asked for, and the size that format gives it.
inline void check_packed_shape(const at::Tensor& packed, const PanelFormat& f, int64_t N, int64_t K,
                               const char* fn) {
  int64_t trailer[4];
  std::memcpy(trailer, packed.data_ptr<uint8_t>() + packed.numel() - kTrailerBytes, sizeof(trailer));
  TORCH_CHECK(trailer[1] == N && trailer[2] == K, fn, ": packed holds a [", trailer[1], ", ", trailer[2],
              "] weight, not the [", N, ", ", K, "] asked for");
  TORCH_CHECK(packed.numel() == f.packed_size(N) && trailer[3] == f.full_bytes(), fn, ": packed has ",
              packed.numel(), " bytes, a [", N, ", ", K, "] weight takes ", f.packed_size(N));
}

// The full panels of a packed weight by index, the last one (N % 16 rows) widened to 16 rows in a buffer.
class Panels {
 public:
  Panels(const uint8_t* packed, int64_t N, const PanelFormat& f)
      : packed_(packed), full_(N / kPanelRows), bytes_(f.full_bytes()) {
    const int64_t rows = N % kPanelRows;
    if (rows == 0) return;
    last_.reset(new uint8_t[bytes_]());
    const uint8_t* src = packed + full_ * bytes_;
    for (int s = 0; s < f.count; ++s)
      for (int64_t u = 0; u < f.seg[s].units; ++u)
        std::memcpy(&last_[f.at(s, u, 0, kPanelRows)], src + f.at(s, u, 0, rows), rows * f.seg[s].width);
  }
  void at(int64_t p0, int np, const uint8_t** ptrs) const {  // the np panels from p0 on
    for (int i = 0; i < np; ++i) ptrs[i] = p0 + i < full_ ? packed_ + (p0 + i) * bytes_ : last_.get();
  }

 private:
  const uint8_t* packed_;
  int64_t full_, bytes_;
  std::unique_ptr<uint8_t[]> last_;
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

// A tile of mr rows by np panels as compile-time numbers: calls tile(rows, panels), both std::integral_constant,
// compiling only the shapes two tile shapes Few and Many cut products into (rows up to Few's with up to Few's
// panels, rows up to Many's with up to Many's; at most 6 rows).
template <int kFewRows, int kFewPanels, int kManyRows, int kManyPanels, typename Tile>
void dispatch_tile(int mr, int np, const Tile& tile) {
  constexpr int kRows = std::max(kFewRows, kManyRows);
  static_assert(kRows <= 6 && kRows <= kMaxTileRows && std::max(kFewPanels, kManyPanels) <= kMaxTilePanels,
                "the switch below");
  const auto with_panels = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    constexpr int kMaxNp = std::max(R <= kFewRows ? kFewPanels : 0, R <= kManyRows ? kManyPanels : 0);
    if constexpr (kMaxNp >= 3) if (np == 3) return tile(rows, std::integral_constant<int, 3>());
    if constexpr (kMaxNp >= 2) if (np == 2) return tile(rows, std::integral_constant<int, 2>());
    tile(rows, std::integral_constant<int, 1>());
  };
  switch (std::min(mr, kRows)) {  // (the tiles of more rows than kRows are never called)
    case 6: return with_panels(std::integral_constant<int, std::min(6, kRows)>());
    case 5: return with_panels(std::integral_constant<int, std::min(5, kRows)>());
    case 4: return with_panels(std::integral_constant<int, std::min(4, kRows)>());
    case 3: return with_panels(std::integral_constant<int, std::min(3, kRows)>());
    case 2: return with_panels(std::integral_constant<int, std::min(2, kRows)>());
    default: return with_panels(std::integral_constant<int, 1>());
  }
}

// out[r][0 .. cols) = c row r + bias, rounded to T.
template <typename T>
void store_tile(const float* c, int mr, int64_t cols, const T* bias, T* out, int64_t ldo) {
  for (int r = 0; r < mr; ++r) {
    int64_t n = 0;
#if SS_HAS_SIMD
    using V = stateserve_simd::F32Vec;
    for (; n + V::kWidth <= cols; n += V::kWidth) {
      auto v = V::load(c + r * kTileStride + n);
      if (bias != nullptr) v = V::add(v, V::load_from(bias + n));
      V::store_to(out + r * ldo + n, v);
    }
#endif
    for (; n < cols; ++n)
      out[r * ldo + n] = static_cast<T>(c[r * kTileStride + n] + (bias != nullptr ? static_cast<float>(bias[n]) : 0.f));
  }
}

constexpr int64_t kRowBlock = 256;  // rows of x per pass over W

// The rows x panels loop. tile(m, mr, p0, np, c) writes the float32 sums of rows m .. m + mr of x by panels p0 ..
// p0 + np into c. Few rows (decode): each thread streams its share of the panels once, in address order, all rows
// of x per tile. Many rows (prefill): rows go kRowBlock at a time; within a pass a group of panels stays in L2
// while every row tile of the pass multiplies it, as packed_linear.cpp does.
template <typename T, typename Tile>
void run_tiles(int64_t M, int64_t N, int64_t K, TileShape shape, const T* bias, T* out, const Tile& tile) {
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows;
  const int64_t groups = (panels + shape.panels - 1) / shape.panels;
  const int64_t threads = at::get_num_threads();
  for (int64_t row0 = 0; row0 < M; row0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - row0);
    const int64_t tiles = (rows + shape.rows - 1) / shape.rows;
    // tasks: (group of panels, chunk of rows), group-major, so that a thread reads its panels in address order;
    // rows are split only when the groups are too few to give every thread several
    const int64_t chunks = std::max<int64_t>(1, std::min(tiles, (4 * threads + groups - 1) / groups));
    const int64_t chunk_rows = (tiles + chunks - 1) / chunks * shape.rows;
    // tasks of under ~64K multiply-adds go together: a one-row product of a small weight runs inline
    const int64_t task_work = std::min(rows, chunk_rows) * shape.panels * kPanelRows * K;
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, task_work));
    at::parallel_for(0, groups * chunks, grain, [&](int64_t begin, int64_t end) {
      alignas(64) float c[kMaxTileRows * kTileStride];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t p0 = task / chunks * shape.panels, n0 = p0 * kPanelRows;
        const int np = static_cast<int>(std::min<int64_t>(shape.panels, panels - p0));
        const int64_t cols = std::min<int64_t>(np * kPanelRows, N - n0);
        const int64_t m_end = std::min(rows, (task % chunks + 1) * chunk_rows);
        for (int64_t m = (task % chunks) * chunk_rows; m < m_end; m += shape.rows) {
          const int mr = static_cast<int>(std::min<int64_t>(shape.rows, m_end - m));
          tile(row0 + m, mr, p0, np, c);
          store_tile(c, mr, cols, bias != nullptr ? bias + n0 : nullptr, out + (row0 + m) * N + n0, N);
        }
      }
    });
  }
}

// ---- quant_activations.cpp: one row of x quantized as llama.cpp's quantize_row_q8_0: per block of 32, d = amax /
// 127, codes roundf(x / d) in [-127, 127] (0 when d is 0) into q [K] (as signed bytes, or + 128 as unsigned bytes
// where `offset`: the Q8_0 vpdpbusd path), and float(float16(d)) into d [K / 32]; where sums is not null, the sum of
// the (signed) codes of each group of sum_values (32: a block, or 16) into sums [K / sum_values].
void a8_quantize_row(const float* x, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sums,
                     int64_t sum_values);
void a8_quantize_row(const at::BFloat16* x, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sums,
                     int64_t sum_values);

// How a format's tiles want x: int8 activations (A8) with or without code sums (per sum_values codes: 0 none, 32
// per block (Q4), 16 per half block (Q6_K)), or float32.
struct Activations {
  bool quantize, offset_codes;
  int64_t sum_values;
};

// y = x @ W^T + bias through run_tiles. A8: x quantized once, row by row, then
//   a8(q, ldq, d, sums, ldd, mr, np, panels, c) for rows q .. of codes (ldq bytes apart), their blocks' scales d
//   (ldd apart) and code sums (ldd * 32 / sum_values apart; null unless asked for);
// else x as float32 rows (bfloat16 widened, exactly), exact(x, ldx, mr, np, panels, c).
template <typename T, typename A8, typename Exact>
void run_product(const at::Tensor& x, const Panels& panels, int64_t N, int64_t K, const T* bias, T* out,
                 Activations act, TileShape a8_shape, const A8& a8, TileShape exact_shape, const Exact& exact) {
  const int64_t M = x.size(0), blocks = K / kBlock;
  if (act.quantize) {
    std::unique_ptr<uint8_t[]> q(new uint8_t[M * K]);  // not zeroed: every byte is written
    std::unique_ptr<float[]> d(new float[M * blocks]);
    const int64_t sums = act.sum_values != 0 ? K / act.sum_values : 0;  // per row
    std::unique_ptr<int32_t[]> s(sums != 0 ? new int32_t[M * sums] : nullptr);
    const T* xp = x.data_ptr<T>();
    const int64_t ldx = x.stride(0);
    at::parallel_for(0, M, stateserve_simd::rows_grain(K, 1), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m)
        a8_quantize_row(xp + m * ldx, K, act.offset_codes, q.get() + m * K, d.get() + m * blocks,
                        s ? s.get() + m * sums : nullptr, act.sum_values);
    });
    run_tiles(M, N, K, a8_shape, bias, out, [&](int64_t m, int mr, int64_t p0, int np, float* c) {
      const uint8_t* ptrs[kMaxTilePanels];
      panels.at(p0, np, ptrs);
      a8(q.get() + m * K, K, d.get() + m * blocks, s ? s.get() + m * sums : nullptr, blocks, mr, np, ptrs, c);
    });
  } else {
    at::Tensor xf = x;
    if (x.scalar_type() != at::kFloat) xf = x.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
    const float* xp = xf.data_ptr<float>();
    const int64_t ldx = xf.stride(0);
    run_tiles(M, N, K, exact_shape, bias, out, [&](int64_t m, int mr, int64_t p0, int np, float* c) {
      const uint8_t* ptrs[kMaxTilePanels];
      panels.at(p0, np, ptrs);
      exact(xp + m * ldx, ldx, mr, np, ptrs, c);
    });
  }
}

// A linear's x and bias checked (fn names the entry point): x [M, K] float32 or bfloat16 (made unit-stride along K
// where it is not), K a multiple of `block`, bias [N] in x's dtype or None.
struct LinearArgs {
  at::Tensor x, bias;
};
inline LinearArgs linear_args(at::Tensor x, const c10::optional<at::Tensor>& bias, int64_t N, int64_t K,
                              int64_t block, const char* fn) {
  TORCH_CHECK(x.dim() == 2, fn, ": x must be [M, K], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, fn,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(K > 0 && K % block == 0, fn, ": K = ", K, " is not a multiple of ", block);
  TORCH_CHECK(x.size(1) == K, fn, ": x has ", x.size(1), " columns, the weight K = ", K);
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.numel() == N && b.scalar_type() == x.scalar_type(), fn, ": bias must be [N] = [",
                N, "] in x's dtype ", x.scalar_type());
  }
  return {x, b};
}

// The [M, N] output in x's dtype T; run(bias, out) fills it (bias: const T*, null for none), unless it is empty.
template <typename Run>
at::Tensor linear_out(const LinearArgs& a, int64_t N, const Run& run) {
  auto out = at::empty({a.x.size(0), N}, a.x.options());
  if (a.x.size(0) == 0 || N == 0) return out;
  if (a.x.scalar_type() == at::kFloat) {
    run(a.bias.defined() ? a.bias.data_ptr<float>() : static_cast<const float*>(nullptr), out.data_ptr<float>());
  } else {
    using bf = at::BFloat16;
    run(a.bias.defined() ? a.bias.data_ptr<bf>() : static_cast<const bf*>(nullptr), out.data_ptr<bf>());
  }
  return out;
}

}  // namespace stateserve_quant
