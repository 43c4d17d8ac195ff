// One decode step of the delta rule (the gated delta net of Qwen3.5 / Qwen3-Next / OLMo Hybrid, Kimi's KDA), on the
// recurrent states in place. Per sequence s and head h, with S = state[slots[s], h] ([Dk, Dv] float32):
//   S <- S * decay          (decay: one factor per head, or one per key channel)
//   delta = (v - k^T S) * beta
//   S <- S + k delta^T
//   out = q^T S
// Why: the PyTorch path reads each head's state five times and writes it four (the gather of the slots, the decay,
// k^T S, the rank-one update, q^T S, the scatter back) in ~10 operator calls per layer; here two passes over S
// (decay and k^T S; the update and q^T S), one call per layer, each head's state hot in L1 between the passes.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <cmath>
#include <vector>
#include "kernels.h"
#include "simd.h"

namespace {

// row[j] <- row[j] * scale, then acc[j] += a * row[j], for j < n.
inline void scale_row_and_accumulate(float* row, int64_t n, float scale, float a, float* acc) {
  int64_t j = 0;
#if SS_HAS_SIMD
  using V = stateserve_simd::F32Vec;
  const auto s = V::set1(scale), av = V::set1(a);
  for (; j + V::kWidth <= n; j += V::kWidth) {
    const auto r = V::mul(V::load(row + j), s);
    V::store(row + j, r);
    V::store(acc + j, V::fmadd(av, r, V::load(acc + j)));
  }
#endif
  for (; j < n; ++j) {
    row[j] *= scale;
    acc[j] += a * row[j];
  }
}

// row[j] <- row[j] + b * delta[j], then acc[j] += a * row[j], for j < n.
inline void update_row_and_accumulate(float* row, int64_t n, float b, const float* delta, float a, float* acc) {
  int64_t j = 0;
#if SS_HAS_SIMD
  using V = stateserve_simd::F32Vec;
  const auto bv = V::set1(b), av = V::set1(a);
  for (; j + V::kWidth <= n; j += V::kWidth) {
    const auto r = V::fmadd(bv, V::load(delta + j), V::load(row + j));
    V::store(row + j, r);
    V::store(acc + j, V::fmadd(av, r, V::load(acc + j)));
  }
#endif
  for (; j < n; ++j) {
    row[j] += b * delta[j];
    acc[j] += a * row[j];
  }
}

// One head: S [Dk, Dv]; q, k [Dk]; v, out [Dv]; decay[i * decay_step] the factor of key channel i (step 0: one per
// head); work: Dv floats of scratch.
void update_head(float* S, int64_t Dk, int64_t Dv, const float* q, const float* k, const float* v,
                 const float* decay, int64_t decay_step, float beta, float* out, float* work) {
  float* delta = work;
  std::fill(delta, delta + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i)  // S <- S * decay and k^T S, row by row
    scale_row_and_accumulate(S + i * Dv, Dv, decay[i * decay_step], k[i], delta);
  for (int64_t j = 0; j < Dv; ++j) delta[j] = (v[j] - delta[j]) * beta;
  std::fill(out, out + Dv, 0.f);
  for (int64_t i = 0; i < Dk; ++i)  // S <- S + k delta^T and q^T S
    update_row_and_accumulate(S + i * Dv, Dv, k[i], delta, q[i], out);
}

}  // namespace

