// y = x @ W^T (+ bias) with W in llama.cpp's Q6_K format: the entry points and the packing at load into 16-row
// panels (layout: quant_q6k.h). The loop over rows and panels (quant_tiles.h) calls the register tiles of
// quant_q6k_a8.cpp (int8 activations, integer dot products: the fast mode) and quant_q6k_exact.cpp (float
// activations, weights dequantized in registers: exact up to float32 round-off).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cstring>
#include "kernels.h"
#include "quant_q6k.h"

namespace {
using namespace stateserve_q6k;

void check_k(int64_t K, const char* fn) {
  TORCH_CHECK(K > 0 && K % kSuperBlock == 0, fn, ": K = ", K, " is not a positive multiple of ", kSuperBlock,
              " (q6_k)");
}

// The packed tensor's checks: uint8, 1-D, the trailer written by q6_k_pack for this N and K.
void check_packed(const at::Tensor& packed, int64_t N, int64_t K, const char* fn) {
  const int64_t magic = packed_magic(packed, fn, "q6_k_pack");
  TORCH_CHECK(magic == kMagic, fn, ": packed is not a packed Q6_K weight (no q6_k_pack trailer)");
  check_k(K, fn);
  check_packed_shape(packed, panel_format(K), N, K, fn);
}

// Where a panel of `rows` rows keeps row r's values: the byte of the low 4 bits and of the top 2 bits of code k
// (0 .. 31) of block b (shifted by low_shift(k), top_shift(k)), sc of sub-block j, d of super-block s.
struct Layout {
  PanelFormat f;
  int64_t rows;
  int64_t low(int64_t b, int64_t r, int64_t k) const {
    return f.at(0, 6 * b + k / 16 * 2 + k % 16 / 8, r, rows) + k % 4;
  }
  int64_t top(int64_t b, int64_t r, int64_t k) const { return f.at(0, 6 * b + 4 + k / 16, r, rows) + k % 4; }
  static int low_shift(int64_t k) { return k % 8 / 4 * 4; }
  static int top_shift(int64_t k) { return k % 16 / 4 * 2; }
  int64_t sc(int64_t j, int64_t r) const { return f.at(1, j, r, rows); }
  int64_t d(int64_t s, int64_t r) const { return f.at(2, s, r, rows); }
};

Layout layout_of(int64_t p, int64_t N, int64_t K) {
  return {panel_format(K), std::min(kPanelRows, N - p * kPanelRows)};
}

}  // namespace

// codes: uint8 [N, K] in 0 .. 63, K a multiple of 256; sc: int8 [N, K / 16]; d: float16 [N, K / 256] (w = d * sc *
// (codes - 32), ggml_types.q6_k_fields' fields). Returns the packed weight (uint8, 1-D; layout in quant_q6k.h),
// resident as GGUF's 210 bytes per 256 values, plus 32 bytes and a full panel's padding.
at::Tensor q6_k_pack(at::Tensor codes, at::Tensor sc, at::Tensor d) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "q6_k_pack: codes must be uint8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), subs = K / kSubBlock, supers = K / kSuperBlock;
  check_k(K, "q6_k_pack");
  TORCH_CHECK(sc.dim() == 2 && sc.scalar_type() == at::kChar && sc.size(0) == N && sc.size(1) == subs,
              "q6_k_pack: sc must be int8 [N, K / 16] = [", N, ", ", subs, "], got ", sc.sizes(), " ",
              sc.scalar_type());
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.size(0) == N && d.size(1) == supers,
              "q6_k_pack: d must be float16 [N, K / 256] = [", N, ", ", supers, "], got ", d.sizes(), " ",
              d.scalar_type());
  codes = codes.contiguous();
  sc = sc.contiguous();
  d = d.contiguous();
  TORCH_CHECK(codes.numel() == 0 || codes.max().item<int64_t>() <= 63, "q6_k_pack: codes must be in 0 .. 63");
  const PanelFormat pf = panel_format(K);
  auto packed = new_packed(pf, N, K);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const auto* scp = reinterpret_cast<const uint8_t*>(sc.data_ptr<int8_t>());
  const auto* dp = reinterpret_cast<const uint8_t*>(d.data_ptr<at::Half>());
  const int64_t blocks = K / kBlock;
  at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * pf.full_bytes();
      const Layout lay = layout_of(p, N, K);
      for (int64_t r = 0; r < lay.rows; ++r) {
        const int64_t n = p * kPanelRows + r;
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t k = 0; k < kBlock; ++k) {
            const uint8_t code = w[n * K + b * kBlock + k];
            panel[lay.low(b, r, k)] |= static_cast<uint8_t>((code & 15) << Layout::low_shift(k));
            panel[lay.top(b, r, k)] |= static_cast<uint8_t>((code >> 4) << Layout::top_shift(k));
          }
        for (int64_t j = 0; j < subs; ++j) panel[lay.sc(j, r)] = scp[n * subs + j];
        for (int64_t s = 0; s < supers; ++s) std::memcpy(panel + lay.d(s, r), dp + 2 * (n * supers + s), 2);
      }
    }
  });
  return packed;
}

