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
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
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
