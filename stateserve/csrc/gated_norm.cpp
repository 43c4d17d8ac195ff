// Mamba2's gated RMSNorm (the norm between the SSD scan and out_proj), in its own file: one pass per row over the
// scan's float32 output and the gate, on AVX-512 where the sizes allow.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include <type_traits>
#include <vector>
#include "kernels.h"
#include "simd.h"

namespace {

using stateserve_simd::rows_grain;
using stateserve_simd::silu_rounded;
using stateserve_simd::silu_rounded_simd;

// h = y (norm_before_gate) or y * act; returns the sum of h^2 (a pragma cannot sit in the dispatch macro below).
float gate_and_square(const float* y, const float* act, float* h, int64_t n, bool norm_before_gate) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < n; ++i) {
    const float v = norm_before_gate ? y[i] : y[i] * act[i];
    h[i] = v;
    sq += v * v;
  }
  return sq;
}

// One row of the gated RMSNorm on AVX-512 (float32 or bfloat16 gate and output; I and the group size multiples
// of 16); `h` is scratch of I floats. Returns false where it does not apply (the caller's scalar loop runs).
template <typename T>
bool gated_rms_norm_row_simd(const float* y, const T* gate, const float* w, T* out, float* h, int64_t I,
                             int64_t group_size, float eps, bool norm_before_gate) {
#if SS_HAS_AVX512
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    if (I % 16 != 0 || group_size % 16 != 0) return false;
    for (int64_t g0 = 0; g0 < I; g0 += group_size) {
      __m512 sq = _mm512_setzero_ps();
      for (int64_t i = g0; i < g0 + group_size; i += 16) {
        const __m512 yv = _mm512_loadu_ps(y + i);
        const __m512 v = norm_before_gate ? yv : _mm512_mul_ps(yv, silu_ps(load16(gate + i)));
        _mm512_storeu_ps(h + i, v);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(group_size) + eps);
      const __m512 rv = _mm512_set1_ps(r);
      for (int64_t i = g0; i < g0 + group_size; i += 16) {
        __m512 o = _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(_mm512_loadu_ps(h + i), rv));
        if (norm_before_gate) o = _mm512_mul_ps(o, silu_ps(load16(gate + i)));
        store16(out + i, o);
      }
    }
    return true;
  }
#endif
  return false;
}

}  // namespace

// Mamba2's gated RMSNorm over groups of `group_size` channels, in float32 as transformers computes it (y is the
// scan's float32 output): norm_before_gate=false: normalize(y * silu(z)) * weight; true: normalize(y) * weight *
// silu(z). y: [M, I] float32; gate z: [M, I] (any row stride: a view of in_proj's output) and weight: [I] in the
// model dtype. Returns [M, I] in the gate's (model) dtype: rounded once at the end, as out_proj reads it.
at::Tensor gated_rms_norm(at::Tensor y, at::Tensor gate, at::Tensor weight, int64_t group_size,
                             double eps, bool norm_before_gate) {
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && gate.sizes() == y.sizes() && weight.dim() == 1 &&
                  weight.size(0) == y.size(1) && group_size > 0 && y.size(1) % group_size == 0,
              "gated_rms_norm: y [M, I] float32, gate [M, I], weight [I], I a multiple of group_size");
  y = y.contiguous();
  if (gate.stride(1) != 1) gate = gate.contiguous();
  auto w = weight.to(at::kFloat).contiguous();
  auto out = at::empty(y.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t M = y.size(0), I = y.size(1), ld_gate = gate.stride(0);
  const float* wp = w.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate.scalar_type(), "gated_rms_norm", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, rows_grain(2 * I, 4), [&](int64_t begin, int64_t end) {
      std::vector<float> act(I), h(I);  // silu(z) and the normalized quantity of the row, float32
      for (int64_t m = begin; m < end; ++m) {
        const float* yr = yp + m * I;
        const scalar_t* gr = gp + m * ld_gate;
        scalar_t* orow = op + m * I;
        if (gated_rms_norm_row_simd<scalar_t>(yr, gr, wp, orow, h.data(), I, group_size, static_cast<float>(eps),
                                              norm_before_gate))
          continue;
        for (int64_t i = 0; i < I; ++i) act[i] = static_cast<float>(gr[i]);
        int64_t i0 = silu_rounded_simd<float>(act.data(), act.data(), I);
        for (; i0 < I; ++i0) act[i0] = silu_rounded<float>(act[i0]);
        for (int64_t g0 = 0; g0 < I; g0 += group_size) {
          const float sq = gate_and_square(yr + g0, act.data() + g0, h.data() + g0, group_size, norm_before_gate);
          const float r = 1.f / std::sqrt(sq / static_cast<float>(group_size) + static_cast<float>(eps));
          for (int64_t i = g0; i < g0 + group_size; ++i)
            orow[i] = static_cast<scalar_t>(norm_before_gate ? wp[i] * (h[i] * r) * act[i] : wp[i] * (h[i] * r));
        }
      }
    });
  });
  return out;
}
