// Small per-token ops of a decode step fused into one pass each: at batch sizes of a few tokens, PyTorch spends
// more time dispatching their 5-10 elementwise kernels (and, for the conv state, gathering and scattering
// rows) than computing. Rounding follows the PyTorch expressions they replace (see each comment).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
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

// The vectorised prefix of one silu_and_mul row (float32 and bfloat16 on AVX-512); returns how many elements it
// did, the caller finishes the rest.
template <typename T>
int64_t silu_and_mul_simd(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    for (; i + 16 <= n; i += 16)
      store16(o + i, _mm512_mul_ps(round_to_ps<T>(silu_ps(load16(g + i))), load16(u + i)));
  }
#endif
  return i;
}

// conv1d_update_ for 16 consecutive channels of one sequence: the windows are read into a transposed float32 tile,
// then products and sums (rounded as the scalar path rounds them) run 16 channels at a time. Returns false when
// this dtype or window size has no vector path (the caller then runs the scalar loop).
template <typename T>
bool conv_update_simd(const T* rows, const T* x, const float* wt, const float* bias, bool has_bias, int64_t ldw,
                      int64_t W, bool float_accumulate, T* y, float* y_silu) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    constexpr int64_t kMaxW = 8;
    if (W > kMaxW) return false;
    alignas(64) float win[kMaxW][16];
    for (int j = 0; j < 16; ++j)
      for (int64_t k = 0; k < W; ++k) win[k][j] = static_cast<float>(rows[j * W + k]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k <= W; ++k) {
      const __m512 v = k < W ? _mm512_load_ps(win[k]) : load16(x);
      const __m512 prod = _mm512_mul_ps(v, _mm512_loadu_ps(wt + k * ldw));
      acc = _mm512_add_ps(acc, float_accumulate ? prod : round_to_ps<T>(prod));
    }
    const __m512 b = has_bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 out = _mm512_add_ps(float_accumulate ? acc : round_to_ps<T>(acc), b);
    if (y_silu != nullptr)
      _mm512_storeu_ps(y_silu, silu_rounded_ps<T>(out));
    else
      store16(y, out);
    return true;
  }
#endif
  return false;
}

}  // namespace

