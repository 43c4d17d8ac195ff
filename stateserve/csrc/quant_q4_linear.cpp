// y = x @ W^T (+ bias) with W in llama.cpp's Q4_0, Q4_1 or Q4_K format: the entry points and the packing at load
// into 16-row panels (layout and float steps: quant_q4.h). The loop over rows and panels (quant_tiles.h) calls the
// register tiles of quant_q4_a8.cpp (int8 activations, integer dot products: the fast mode) and quant_q4_exact.cpp
// (float activations, weights dequantized in registers: exact up to float32 round-off).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cstring>
#include "kernels.h"
#include "quant_q4.h"

namespace {
using namespace stateserve_q4;

constexpr const char* kNames[3] = {"q4_0", "q4_1", "q4_k"};

Format parse_format(const std::string& name) {
  const auto* found = std::find(kNames, kNames + 3, name);
  TORCH_CHECK(found != kNames + 3, "q4_pack: format must be q4_0, q4_1 or q4_k, got '", name, "'");
  return static_cast<Format>(found - kNames);
}

const char* name_of(Format f) { return kNames[static_cast<int>(f)]; }

void check_k(Format f, int64_t K, const char* fn) {
  TORCH_CHECK(K > 0 && K % values_per_scale(f) == 0, fn, ": K = ", K, " is not a positive multiple of ",
              values_per_scale(f), " (", name_of(f), ")");
}

// The packed tensor's format, after checking its trailer is a q4_pack one for this N and K.
Format check_packed(const at::Tensor& packed, int64_t N, int64_t K, const char* fn) {
  const int64_t magic = packed_magic(packed, fn, "q4_pack");
  const int64_t* found = std::find(kMagics, kMagics + 3, magic);
  TORCH_CHECK(found != kMagics + 3, fn, ": packed is not a packed Q4 weight (no q4_pack trailer)");
  const Format f = static_cast<Format>(found - kMagics);
  check_k(f, K, fn);
  check_packed_shape(packed, panel_format(f, K), N, K, fn);
  return f;
}

// Where a panel of `rows` rows keeps row r's values: code k (0 .. 31) of block b (its byte; the high nibble for
// k >= 16), and unit u of parameter segment s (1, 2).
struct Layout {
  PanelFormat f;
  int64_t rows;
  int64_t code(int64_t b, int64_t r, int64_t k) const { return f.at(0, 4 * b + k / 4 % 4, r, rows) + k % 4; }
  int64_t param(int s, int64_t u, int64_t r) const { return f.at(s, u, r, rows); }
};

// A field of q4_pack: `dtype` [N, cols], contiguous; where `needed` is false it must be None.
at::Tensor field(const c10::optional<at::Tensor>& t, bool needed, const char* name, at::ScalarType dtype,
                    int64_t N, int64_t cols, Format f) {
  const bool given = t.has_value() && t->defined();
  TORCH_CHECK(given == needed, "q4_pack: ", name_of(f), (needed ? " needs " : " takes no "), name);
  if (!needed) return {};
  TORCH_CHECK(t->dim() == 2 && t->scalar_type() == dtype && t->size(0) == N && t->size(1) == cols, "q4_pack: ",
              name, " must be ", dtype == at::kHalf ? "float16" : "uint8", " [", N, ", ", cols, "] for ", name_of(f),
              ", got ", t->sizes(), " ", t->scalar_type());
  return t->contiguous();
}

void check_max(const at::Tensor& t, int limit, const char* what) {
  TORCH_CHECK(t.numel() == 0 || t.max().item<int64_t>() <= limit, "q4_pack: ", what, " must be in 0 .. ", limit);
}

}  // namespace

bool q4_supported() { return true; }

// format: "q4_0", "q4_1" or "q4_k"; codes: uint8 [N, K] in 0 .. 15, K a multiple of 32 (q4_k: 256); d: float16
// [N, K / 32] (q4_k: [N, K / 256]); m: q4_1's float16 [N, K / 32], q4_k's dmin float16 [N, K / 256], else None; sc,
// mn: q4_k's uint8 [N, K / 32] in 0 .. 63, else None. Returns the packed weight (uint8, 1-D; layout in quant_q4.h),
// resident as GGUF's bytes (q4_0, q4_1) or 1.028x (q4_k), plus 32 bytes and a full panel's padding.
at::Tensor q4_pack(const std::string& format, at::Tensor codes, at::Tensor d, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> sc, c10::optional<at::Tensor> mn) {
  const Format f = parse_format(format);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "q4_pack: codes must be uint8 [N, K]");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = K / kBlock, scales = K / values_per_scale(f);
  check_k(f, K, "q4_pack");
  const bool k_quant = f == Format::kQ4_K;
  d = field(d, true, "d", at::kHalf, N, scales, f);
  const at::Tensor mt = field(m, f != Format::kQ4_0, k_quant ? "m (dmin)" : "m", at::kHalf, N, scales, f);
  const at::Tensor sct = field(sc, k_quant, "sc", at::kByte, N, blocks, f);
  const at::Tensor mnt = field(mn, k_quant, "mn", at::kByte, N, blocks, f);
  codes = codes.contiguous();
  check_max(codes, 15, "codes");
  if (k_quant) {
    check_max(sct, 63, "sc");
    check_max(mnt, 63, "mn");
  }
  const PanelFormat pf = panel_format(f, K);
  auto packed = new_packed(pf, N, K);
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const uint8_t* w = codes.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint8_t*>(d.data_ptr<at::Half>());
  const auto* mp = mt.defined() ? reinterpret_cast<const uint8_t*>(mt.data_ptr<at::Half>()) : nullptr;
  at::parallel_for(0, (N + kPanelRows - 1) / kPanelRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * pf.full_bytes();
      const Layout lay = {pf, std::min(kPanelRows, N - p * kPanelRows)};
      for (int64_t r = 0; r < lay.rows; ++r) {
        const int64_t n = p * kPanelRows + r;
        for (int64_t b = 0; b < blocks; ++b) {
          for (int64_t k = 0; k < kBlock; ++k)
            panel[lay.code(b, r, k)] |= static_cast<uint8_t>(w[n * K + b * kBlock + k] << (k >= 16 ? 4 : 0));
          if (k_quant) {
            panel[lay.param(1, 2 * b, r)] = sct.data_ptr<uint8_t>()[n * blocks + b];
            panel[lay.param(1, 2 * b + 1, r)] = mnt.data_ptr<uint8_t>()[n * blocks + b];
          }
        }
        // the float16 parameters as their bytes: per block (q4_0: d; q4_1: d, m) or super-block (q4_k: d, dmin)
        const int seg = k_quant ? 2 : 1, per = f == Format::kQ4_0 ? 1 : 2;
        for (int64_t u = 0; u < scales; ++u) {
          std::memcpy(panel + lay.param(seg, per * u, r), dp + 2 * (n * scales + u), 2);
          if (mp != nullptr) std::memcpy(panel + lay.param(seg, per * u + 1, r), mp + 2 * (n * scales + u), 2);
        }
      }
    }
  });
  return packed;
}

