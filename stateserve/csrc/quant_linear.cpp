// y = x @ W^T (+ bias) with W in llama.cpp's Q8_0 format (int8 codes, a float16 scale per block of 32 along K):
// the entry points and the packing at load into 16-row panels (layout: quant_q8_0.h). The loop over rows and panels
// (quant_tiles.h) calls the register tiles of quant_a8.cpp (int8 activations, integer dot products: the fast mode)
// and quant_exact.cpp (float activations, weights dequantized in registers: exact up to float32 round-off).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "kernels.h"
#include "quant_q8_0.h"

namespace {
using namespace stateserve_q8;

// The packed tensor's checks: uint8, 1-D, the trailer written by q8_0_pack for this N and K.
void check_packed(const at::Tensor& packed, int64_t N, int64_t K, const char* fn) {
  const int64_t magic = packed_magic(packed, fn, "q8_0_pack");
  TORCH_CHECK(K > 0 && K % kBlock == 0, fn, ": K = ", K, " is not a positive multiple of ", kBlock);
  TORCH_CHECK(magic == kMagic, fn, ": packed is not a packed Q8_0 weight (no q8_0_pack trailer)");
  check_packed_shape(packed, panel_format(K), N, K, fn);
}

PanelLayout layout_of(int64_t p, int64_t N, int64_t K) {
  return {panel_format(K), std::min(kPanelRows, N - p * kPanelRows)};
}

}  // namespace

bool q8_0_supported() { return true; }

std::string q8_0_dot_path() { return a8_path(); }

// codes: int8 [N, K], K a multiple of 32; scales: float16 [N, K / 32]. Returns the packed weight (uint8, 1-D; layout
// in quant_q8_0.h), resident ~1.12x the bytes of codes and scales (plus 32 bytes, and a full panel's padding).
at::Tensor q8_0_pack(at::Tensor codes, at::Tensor scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "q8_0_pack: codes must be int8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = K / kBlock;
  TORCH_CHECK(K > 0 && K % kBlock == 0, "q8_0_pack: K = ", K, " is not a positive multiple of ", kBlock);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.size(0) == N &&
                  scales.size(1) == blocks,
              "q8_0_pack: scales must be float16 [N, K / 32] = [", N, ", ", blocks, "], got ", scales.sizes(), " ",
              scales.scalar_type());
  codes = codes.contiguous();
  scales = scales.contiguous();
  const PanelFormat format = panel_format(K);
  auto packed = new_packed(format, N, K);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int8_t* w = codes.data_ptr<int8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * format.full_bytes();
      const PanelLayout lay = layout_of(p, N, K);
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
std::vector<at::Tensor> q8_0_unpack(at::Tensor packed, int64_t N, int64_t K) {
  check_packed(packed, N, K, "q8_0_unpack");
  const int64_t blocks = K / kBlock, panel_bytes = panel_format(K).full_bytes();
  auto codes = at::empty({N, K}, at::dtype(at::kChar));
  auto scales = at::empty({N, blocks}, at::dtype(at::kHalf));
  int8_t* w = codes.data_ptr<int8_t>();
  at::Half* s = scales.data_ptr<at::Half>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanelRows, r = n % kPanelRows;
    const uint8_t* panel = packed.data_ptr<uint8_t>() + p * panel_bytes;
    const PanelLayout lay = layout_of(p, N, K);
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
at::Tensor q8_0_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations) {
  const LinearArgs args = linear_args(x, bias, N, K, kBlock, "q8_0_linear");
  check_packed(packed, N, K, "q8_0_linear");
  const int64_t M = args.x.size(0), blocks = K / kBlock;
  return linear_out(args, N, [&](auto* b, auto* out) {
    const Panels panels(packed.data_ptr<uint8_t>(), N, panel_format(K));
    const auto a8 = [&](const uint8_t* q, int64_t ldq, const float* d, const int32_t*, int64_t ldd, int mr, int np,
                        const uint8_t* const* ptrs, float* c) { a8_tile(mr, np, q, ldq, d, ldd, ptrs, blocks, c); };
    const auto exact = [&](const float* xp, int64_t ldx, int mr, int np, const uint8_t* const* ptrs, float* c) {
      exact_tile(mr, np, xp, ldx, ptrs, blocks, c);
    };
    run_product(args.x, panels, N, K, b, out, {quantize_activations, kOffsetCodes, 0}, a8_tile_shape(M), a8,
                exact_tile_shape(M), exact);
  });
}