// Depthwise causal conv over the last K inputs of each sequence, shifting the conv state in place.
// conv_state: [num_slots, C, K-1]; x: [S, C], conv_state's dtype; taps: the conv weight as float32 [K, C] (transposed,
// so 16 channels' taps are one vector load; the caller caches it per weight version); bias: [C] float32 holding
// values of x's dtype, or empty.
// float_accumulate: products and bias summed in float32, rounded once (F.conv1d). Otherwise as the PyTorch
// expression (window * weight).sum(-1) + bias: each product rounded, the sum rounded, then the bias add.
// silu_float32: return silu(y) (rounded to x's dtype, as F.silu on y would) as float32, for the state update.
torch::Tensor conv1d_update_(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor taps,
                             c10::optional<torch::Tensor> bias, bool float_accumulate, bool silu_float32) {
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.scalar_type() == x.scalar_type(),
              "conv1d_update_: conv_state and x must share a dtype (conv_state contiguous)");
  TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.dim() == 2 && taps.is_contiguous(),
              "conv1d_update_: taps must be contiguous float32 [K, C]");
  x = x.contiguous();
  auto slot_ids = slots.scalar_type() == at::kLong ? slots.contiguous() : slots.to(at::kLong).contiguous();
  const int64_t S = x.size(0), C = x.size(1), K = taps.size(0), W = conv_state.size(2);
  TORCH_CHECK(W == K - 1 && conv_state.size(1) == C && taps.size(1) == C, "conv1d_update_: shapes do not agree");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == C && bias->is_contiguous(),
                "conv1d_update_: bias must be contiguous float32 [C]");
  auto y = silu_float32 ? torch::empty(x.sizes(), x.options().dtype(at::kFloat)) : torch::empty_like(x);
  const float* wtp = taps.data_ptr<float>();
  const float* bias_p = has_bias ? bias->data_ptr<float>() : nullptr;
  constexpr int64_t kBlock = 16;  // channels per task: one AVX-512 vector
  const int64_t num_blocks = (C + kBlock - 1) / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv1d_update_", [&] {
    scalar_t* st = conv_state.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t* sl = slot_ids.data_ptr<int64_t>();
    scalar_t* yp = silu_float32 ? nullptr : y.data_ptr<scalar_t>();
    float* yfp = silu_float32 ? y.data_ptr<float>() : nullptr;
    at::parallel_for(0, S * num_blocks, rows_grain(kBlock * K, 8), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / num_blocks, c0 = (task % num_blocks) * kBlock;
        const int64_t n = std::min(kBlock, C - c0);
        scalar_t* rows = st + (sl[s] * C + c0) * W;  // n consecutive channels' windows, W each
        const scalar_t* xs = xp + s * C + c0;
        if (n != kBlock || !conv_update_simd<scalar_t>(rows, xs, wtp + c0, has_bias ? bias_p + c0 : nullptr, has_bias,
                                                      C, W, float_accumulate,
                                                      yp ? yp + s * C + c0 : nullptr, yfp ? yfp + s * C + c0 : nullptr)) {
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* row = rows + j * W;
            float acc = 0.f;
            for (int64_t k = 0; k <= W; ++k) {
              const float v = static_cast<float>(k < W ? row[k] : xs[j]);
              const float prod = v * wtp[k * C + c0 + j];
              acc += float_accumulate ? prod : round_to<scalar_t>(prod);
            }
            const float bias_v = has_bias ? bias_p[c0 + j] : 0.f;
            const float out = float_accumulate ? acc + bias_v : round_to<scalar_t>(acc) + bias_v;
            if (yfp != nullptr) {
              yfp[s * C + c0 + j] = silu_rounded<scalar_t>(out);
            } else {
              yp[s * C + c0 + j] = static_cast<scalar_t>(out);
            }
          }
        }
        if (W > 0) {  // shift each window left by one and append the new input: the n windows are contiguous, so
          // one move of the whole run, then each window's last element (which got the next window's first) is set
          std::memmove(rows, rows + 1, (n * W - 1) * sizeof(scalar_t));
          for (int64_t j = 0; j < n; ++j) rows[j * W + W - 1] = xs[j];
        }
      }
    });
  });
  return y;
}

// RMSNorm of each row as transformers computes it: normalised in float32, cast to the input dtype, then
// multiplied by the weight in that dtype. x: [M, H]; weight: [H], x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, H] and weight [H] of the same dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t M = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, rows_grain(H, 16), [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* row = xp + m * H;
        const float sq = sum_of_squares(row, H);
        const float r = 1.f / std::sqrt(sq / static_cast<float>(H) + static_cast<float>(eps));
        for (int64_t h = 0; h < H; ++h) {
          const float normed = round_to<scalar_t>(static_cast<float>(row[h]) * r);
          op[m * H + h] = static_cast<scalar_t>(static_cast<float>(wp[h]) * normed);
        }
      }
    });
  });
  return out;
}

