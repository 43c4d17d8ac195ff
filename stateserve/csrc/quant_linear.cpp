// y = x @ W^T (+ bias) with W in llama.cpp's Q8_0 format (int8 codes, a float16 scale per block of 32 along K):
// the entry points, the packing at load into 16-row panels (layout: quant_q8_0.h) and the loop over rows and
// panels that calls the register tiles of quant_a8.cpp (int8 activations, integer dot products: the fast mode) and
// quant_exact.cpp (float activations, weights dequantized in registers: exact up to float32 round-off).
// Few rows (decode): each thread streams its share of the panels once, in address order, all rows of x per tile.
// Many rows (prefill): rows go kRowBlock at a time; within a pass a group of panels (up to 3 x 16 x K weights) stays
// in L2 while every row tile of the pass multiplies it, as packed_linear.cpp does.
// Every output is computed by the same sequence of operations whatever the tile it falls in or the number of rows,
// so a row's result does not depend on what it is batched with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <memory>
#include "kernels.h"
#include "quant_q8_0.h"
#include "simd.h"

namespace {
using namespace stateserve_q8;

constexpr int64_t kRowBlock = 256;  // rows of x per pass over W

// The panel of rows 16p .. 16p + 16 (fewer for the last one): its layout and its place in the packed tensor.
PanelLayout layout_of(int64_t p, int64_t N, int64_t blocks) {
  return {std::min(kPanelRows, N - p * kPanelRows), blocks};
}
int64_t panel_offset(int64_t p, int64_t blocks) { return p * panel_bytes(blocks); }

int64_t packed_size(int64_t N, int64_t K) {
  const int64_t blocks = K / kBlock, panels = (N + kPanelRows - 1) / kPanelRows;
  const int64_t data = panels == 0 ? 0 : panel_offset(panels - 1, blocks) + layout_of(panels - 1, N, blocks).bytes();
  return data + kTrailerBytes;
}

// The packed tensor's checks: uint8, 1-D, the trailer written by q8_0_pack for this N and K.
void check_packed(const torch::Tensor& packed, int64_t N, int64_t K, const char* fn) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous(), fn,
              ": packed must be the uint8 tensor q8_0_pack returned");
  TORCH_CHECK(K > 0 && K % kBlock == 0, fn, ": K = ", K, " is not a positive multiple of ", kBlock);
  int64_t trailer[4] = {0, 0, 0, 0};
  if (packed.numel() >= kTrailerBytes)
    std::memcpy(trailer, packed.data_ptr<uint8_t>() + packed.numel() - kTrailerBytes, sizeof(trailer));
  TORCH_CHECK(trailer[0] == kMagic, fn, ": packed is not a packed Q8_0 weight (no q8_0_pack trailer)");
  TORCH_CHECK(trailer[1] == N && trailer[2] == K, fn, ": packed holds a [", trailer[1], ", ", trailer[2],
              "] weight, not the [", N, ", ", K, "] asked for");
  TORCH_CHECK(packed.numel() == packed_size(N, K) && trailer[3] == panel_bytes(K / kBlock), fn, ": packed has ",
              packed.numel(), " bytes, a [", N, ", ", K, "] weight takes ", packed_size(N, K));
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

// The rows x panels loop. tile(m, mr, p0, np, c) writes the float32 sums of rows m .. m + mr of x by panels p0 ..
// p0 + np into c.
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

template <typename T>
void run(const torch::Tensor& x, const uint8_t* packed, int64_t N, int64_t K, const T* bias, T* out,
         bool quantize_activations) {
  const int64_t M = x.size(0), blocks = K / kBlock, full = N / kPanelRows;
  // the last panel's rows widened to a full panel (zeros past them), the layout the tiles read
  std::unique_ptr<uint8_t[]> last;
  if (N % kPanelRows != 0) {
    const PanelLayout from = layout_of(full, N, blocks), to = {kPanelRows, blocks};
    last.reset(new uint8_t[to.bytes()]());
    const uint8_t* src = packed + panel_offset(full, blocks);
    for (int64_t r = 0; r < from.rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t k = 0; k < kBlock; ++k) last[to.code(b, r, k)] = src[from.code(b, r, k)];
        std::memcpy(&last[to.scale(b, r)], src + from.scale(b, r), 4);
        std::memcpy(&last[to.sum(b, r)], src + from.sum(b, r), 2);
      }
  }
  // the np full panels from p0 on
  const auto panels_at = [&](int64_t p0, int np, const uint8_t** ptrs) {
    for (int i = 0; i < np; ++i) ptrs[i] = p0 + i < full ? packed + panel_offset(p0 + i, blocks) : last.get();
  };
  if (quantize_activations) {
    // x quantized once, row by row: codes [M, K] and the blocks' scales [M, B]
    std::unique_ptr<uint8_t[]> q(new uint8_t[M * K]);  // not zeroed: every byte is written
    std::unique_ptr<float[]> d(new float[M * blocks]);
    const T* xp = x.data_ptr<T>();
    const int64_t ldx = x.stride(0);
    at::parallel_for(0, M, stateserve_simd::rows_grain(K, 1), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) a8_quantize_row(xp + m * ldx, K, q.get() + m * K, d.get() + m * blocks);
    });
    run_tiles(M, N, K, a8_tile_shape(M), bias, out, [&](int64_t m, int mr, int64_t p0, int np, float* c) {
      const uint8_t* ptrs[kMaxTilePanels];
      panels_at(p0, np, ptrs);
      a8_tile(mr, np, q.get() + m * K, K, d.get() + m * blocks, blocks, ptrs, blocks, c);
    });
  } else {
    torch::Tensor xf = x;  // float32 rows (bfloat16 widened, exactly)
    if (x.scalar_type() != at::kFloat) xf = x.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
    const float* xp = xf.data_ptr<float>();
    const int64_t ldx = xf.stride(0);
    run_tiles(M, N, K, exact_tile_shape(M), bias, out, [&](int64_t m, int mr, int64_t p0, int np, float* c) {
      const uint8_t* ptrs[kMaxTilePanels];
      panels_at(p0, np, ptrs);
      exact_tile(mr, np, xp + m * ldx, ldx, ptrs, blocks, c);
    });
  }
}

}  // namespace