// The fields a packed Q6_K weight holds: (codes, sc, d) as q6_k_pack takes them.
std::vector<at::Tensor> q6_k_unpack(at::Tensor packed, int64_t N, int64_t K) {
  check_packed(packed, N, K, "q6_k_unpack");
  const int64_t blocks = K / kBlock, subs = K / kSubBlock, supers = K / kSuperBlock;
  const int64_t panel_bytes = panel_format(K).full_bytes();
  auto codes = at::empty({N, K}, at::dtype(at::kByte));
  auto sc = at::empty({N, subs}, at::dtype(at::kChar));
  auto d = at::empty({N, supers}, at::dtype(at::kHalf));
  uint8_t* w = codes.data_ptr<uint8_t>();
  auto* scp = reinterpret_cast<uint8_t*>(sc.data_ptr<int8_t>());
  auto* dp = reinterpret_cast<uint8_t*>(d.data_ptr<at::Half>());
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanelRows, r = n % kPanelRows;
    const uint8_t* panel = packed.data_ptr<uint8_t>() + p * panel_bytes;
    const Layout lay = layout_of(p, N, K);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k = 0; k < kBlock; ++k) {
        const int low = (panel[lay.low(b, r, k)] >> Layout::low_shift(k)) & 15;
        const int top = (panel[lay.top(b, r, k)] >> Layout::top_shift(k)) & 3;
        w[n * K + b * kBlock + k] = static_cast<uint8_t>(low | top << 4);
      }
    for (int64_t j = 0; j < subs; ++j) scp[n * subs + j] = panel[lay.sc(j, r)];
    for (int64_t s = 0; s < supers; ++s) std::memcpy(dp + 2 * (n * supers + s), panel + lay.d(s, r), 2);
  }
  return {codes, sc, d};
}

// x: [M, K] float32 or bfloat16, unit stride along K; packed: q6_k_pack of a [N, K] weight; bias: [N] in x's dtype
// or None. Returns x @ W^T + bias as [M, N] in x's dtype (float32 sums, the bias added before the final rounding).
// quantize_activations: x's rows quantized per block of 32 as llama.cpp's quantize_row_q8_0, integer dot products
// (quant_q6k_a8.cpp); else x as float32 times the dequantized weights (quant_q6k_exact.cpp).
at::Tensor q6_k_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations) {
  check_k(K, "q6_k_linear");
  const LinearArgs args = linear_args(x, bias, N, K, kSuperBlock, "q6_k_linear");
  check_packed(packed, N, K, "q6_k_linear");
  const int64_t M = args.x.size(0), blocks = K / kBlock;
  return linear_out(args, N, [&](auto* b, auto* out) {
    const Panels panels(packed.data_ptr<uint8_t>(), N, panel_format(K));
    const auto a8 = [&](const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd, int mr, int np,
                        const uint8_t* const* ptrs, float* c) { a8_tile(mr, np, q, ldq, d, s, ldd, ptrs, blocks, c); };
    const auto exact = [&](const float* xp, int64_t ldx, int mr, int np, const uint8_t* const* ptrs, float* c) {
      exact_tile(mr, np, xp, ldx, ptrs, blocks, c);
    };
    run_product(args.x, panels, N, K, b, out, {quantize_activations, false, kSubBlock}, a8_tile_shape(M), a8,
                exact_tile_shape(M), exact);
  });
}
