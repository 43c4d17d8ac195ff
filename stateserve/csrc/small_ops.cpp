// Small per-token ops of a decode step fused into one pass each: at batch sizes of a few tokens, PyTorch spends
// more time dispatching their 5-10 elementwise kernels than computing. Rounding follows the PyTorch expressions
// they replace (see each comment).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include "kernels.h"
#include "simd.h"

namespace {

using stateserve_simd::round_to;
using stateserve_simd::rows_grain;
using stateserve_simd::silu_rounded_simd;
using stateserve_simd::silu_rounded;

// (a pragma cannot sit inside AT_DISPATCH's macro arguments, hence a function of its own)
template <typename T>
float sum_of_squares(const T* row, int64_t n) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t h = 0; h < n; ++h) {
    const float v = static_cast<float>(row[h]);
    sq += v * v;
  }
  return sq;
}

// One row of RMSNorm as transformers rounds it: out[h] = T(w[h] * round_to<T>(in[h] * r)) with r the inverse root
// mean square of `in` (in == out allowed). Vectors for float32 and bfloat16 (store16 rounds to nearest even, as
// the cast does), the scalar loop for the rest of the row and other dtypes.
template <typename T>
void rms_norm_row(const T* in, const T* w, T* out, int64_t H, float eps) {
  const float r = 1.f / std::sqrt(sum_of_squares(in, H) / static_cast<float>(H) + eps);
  int64_t h = 0;
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    using V = F32Vec;
    const auto rv = V::set1(r);
    for (; h + V::kWidth <= H; h += V::kWidth)
      V::store_to(out + h, V::mul(V::load_from(w + h), round_to_ps<T>(V::mul(V::load_from(in + h), rv))));
  }
#endif
  for (; h < H; ++h) {
    const float normed = round_to<T>(static_cast<float>(in[h]) * r);
    out[h] = static_cast<T>(static_cast<float>(w[h]) * normed);
  }
}

// One bfloat16 row of an RMSNorm whose weight is float32 and multiplies before the one rounding (models that keep
// such a norm in float32, e.g. Qwen3-Next's / Qwen3.5's (1 + w)): out[h] = T(w[h] * (in[h] * r)).
template <typename T>
void rms_norm_row_f32_weight(const T* in, const float* w, T* out, int64_t H, float eps) {
  const float r = 1.f / std::sqrt(sum_of_squares(in, H) / static_cast<float>(H) + eps);
  int64_t h = 0;
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    using V = F32Vec;
    const auto rv = V::set1(r);
    for (; h + V::kWidth <= H; h += V::kWidth)
      V::store_to(out + h, V::mul(V::load_from(w + h), V::mul(V::load_from(in + h), rv)));
  }
#endif
  for (; h < H; ++h) out[h] = static_cast<T>(w[h] * (static_cast<float>(in[h]) * r));
}

// The vectorised prefix of one silu_and_mul row (float32 and bfloat16, AVX-512 or AVX2); returns how many elements
// it did, the caller finishes the rest.
template <typename T>
int64_t silu_and_mul_simd(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    using V = F32Vec;
    for (; i + V::kWidth <= n; i += V::kWidth)
      V::store_to(o + i, V::mul(round_to_ps<T>(silu_ps(V::load_from(g + i))), V::load_from(u + i)));
  }
#endif
  return i;
}

}  // namespace

// RMSNorm of each row as transformers computes it: normalised in float32, cast to the input dtype, then
// multiplied by the weight in that dtype. x: [M, H]; weight: [H], x's dtype.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, H] and weight [H] of the same dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t M = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, rows_grain(H, 16), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) rms_norm_row(xp + m * H, wp, op + m * H, H, static_cast<float>(eps));
    });
  });
  return out;
}

// RMSNorm of bfloat16 rows by a float32 weight, multiplied in float32 and rounded once (rms_norm_row_f32_weight).
at::Tensor rms_norm_f32_weight(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kFloat,
              "rms_norm_f32_weight: x bfloat16 [M, H] and weight float32 [H]");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t M = x.size(0), H = x.size(1);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const float* wp = weight.data_ptr<float>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, M, rows_grain(H, 16), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      rms_norm_row_f32_weight(xp + m * H, wp, op + m * H, H, static_cast<float>(eps));
  });
  return out;
}