bool q8_0_supported() { return true; }

std::string q8_0_dot_path() { return a8_path(); }

// codes: int8 [N, K], K a multiple of 32; scales: float16 [N, K / 32]. Returns the packed weight (uint8, 1-D; layout
// in quant_q8_0.h), resident ~1.12x the bytes of codes and scales (plus 32 bytes, and a full panel's padding).
torch::Tensor q8_0_pack(torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "q8_0_pack: codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = K / kBlock;
  TORCH_CHECK(K > 0 && K % kBlock == 0, "q8_0_pack: K = ", K, " is not a positive multiple of ", kBlock);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.size(0) == N &&
                  scales.size(1) == blocks,
              "q8_0_pack: scales must be float16 [N, K / 32] = [", N, ", ", blocks, "], got ", scales.sizes(), " ",
              scales.scalar_type());
  codes = codes.contiguous();
  scales = scales.contiguous();
  const int64_t panels = (N + kPanelRows - 1) / kPanelRows, size = packed_size(N, K);
  auto packed = torch::zeros({size}, torch::dtype(torch::kUInt8));  // zeros: the padding
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t trailer[4] = {kMagic, N, K, panel_bytes(blocks)};
  std::memcpy(dst + size - kTrailerBytes, trailer, sizeof(trailer));
  const int8_t* w = codes.data_ptr<int8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + panel_offset(p, blocks);
      const PanelLayout lay = layout_of(p, N, blocks);
      for (int64_t r = 0; r < lay.rows; ++r) {
        const int64_t n = p * kPanelRows + r;
        for (int64_t b = 0; b < blocks; ++b) {
          int16_t sum = 0;
          for (int64_t k = 0; k < kBlock; ++k) {
            const int8_t code = w[n * K + b * kBlock + k];
            panel[lay.code(b, r, k)] = static_cast<uint8_t>(code);
            sum = static_cast<int16_t>(sum + code);  // |sum| <= 32 * 128
          }
          const float scale = static_cast<float>(s[n * blocks + b]);
          std::memcpy(panel + lay.scale(b, r), &scale, sizeof(scale));
          std::memcpy(panel + lay.sum(b, r), &sum, sizeof(sum));
        }
      }
    }
  });
  return packed;
}

// The codes (int8 [N, K]) and scales (float16 [N, K / 32]) a packed weight holds.
std::vector<torch::Tensor> q8_0_unpack(torch::Tensor packed, int64_t N, int64_t K) {
  check_packed(packed, N, K, "q8_0_unpack");
  const int64_t blocks = K / kBlock;
  auto codes = torch::empty({N, K}, torch::dtype(torch::kInt8));
  auto scales = torch::empty({N, blocks}, torch::dtype(torch::kFloat16));
  int8_t* w = codes.data_ptr<int8_t>();
  at::Half* s = scales.data_ptr<at::Half>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanelRows, r = n % kPanelRows;
    const uint8_t* panel = packed.data_ptr<uint8_t>() + panel_offset(p, blocks);
    const PanelLayout lay = layout_of(p, N, blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t k = 0; k < kBlock; ++k) w[n * K + b * kBlock + k] = static_cast<int8_t>(panel[lay.code(b, r, k)]);
      float scale;
      std::memcpy(&scale, panel + lay.scale(b, r), sizeof(scale));
      s[n * blocks + b] = static_cast<at::Half>(scale);  // exact: it was a float16
    }
  }
  return {codes, scales};
}

// x: [M, K] float32 or bfloat16, unit stride along K; packed: q8_0_pack of a [N, K] weight; bias: [N] in x's dtype
// or None. Returns x @ W^T + bias as [M, N] in x's dtype (float32 sums, the bias added before the final rounding).
// quantize_activations: x's rows quantized per block of 32 as llama.cpp's quantize_row_q8_0, integer dot products
// (quant_a8.cpp); else x as float32 times the dequantized weights (quant_exact.cpp).
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations) {
  TORCH_CHECK(x.dim() == 2, "q8_0_linear: x must be [M, K], got ", x.dim(), " dimensions");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "q8_0_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(K % kBlock == 0, "q8_0_linear: K = ", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(x.size(1) == K, "q8_0_linear: x has ", x.size(1), " columns, the weight K = ", K);
  check_packed(packed, N, K, "q8_0_linear");
  if (x.stride(1) != 1) x = x.contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.numel() == N && b.scalar_type() == x.scalar_type(),
                "q8_0_linear: bias must be [N] = [", N, "] in x's dtype ", x.scalar_type());
  }
  auto out = torch::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  const uint8_t* panels = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, panels, N, K, b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>(),
               quantize_activations);
  } else {
    using bf = at::BFloat16;
    run<bf>(x, panels, N, K, b.defined() ? b.data_ptr<bf>() : nullptr, out.data_ptr<bf>(), quantize_activations);
  }
  return out;
}