// The fields a packed Q4 weight holds: (format, codes, d, m, sc, mn) as q4_pack takes them, None where the format
// has none.
std::tuple<std::string, at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
           c10::optional<at::Tensor>>
q4_unpack(at::Tensor packed, int64_t N, int64_t K) {
  const Format f = check_packed(packed, N, K, "q4_unpack");
  const int64_t blocks = K / kBlock, scales = K / values_per_scale(f);
  const bool k_quant = f == Format::kQ4_K;
  const PanelFormat pf = panel_format(f, K);
  auto codes = at::empty({N, K}, at::dtype(at::kByte));
  auto d = at::empty({N, scales}, at::dtype(at::kHalf));
  at::Tensor m, sc, mn;
  if (f != Format::kQ4_0) m = at::empty({N, scales}, at::dtype(at::kHalf));
  if (k_quant) {
    sc = at::empty({N, blocks}, at::dtype(at::kByte));
    mn = at::empty({N, blocks}, at::dtype(at::kByte));
  }
  uint8_t* w = codes.data_ptr<uint8_t>();
  auto* dp = reinterpret_cast<uint8_t*>(d.data_ptr<at::Half>());
  auto* mp = m.defined() ? reinterpret_cast<uint8_t*>(m.data_ptr<at::Half>()) : nullptr;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanelRows, r = n % kPanelRows;
    const uint8_t* panel = packed.data_ptr<uint8_t>() + p * pf.full_bytes();
    const Layout lay = {pf, std::min(kPanelRows, N - p * kPanelRows)};
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t k = 0; k < kBlock; ++k) {
        const uint8_t byte = panel[lay.code(b, r, k)];
        w[n * K + b * kBlock + k] = k >= 16 ? byte >> 4 : byte & 15;
      }
      if (k_quant) {
        sc.data_ptr<uint8_t>()[n * blocks + b] = panel[lay.param(1, 2 * b, r)];
        mn.data_ptr<uint8_t>()[n * blocks + b] = panel[lay.param(1, 2 * b + 1, r)];
      }
    }
    const int seg = k_quant ? 2 : 1, per = f == Format::kQ4_0 ? 1 : 2;
    for (int64_t u = 0; u < scales; ++u) {
      std::memcpy(dp + 2 * (n * scales + u), panel + lay.param(seg, per * u, r), 2);
      if (mp != nullptr) std::memcpy(mp + 2 * (n * scales + u), panel + lay.param(seg, per * u + 1, r), 2);
    }
  }
  const auto opt = [](const at::Tensor& t) { return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt; };
  return {name_of(f), codes, d, opt(m), opt(sc), opt(mn)};
}

// x: [M, K] float32 or bfloat16, unit stride along K; packed: q4_pack of a [N, K] weight (any of the three
// formats); bias: [N] in x's dtype or None. Returns x @ W^T + bias as [M, N] in x's dtype (float32 sums, the bias
// added before the final rounding). quantize_activations: x's rows quantized per block of 32 as llama.cpp's
// quantize_row_q8_0, integer dot products (quant_q4_a8.cpp); else x as float32 times the dequantized weights
// (quant_q4_exact.cpp).
at::Tensor q4_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N, int64_t K,
                        bool quantize_activations) {
  const LinearArgs args = linear_args(x, bias, N, K, kBlock, "q4_linear");
  const Format f = check_packed(packed, N, K, "q4_linear");
  const int64_t M = args.x.size(0), blocks = K / kBlock;
  return linear_out(args, N, [&](auto* b, auto* out) {
    const Panels panels(packed.data_ptr<uint8_t>(), N, panel_format(f, K));
    const auto a8 = [&](const uint8_t* q, int64_t ldq, const float* d, const int32_t* s, int64_t ldd, int mr, int np,
                        const uint8_t* const* ptrs, float* c) { a8_tile(f, mr, np, q, ldq, d, s, ldd, ptrs, blocks, c); };
    const auto exact = [&](const float* xp, int64_t ldx, int mr, int np, const uint8_t* const* ptrs, float* c) {
      exact_tile(f, mr, np, xp, ldx, ptrs, blocks, c);
    };
    run_product(args.x, panels, N, K, b, out, {quantize_activations, false, kBlock}, a8_tile_shape(M), a8,
                exact_tile_shape(M), exact);
  });
}