// The residual-stream add and the next block's RMSNorm in one pass (a decode step spent more on the two ops'
// dispatch and temporaries than on their arithmetic): residual += x in place, in residual's dtype; returns
// rms_norm(residual.to(weight.dtype)), rounded as rms_norm rounds. residual: [M, H] contiguous, float32
// (residual_in_fp32) or the weight's dtype; x: [M, H] in the weight's dtype (or float32 with a float32 residual);
// weight: [H]. R, X, W: the residual's, x's and weight's element types.
namespace {
template <typename R, typename X, typename W>
void add_rms_norm_rows(R* res, const X* x, const W* w, W* out, int64_t M, int64_t H, float eps) {
#if SS_HAS_SIMD
  using namespace stateserve_simd;
  using V = F32Vec;
#endif
  at::parallel_for(0, M, rows_grain(H, 16), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      R* r = res + m * H;
      const X* xr = x + m * H;
      W* o = out + m * H;
      int64_t h = 0;
#if SS_HAS_SIMD
      for (; h + V::kWidth <= H; h += V::kWidth) {  // store_to rounds to nearest even, as the casts below
        const auto sum = round_to_ps<R>(V::add(V::load_from(r + h), V::load_from(xr + h)));
        V::store_to(r + h, sum);
        V::store_to(o + h, sum);
      }
#endif
      for (; h < H; ++h) {
        const R sum = static_cast<R>(static_cast<float>(r[h]) + static_cast<float>(xr[h]));
        r[h] = sum;
        o[h] = static_cast<W>(static_cast<float>(sum));  // the cast to the norm's dtype, as .to() does
      }
      rms_norm_row(o, w, o, H, eps);  // on the W values rms_norm(residual.to(W)) would see
    }
  });
}
}  // namespace

at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  weight.dim() == 1 && weight.size(0) == residual.size(1),
              "add_rms_norm_: residual [M, H] contiguous, x [M, H], weight [H]");
  const auto rt = residual.scalar_type(), xt = x.scalar_type(), wt = weight.scalar_type();
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty(residual.sizes(), residual.options().dtype(wt));
  const int64_t M = residual.size(0), H = residual.size(1);
  const float e = static_cast<float>(eps);
  using bf = at::BFloat16;
  if (rt == at::kFloat && xt == at::kFloat && wt == at::kFloat) {
    add_rms_norm_rows(residual.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                      out.data_ptr<float>(), M, H, e);
  } else if (rt == at::kBFloat16 && xt == at::kBFloat16 && wt == at::kBFloat16) {
    add_rms_norm_rows(residual.data_ptr<bf>(), x.data_ptr<bf>(), weight.data_ptr<bf>(), out.data_ptr<bf>(), M, H,
                      e);
  } else if (rt == at::kFloat && xt == at::kBFloat16 && wt == at::kBFloat16) {
    add_rms_norm_rows(residual.data_ptr<float>(), x.data_ptr<bf>(), weight.data_ptr<bf>(), out.data_ptr<bf>(), M,
                      H, e);
  } else {
    TORCH_CHECK(false, "add_rms_norm_: residual/x/weight dtypes must be float32/float32/float32, "
                       "bfloat16/bfloat16/bfloat16 or float32/bfloat16/bfloat16, got ", rt, "/", xt, "/", wt);
  }
  return out;
}

// One output row of conv1d_prefill, a vector of channels at a time in a register (taps, bias and activation without
// a trip through memory); returns how many channels it did (the caller does the rest). Exactly one of y_float /
// y_same.
template <typename T>
int64_t conv_row_simd(const T* const* rows, int64_t K, int64_t C, const float* wp, const float* bp, float* y_float,
                      T* y_same) {
  int64_t c0 = 0;
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using V = stateserve_simd::F32Vec;
    for (; c0 + V::kWidth <= C; c0 += V::kWidth) {
      auto a = V::load(bp + c0);
      for (int64_t k = 0; k < K; ++k) a = V::fmadd(V::load(wp + k * C + c0), V::load_from(rows[k] + c0), a);
      if (y_float) V::store(y_float + c0, stateserve_simd::silu_rounded_ps<T>(a));
      else V::store_to(y_same + c0, a);
    }
  }
#endif
  return c0;
}