// state: [num_slots, H, Dk, Dv] float32, contiguous, updated in place at `slots` ([S] int64, distinct); q, k:
// [S, H, Dk]; v: [S, H, Dv]; decay: [S, H] or [S, H, Dk]; beta: [S, H]; all float32 and contiguous.
// Returns out [S, H, Dv] float32.
at::Tensor delta_rule_decode_(at::Tensor state, at::Tensor slots, at::Tensor q, at::Tensor k, at::Tensor v,
                              at::Tensor decay, at::Tensor beta) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "delta_rule_decode_: state must be float32 [num_slots, H, Dk, Dv], contiguous");
  const int64_t H = state.size(1), Dk = state.size(2), Dv = state.size(3), S = slots.numel();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "delta_rule_decode_: slots must be int64 [S]");
  for (const auto& [t, last, name] : {std::tuple{q, Dk, "q"}, std::tuple{k, Dk, "k"}, std::tuple{v, Dv, "v"}})
    TORCH_CHECK(t.dim() == 3 && t.size(0) == S && t.size(1) == H && t.size(2) == last &&
                    t.scalar_type() == at::kFloat && t.is_contiguous(),
                "delta_rule_decode_: ", name, " must be float32 [S, H, ", last, "], contiguous");
  const bool per_channel = decay.dim() == 3;
  TORCH_CHECK(decay.scalar_type() == at::kFloat && decay.is_contiguous() && decay.size(0) == S &&
                  decay.size(1) == H && (decay.dim() == 2 || (per_channel && decay.size(2) == Dk)),
              "delta_rule_decode_: decay must be float32 [S, H] or [S, H, Dk], contiguous");
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.is_contiguous() && beta.numel() == S * H,
              "delta_rule_decode_: beta must be float32 [S, H], contiguous");
  auto out = at::empty({S, H, Dv}, q.options());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = state.size(0);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "delta_rule_decode_: slot ", slot[s], " out of range");
  float* st = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, S * H, stateserve_simd::rows_grain(4 * Dk * Dv, 1), [&](int64_t begin, int64_t end) {
    std::vector<float> work(Dv);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / H, h = sh % H;
      update_head(st + (slot[s] * H + h) * Dk * Dv, Dk, Dv, qp + sh * Dk, kp + sh * Dk, vp + sh * Dv,
                  per_channel ? dp + sh * Dk : dp + sh, per_channel ? 1 : 0, bp[sh], op + sh * Dv, work.data());
    }
  });
  return out;
}

// The gated delta net's whole decode step after its conv (Qwen3.5 / Qwen3-Next / OLMo Hybrid): the ~25 PyTorch
// calls that make q, k, v, the decay and beta from the conv's output and the b / a projections, then the update
// above, in one call. Per sequence s and value head h (key head h / group):
//   q = l2norm(qkv[s, q part of key head]) * Dk^-0.5,  k = l2norm(qkv[s, k part]),  v = qkv[s, v part of head h]
//   beta = sigmoid(b[s, h]), rounded to b's dtype as torch.sigmoid does, times beta_scale
//   decay = exp(neg_exp_A[h] * softplus(a[s, h] + dt_bias[h]))   (softplus: x past 20 is x, as PyTorch's)
// l2norm(x) = x * (1 / sqrt(sum x^2 + 1e-6)), all in float32: PyTorch's formula, its sums in another order.
namespace {

template <typename T>
inline float rounded_sigmoid(T b) {
  const float s = 1.f / (1.f + std::exp(-static_cast<float>(b)));
  return static_cast<float>(static_cast<T>(s));  // torch.sigmoid of a bfloat16 tensor rounds its result
}

// dst = float32(src) * (1 / sqrt(sum src^2 + eps)) * scale (scale applied as a second rounding, as q's is; k's
// scale 1 changes nothing: a product by 1 is exact).
template <typename T>
inline void l2norm_row(const T* src, int64_t n, float scale, float* dst) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<float>(src[i]);
    sum += dst[i] * dst[i];
  }
  const float inv = 1.f / std::sqrt(sum + 1e-6f);
  for (int64_t i = 0; i < n; ++i) dst[i] = (dst[i] * inv) * scale;
}

}  // namespace

