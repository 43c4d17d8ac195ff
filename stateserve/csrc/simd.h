// Helpers shared by the kernels: scalar rounding to the model dtype, SiLU and softplus as PyTorch computes them in
// that dtype, a scalar SSD row update, the parallel-grain rule; then, in builds with vectors, F32Vec (the widest
// float32 vector: simd_avx512.h's F32x16 or simd_avx2.h's F32x8, the same operations under the same names) and the
// vector math written once over it: exp, softplus, SiLU, rounding to a dtype. cpu_kernels.py hashes the headers
// into the build flags so edits trigger a rebuild.
#pragma once
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include "isa.h"

namespace stateserve_simd {

// v rounded to T and back (float: as is): where a PyTorch expression in T rounds an intermediate.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// F.silu in dtype T: the input and the result rounded to T, computed in float32.
template <typename T>
inline float silu_rounded(float v) {
  v = round_to<T>(v);
  return round_to<T>(v / (1.f + std::exp(-v)));
}

// F.softplus (beta 1, threshold 20) of a value already in T, the result rounded to T.
template <typename T>
inline float softplus_rounded(float v) { return round_to<T>(v > 20.f ? v : std::log1p(std::exp(v))); }

// One SSD (Mamba2) state row: row[n] <- row[n] * decay + dx * b[n]; returns sum_n new[n] * c[n] over the
// unrounded new values. S = float or a 16-bit type (the stored row is rounded). The scalar form every SSD kernel
// falls back to; the compiler vectorises it for float rows.
template <typename S>
inline float ssd_row_update(S* row, float decay, float dx, const float* b, const float* c, int64_t N) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t n = 0; n < N; ++n) {
    const float v = static_cast<float>(row[n]) * decay + dx * b[n];
    row[n] = static_cast<S>(v);
    acc += v * c[n];
  }
  return acc;
}

}  // namespace stateserve_simd

#if SS_HAS_AVX512
#include "simd_avx512.h"
#elif SS_HAS_AVX2
#include "simd_avx2.h"
#endif

namespace stateserve_simd {

// Rows per parallel chunk such that a chunk holds at least ~32K elements (~10-20 us of work): a decode step's
// few rows then run inline on the calling thread. Forking the OpenMP team for a microsecond of work costs more
// than the work, and on a busy machine a region waits for whichever thread was descheduled.
inline int64_t rows_grain(int64_t elements_per_row, int64_t min_rows) {
  constexpr int64_t kInlineElements = 32768;
  return std::max<int64_t>(min_rows, kInlineElements / std::max<int64_t>(1, elements_per_row));
}

#if SS_HAS_SIMD
#if SS_HAS_AVX512
using F32Vec = F32x16;
#else
using F32Vec = F32x8;
#endif
using VecF = F32Vec::V;

// exp(x) for float32 lanes: x = k ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial for e^r (relative error
// ~2e-7, two float ulps), then scaled by 2^k (underflowing to 0 for very negative x).
inline VecF exp_ps(VecF x) {
  using V = F32Vec;
  x = V::min(V::max(x, V::set1(-104.f)), V::set1(88.7f));
  const VecF k = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  VecF r = V::fnmadd(k, V::set1(0.693359375f), x);  // ln2 split in hi + lo for accuracy
  r = V::fnmadd(k, V::set1(-2.12194440e-4f), r);
  VecF p = V::set1(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = V::fmadd(p, r, V::set1(c));
  return V::scale_pow2(p, k);
}

// F.softplus (beta 1, threshold 20) for float32 lanes: x past 20 as is, else max(x, 0) + log1p(exp(-|x|)), with
// log1p(y) = 2 atanh(s), s = y / (2 + y) <= 1/3, as an odd series to s^15 (relative error ~2e-8 before rounding):
// no 1 + y is formed, so small results keep their relative precision.
inline VecF softplus_ps(VecF x) {
  using V = F32Vec;
  const VecF y = exp_ps(V::sub(V::zero(), V::abs(x)));
  const VecF s = V::div(y, V::add(V::set1(2.f), y));
  const VecF s2 = V::mul(s, s);
  VecF p = V::set1(1.f / 15.f);
  for (const float c : {1.f / 13.f, 1.f / 11.f, 1.f / 9.f, 1.f / 7.f, 1.f / 5.f, 1.f / 3.f, 1.f})
    p = V::fmadd(p, s2, V::set1(c));
  const VecF log1p = V::mul(V::add(s, s), p);
  const VecF r = V::add(V::max(x, V::zero()), log1p);
  return V::where_gt(x, V::set1(20.f), x, r);
}

// silu(v) = v / (1 + exp(-v)) for float32 lanes.
inline VecF silu_ps(VecF v) {
  using V = F32Vec;
  return V::div(v, V::add(V::set1(1.f), exp_ps(V::sub(V::zero(), v))));
}

// Rounds float32 lanes to T as static_cast<T> would (float32: unchanged).
template <typename T>
inline VecF round_to_ps(VecF v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return F32Vec::round_bf16(v);
  return v;
}

// F.silu applied to a tensor of dtype T, lane by lane: the input rounded to T, silu in float32, rounded to T again.
template <typename T>
inline VecF silu_rounded_ps(VecF v) { return round_to_ps<T>(silu_ps(round_to_ps<T>(v))); }
#endif

// out[i] = silu(v) with v = in[i] rounded to T, the result rounded to T again and kept as float32: F.silu applied to
// a T tensor. The vectorised prefix; returns how many elements it did.
template <typename T>
inline int64_t silu_rounded_simd(const float* in, float* out, int64_t n) {
  int64_t i = 0;
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    constexpr int W = F32Vec::kWidth;
    for (; i + W <= n; i += W) F32Vec::store(out + i, silu_rounded_ps<T>(F32Vec::load(in + i)));
  }
#endif
  return i;
}

}  // namespace stateserve_simd