// Depthwise causal conv of one sequence's chunk in time-major layout (no transposes): x: [L, C] (any row stride,
// so a view into the input projection's output is read in place), history: [K-1, C] (the inputs before the chunk);
// weight: [C, K]; bias: [C] or empty. With p = [history; x], y[t, c] = sum_k weight[c, k] * p[t + k, c] + bias[c],
// summed in float32 and rounded once, as F.conv1d does.
// silu_float32: also apply silu (rounded to the input dtype, as F.silu on y would) and return float32, the dtype
// the scan that follows wants, so neither the activation nor the conversion costs a pass of its own.
at::Tensor conv1d_prefill(at::Tensor x, at::Tensor history, at::Tensor weight,
                             c10::optional<at::Tensor> bias, bool silu_float32) {
  TORCH_CHECK(x.dim() == 2 && history.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(0) &&
                  history.size(1) == weight.size(0) && history.size(0) == weight.size(1) - 1,
              "conv1d_prefill: x [L, C], history [K-1, C] and weight [C, K]");
  TORCH_CHECK(history.scalar_type() == x.scalar_type(), "conv1d_prefill: history and x of one dtype");
  if (x.stride(1) != 1) x = x.contiguous();
  history = history.contiguous();
  const int64_t C = weight.size(0), K = weight.size(1), L = x.size(0), row_stride = x.stride(0);
  auto wt = weight.to(at::kFloat).t().contiguous();  // [K, C]: channel-contiguous taps
  at::Tensor b = (bias.has_value() && bias->defined()) ? bias->to(at::kFloat).contiguous()
                                                         : at::zeros({C}, wt.options());
  auto y = at::empty({L, C}, silu_float32 ? x.options().dtype(at::kFloat) : x.options());
  const float *wp = wt.data_ptr<float>(), *bp = b.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv1d_prefill", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *hp = history.data_ptr<scalar_t>();
    float* y_float = silu_float32 ? y.data_ptr<float>() : nullptr;
    scalar_t* y_same = silu_float32 ? nullptr : y.data_ptr<scalar_t>();
    auto row = [&](int64_t i) {  // row i of [history; x]
      return i < K - 1 ? hp + i * C : xp + (i - (K - 1)) * row_stride;
    };
    at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(C);
      std::vector<const scalar_t*> rows(K);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t k = 0; k < K; ++k) rows[k] = row(t + k);
        const int64_t c0 = conv_row_simd(rows.data(), K, C, wp, bp, silu_float32 ? y_float + t * C : nullptr,
                                         silu_float32 ? nullptr : y_same + t * C);
        std::copy(bp + c0, bp + C, acc.begin() + c0);
        for (int64_t k = 0; k < K; ++k)
          for (int64_t c = c0; c < C; ++c) acc[c] += wp[k * C + c] * static_cast<float>(rows[k][c]);
        for (int64_t c = c0; c < C; ++c) {
          if (silu_float32) y_float[t * C + c] = silu_rounded<scalar_t>(acc[c]);
          else y_same[t * C + c] = static_cast<scalar_t>(acc[c]);
        }
      }
    });
  });
  return y;
}

// Rotate-half rotary embedding applied in place to q [T, H, D] and k [T, KH, D] (unit stride inside a token's
// heads; any token stride, so views into the fused qkv output work). table: [max_pos, rotary_dim] float32, cos
// then sin halves; positions: [T] int64. As the PyTorch path: float32 products, rounded once to x's dtype.
// Returns false, changing nothing, when a position is past the table (the caller grows it and calls again): checking
// here costs nothing, while the caller's positions.max() was a few microseconds a layer in every decode step.
bool rotary_(at::Tensor q, at::Tensor k, at::Tensor table, at::Tensor positions, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == k.scalar_type(), "rotary_: q, k [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "rotary_: heads must be contiguous within a token");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.size(1) == rotary_dim,
              "rotary_: float32 table [max_pos, rotary_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = q.size(0), half = rotary_dim / 2;
  TORCH_CHECK(pos.numel() == T, "rotary_: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pp[t] >= 0, "rotary_: negative position ", pp[t]);
    if (pp[t] >= table.size(0)) return false;
  }
  const float* tp = table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_", [&] {
    auto apply = [&](scalar_t* base, int64_t token_stride, int64_t heads, int64_t D) {
      at::parallel_for(0, T, rows_grain(heads * rotary_dim, 16), [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* cs = tp + pp[t] * rotary_dim;
          for (int64_t h = 0; h < heads; ++h) {
            scalar_t* x = base + t * token_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
              const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
              const float c = cs[i], s = cs[half + i];
              x[i] = static_cast<scalar_t>(a * c + (-b) * s);
              x[i + half] = static_cast<scalar_t>(b * c + a * s);
            }
          }
        }
      });
    };
    apply(q.data_ptr<scalar_t>(), q.stride(0), q.size(1), q.size(2));
    apply(k.data_ptr<scalar_t>(), k.stride(0), k.size(1), k.size(2));
  });
  return true;
}