// Depthwise causal conv of one sequence's chunk in time-major layout (no transposes): padded: [K-1+L, C] (the
// K-1 inputs before the chunk, then the chunk); weight: [C, K]; bias: [C] or empty. y[t, c] =
// sum_k weight[c, k] * padded[t + k, c] + bias[c], summed in float32 and rounded once, as F.conv1d does.
// silu_float32: also apply silu (rounded to the input dtype, as F.silu on y would) and return float32, the dtype
// the scan that follows wants, so neither the activation nor the conversion costs a pass of its own.
torch::Tensor conv1d_prefill(torch::Tensor padded, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                             bool silu_float32) {
  TORCH_CHECK(padded.dim() == 2 && weight.dim() == 2 && padded.size(1) == weight.size(0),
              "conv1d_prefill: padded [K-1+L, C] and weight [C, K]");
  padded = padded.contiguous();
  const int64_t C = weight.size(0), K = weight.size(1), L = padded.size(0) - (K - 1);
  TORCH_CHECK(L >= 0, "conv1d_prefill: fewer rows than the kernel's history");
  auto wt = weight.to(at::kFloat).t().contiguous();  // [K, C]: channel-contiguous taps
  torch::Tensor b = (bias.has_value() && bias->defined()) ? bias->to(at::kFloat).contiguous()
                                                         : torch::zeros({C}, wt.options());
  auto y = torch::empty({L, C}, silu_float32 ? padded.options().dtype(at::kFloat) : padded.options());
  const float *wp = wt.data_ptr<float>(), *bp = b.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, padded.scalar_type(), "conv1d_prefill", [&] {
    const scalar_t* xp = padded.data_ptr<scalar_t>();
    at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(C);
      for (int64_t t = begin; t < end; ++t) {
        std::copy(bp, bp + C, acc.begin());
        for (int64_t k = 0; k < K; ++k) {
          const scalar_t* row = xp + (t + k) * C;
          const float* w = wp + k * C;
          float* a = acc.data();
          for (int64_t c = 0; c < C; ++c) a[c] += w[c] * static_cast<float>(row[c]);
        }
        if (silu_float32) {
          float* yt = y.data_ptr<float>() + t * C;
          int64_t c = silu_rounded_simd<scalar_t>(acc.data(), yt, C);
          for (; c < C; ++c) yt[c] = silu_rounded<scalar_t>(acc[c]);
        } else {
          scalar_t* yt = y.data_ptr<scalar_t>() + t * C;
          for (int64_t c = 0; c < C; ++c) yt[c] = static_cast<scalar_t>(acc[c]);
        }
      }
    });
  });
  return y;
}

// Rotate-half rotary embedding applied in place to q [T, H, D] and k [T, KH, D] (unit stride inside a token's
// heads; any token stride, so views into the fused qkv output work). table: [max_pos, rotary_dim] float32, cos
// then sin halves; positions: [T] int64. As the PyTorch path: float32 products, rounded once to x's dtype.
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor table, torch::Tensor positions, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == k.scalar_type(), "rotary_: q, k [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "rotary_: heads must be contiguous within a token");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.size(1) == rotary_dim,
              "rotary_: float32 table [max_pos, rotary_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = q.size(0), half = rotary_dim / 2;
  const int64_t* pp = pos.data_ptr<int64_t>();
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
}

// silu(gate) * up for x = [gate | up] of shape [M, 2I], rounded as F.silu(gate) * up in x's dtype.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [M, 2I]");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({M, I}, x.options());
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
torch::Tensor dt_softplus(torch::Tensor dt, torch::Tensor dt_bias, double lo, double hi) {
  TORCH_CHECK(dt.dim() == 2 && dt_bias.dim() == 1 && dt_bias.size(0) == dt.size(1), "dt_softplus: dt [S, H], bias [H]");
  dt = dt.contiguous();
  auto bias = dt_bias.to(dt.scalar_type()).to(at::kFloat).contiguous();
  const int64_t S = dt.size(0), H = dt.size(1);
  auto out = torch::empty({S, H}, dt.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dt.scalar_type(), "dt_softplus", [&] {
    const scalar_t* dp = dt.data_ptr<scalar_t>();
    const float* bp = bias.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float lo_t = round_to<scalar_t>(static_cast<float>(lo)), hi_t = round_to<scalar_t>(static_cast<float>(hi));
    for (int64_t i = 0; i < S * H; ++i) {
      const float v = round_to<scalar_t>(static_cast<float>(dp[i]) + bp[i % H]);
      const float sp = stateserve_simd::softplus_rounded<scalar_t>(v);
      op[i] = std::min(std::max(sp, lo_t), hi_t);
    }
  });
  return out;
}