// state: [num_slots, Hv, Dk, Dv] float32 (contiguous), updated at `slots`; qkv: [S, 2 Hk Dk + Hv Dv] (the activated
// conv output, contiguous); b, a: [S, Hv] (any strides); all three float32 or bfloat16 alike; neg_exp_A,
// dt_bias: [Hv] float32. Returns out [S, Hv, Dv] float32.
at::Tensor gated_delta_decode_(at::Tensor state, at::Tensor slots, at::Tensor qkv, at::Tensor b, at::Tensor a,
                               at::Tensor neg_exp_A, at::Tensor dt_bias, int64_t num_k_heads, double beta_scale) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "gated_delta_decode_: state must be float32 [num_slots, Hv, Dk, Dv], contiguous");
  const int64_t Hv = state.size(1), Dk = state.size(2), Dv = state.size(3), S = slots.numel();
  const int64_t Hk = num_k_heads;
  TORCH_CHECK(Hk > 0 && Hv % Hk == 0, "gated_delta_decode_: Hv=", Hv, " is not a multiple of Hk=", Hk);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "gated_delta_decode_: slots must be int64 [S]");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == S && qkv.size(1) == 2 * Hk * Dk + Hv * Dv && qkv.is_contiguous(),
              "gated_delta_decode_: qkv must be [S, 2 Hk Dk + Hv Dv], contiguous");
  for (const auto& [t, name] : {std::pair{b, "b"}, std::pair{a, "a"}})
    TORCH_CHECK(t.dim() == 2 && t.size(0) == S && t.size(1) == Hv && t.scalar_type() == qkv.scalar_type(),
                "gated_delta_decode_: ", name, " must be [S, Hv] of qkv's dtype");
  for (const auto& [t, name] : {std::pair{neg_exp_A, "neg_exp_A"}, std::pair{dt_bias, "dt_bias"}})
    TORCH_CHECK(t.numel() == Hv && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "gated_delta_decode_: ", name, " must be float32 [Hv]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = state.size(0);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(slot[s] >= 0 && slot[s] < num_slots, "gated_delta_decode_: slot ", slot[s], " out of range");
  auto out = at::empty({S, Hv, Dv}, qkv.options().dtype(at::kFloat));
  float* st = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float *A = neg_exp_A.data_ptr<float>(), *bias = dt_bias.data_ptr<float>();
  const int64_t group = Hv / Hk, width = qkv.size(1);
  const int64_t b_row = b.stride(0), b_col = b.stride(1), a_row = a.stride(0), a_col = a.stride(1);
  const float q_scale = 1.f / std::sqrt(static_cast<float>(Dk)), bscale = static_cast<float>(beta_scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "gated_delta_decode_", [&] {
    const scalar_t *x = qkv.data_ptr<scalar_t>(), *bp = b.data_ptr<scalar_t>(), *ap = a.data_ptr<scalar_t>();
    at::parallel_for(0, S * Hv, stateserve_simd::rows_grain(4 * Dk * Dv, 1), [&](int64_t begin, int64_t end) {
      std::vector<float> work(Dv + 2 * Dk + Dv);
      float *q = work.data() + Dv, *k = q + Dk, *v = k + Dk;
      for (int64_t sh = begin; sh < end; ++sh) {
        const int64_t s = sh / Hv, h = sh % Hv, kh = h / group;
        const scalar_t* row = x + s * width;
        l2norm_row(row + kh * Dk, Dk, q_scale, q);
        l2norm_row(row + Hk * Dk + kh * Dk, Dk, 1.f, k);
        for (int64_t j = 0; j < Dv; ++j) v[j] = static_cast<float>(row[2 * Hk * Dk + h * Dv + j]);
        float beta = rounded_sigmoid(bp[s * b_row + h * b_col]);
        if (bscale != 1.f) beta *= bscale;
        const float z = static_cast<float>(ap[s * a_row + h * a_col]) + bias[h];
        const float decay = std::exp(A[h] * (z > 20.f ? z : std::log1p(std::exp(z))));
        update_head(st + (slot[s] * Hv + h) * Dk * Dv, Dk, Dv, q, k, v, &decay, 0, beta, op + sh * Dv,
                    work.data());
      }
    });
  });
  return out;
}