// silu(gate) * up for x = [gate | up] of shape [M, 2I], rounded as F.silu(gate) * up in x's dtype.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [M, 2I]");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({M, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, rows_grain(2 * I, 4), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* g = xp + m * 2 * I;
        const scalar_t* u = g + I;
        scalar_t* o = op + m * I;
        int64_t i = silu_and_mul_simd(g, u, o, I);
        for (; i < I; ++i) {
          o[i] = static_cast<scalar_t>(silu_rounded<scalar_t>(static_cast<float>(g[i])) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// Mamba2 step sizes: clamp(softplus(dt + dt_bias), lo, hi) returned as float32, with the rounding of that PyTorch
// expression in dt's dtype (the bias cast to it, the sum, softplus and the clamp bounds each rounded). dt: [S, H]
// (any row stride), dt_bias: [H].
at::Tensor dt_softplus(at::Tensor dt, at::Tensor dt_bias, double lo, double hi) {
  TORCH_CHECK(dt.dim() == 2 && dt_bias.dim() == 1 && dt_bias.size(0) == dt.size(1), "dt_softplus: dt [S, H], bias [H]");
  if (dt.stride(1) != 1) dt = dt.contiguous();  // rows may be a view into the input projection's output
  // float32 bias (the layer's cached copy) is read as it is and rounded to dt's dtype below; any other dtype is
  // converted once here (two small copies: a few microseconds, as much as the step sizes of a decode step)
  auto bias = dt_bias.scalar_type() == at::kFloat ? dt_bias.contiguous() : dt_bias.to(at::kFloat).contiguous();
  const int64_t S = dt.size(0), H = dt.size(1), row_stride = dt.stride(0);
  auto out = at::empty({S, H}, dt.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt.scalar_type(), "dt_softplus", [&] {
    const scalar_t* dp = dt.data_ptr<scalar_t>();
    const float* bp = bias.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float lo_t = round_to<scalar_t>(static_cast<float>(lo)), hi_t = round_to<scalar_t>(static_cast<float>(hi));
    // a softplus costs some 16 copies' worth: a prefill's [L, H] is split across threads, a decode step's is not
    at::parallel_for(0, S, rows_grain(16 * H, 16), [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const scalar_t* d = dp + s * row_stride;
        float* o = op + s * H;
        int64_t h = 0;
#if SS_HAS_AVX512
        if constexpr (std::is_same_v<scalar_t, float>) {  // bfloat16 keeps the scalar log1p: its rounding to 8
          // bits would turn the vector form's last-bit differences into whole bfloat16 steps now and then
          const __m512 lo_v = _mm512_set1_ps(lo_t), hi_v = _mm512_set1_ps(hi_t);
          for (; h + 16 <= H; h += 16) {
            const __m512 v = _mm512_add_ps(_mm512_loadu_ps(d + h), _mm512_loadu_ps(bp + h));
            _mm512_storeu_ps(o + h, _mm512_min_ps(_mm512_max_ps(stateserve_simd::softplus_ps(v), lo_v), hi_v));
          }
          if (h < H) {  // the rest in one masked vector
            const __mmask16 m = static_cast<__mmask16>((1u << (H - h)) - 1);
            const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, d + h), _mm512_maskz_loadu_ps(m, bp + h));
            _mm512_mask_storeu_ps(o + h, m,
                                  _mm512_min_ps(_mm512_max_ps(stateserve_simd::softplus_ps(v), lo_v), hi_v));
            h = H;
          }
        }
#endif
        for (; h < H; ++h) {
          const float v = round_to<scalar_t>(static_cast<float>(d[h]) + round_to<scalar_t>(bp[h]));
          o[h] = std::min(std::max(stateserve_simd::softplus_rounded<scalar_t>(v), lo_t), hi_t);
        }
      }
    });
  });
  return out;
}
