// Mamba1 prefill: the selective scan of one sequence's chunk, sequential in time, with the state in registers.
// h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + (dt_t[d] * B_t[n]) * u_t[d];  y_t[d] = sum_n h_t[d, n] C_t[n].
// PyTorch has to materialise [tokens, D, N] decay and input tensors (transformers: for the whole prompt; our
// PyTorch path: per chunk, with a log-depth scan). Here each thread owns 16 channels, keeps their N states in
// AVX-512 registers (one lane per channel) and streams the tokens once: memory stays O(L * D), like the input.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "simd.h"
#if defined(__AVX512F__)

namespace {

using stateserve_simd::exp_ps;

using stateserve_simd::round_bf16_ps;

// Tokens t0 .. t1-1 of one block of up to 16 channels (lane j = channel d0 + j). The block's state is kept
// transposed, state[n] = h[d0 .. d0+15, n], and a[n] likewise holds A. MaxN is a compile-time bound so the loops
// over n unroll and the states stay in registers; n_state (<= MaxN) is the model's d_state.
template <int MaxN>
inline void scan_block(int64_t d0, int64_t width, int64_t t0, int64_t t1, int64_t D, int64_t n_state,
                       const float* up, const float* dtp, const __m512* a, const float* Bp, const float* Cp,
                       __m512* state, float* yp, float* sp, const float* Dp, const float* gp, const int64_t* want,
                       bool round_to_bf16) {
  const int64_t N = n_state;
  const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1u);
  __m512 hv[MaxN];
  for (int64_t n = 0; n < N; ++n) hv[n] = state[n];
  const __m512 dskip = Dp ? _mm512_maskz_loadu_ps(mask, Dp + d0) : _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    const __m512 dtv = _mm512_maskz_loadu_ps(mask, dtp + t * D + d0);
    const __m512 uv = _mm512_maskz_loadu_ps(mask, up + t * D + d0);
    const float* bt = Bp + t * N;
    const float* ct = Cp + t * N;
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int n = 0; n < MaxN; ++n) {
      if (MaxN != 16 && n >= N) break;
      const __m512 decay = exp_ps(_mm512_mul_ps(dtv, a[n]));
      const __m512 inp = _mm512_mul_ps(_mm512_mul_ps(dtv, _mm512_set1_ps(bt[n])), uv);  // (dt * B) * u
      hv[n] = _mm512_fmadd_ps(decay, hv[n], inp);
      const __m512 hr = round_to_bf16 ? round_bf16_ps(hv[n]) : hv[n];
      acc = _mm512_fmadd_ps(hr, _mm512_set1_ps(ct[n]), acc);
    }
    if (round_to_bf16) acc = round_bf16_ps(acc);  // y = C . h comes out of a bf16 matmul
    if (Dp) {
      acc = _mm512_fmadd_ps(uv, dskip, acc);
      acc = _mm512_mul_ps(acc, _mm512_maskz_loadu_ps(mask, gp + t * D + d0));
    }
    _mm512_mask_storeu_ps(yp + t * D + d0, mask, acc);
    if (want[t + 1] >= 0) {
      const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(N)));
      float* dst = sp + want[t + 1] * D * N;
      for (int64_t n = 0; n < N; ++n) _mm512_mask_i32scatter_ps(dst + d0 * N + n, mask, idx, hv[n], 4);
    }
  }
  for (int64_t n = 0; n < N; ++n) state[n] = hv[n];
}

}  // namespace
#endif

// u, dt: [L, D] float32 (dt after bias and softplus); A: [D, N] float32; B, C: [L, N] float32; h0: [D, N] float32
// or empty (zeros); offsets: token counts (1..L) after which the state is wanted. With D [D] and gate [L, D]
// (float32, the caller's silu(z)) the output is (y + u * D) * gate, the block's D skip and gate fused in.
// Returns (y [L, D] float32, final state [D, N], states after each offset [num_offsets, D, N]).
std::vector<torch::Tensor> selective_scan_fwd(torch::Tensor u, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                              torch::Tensor C, c10::optional<torch::Tensor> h0,
                                              std::vector<int64_t> offsets, bool round_to_bf16,
                                              c10::optional<torch::Tensor> skip, c10::optional<torch::Tensor> gate) {
  for (const auto* t : {&u, &dt, &A, &B, &C})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "selective_scan_fwd: float32 inputs");
  u = u.contiguous();
  dt = dt.contiguous();
  A = A.contiguous();
  B = B.contiguous();
  C = C.contiguous();
  const int64_t L = u.size(0), D = u.size(1), N = A.size(1);
  TORCH_CHECK(dt.size(0) == L && dt.size(1) == D && A.size(0) == D && B.size(0) == L && B.size(1) == N &&
                  C.size(0) == L && C.size(1) == N,
              "selective_scan_fwd: shapes do not agree");
  for (int64_t off : offsets) TORCH_CHECK(off >= 1 && off <= L, "selective_scan_fwd: offset ", off, " outside 1..", L);
  auto h = (h0.has_value() && h0->defined()) ? h0->to(at::kFloat).contiguous().clone() : torch::zeros({D, N}, u.options());
  torch::Tensor Dv, gv;
  if (skip.has_value() && skip->defined()) Dv = skip->to(at::kFloat).contiguous();
  if (gate.has_value() && gate->defined()) gv = gate->to(at::kFloat).contiguous();
  TORCH_CHECK(Dv.defined() == gv.defined(), "selective_scan_fwd: D and gate come together");
  auto y = torch::empty({L, D}, u.options());
  auto snaps = torch::empty({static_cast<int64_t>(offsets.size()), D, N}, u.options());
  std::vector<int64_t> want(L + 1, -1);  // want[t] = index of the snapshot taken after t tokens
  for (size_t i = 0; i < offsets.size(); ++i) want[offsets[i]] = static_cast<int64_t>(i);
  const float *up = u.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>(), *sp = snaps.data_ptr<float>();
  const float* Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  const float* gp = gv.defined() ? gv.data_ptr<float>() : nullptr;
  constexpr int64_t kLanes = 16;
  const int64_t num_blocks = (D + kLanes - 1) / kLanes;
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (N <= 32) {
      // Time-major inputs: token t of a block is 64 bytes of a D-float row. Scanning one block over all tokens
      // touches a new page per token and stream (no prefetch, a TLB miss each); instead every block of this
      // thread advances kTokens tokens in turn, so the rows of those tokens are read across, from cache.
      constexpr int64_t kTokens = 32;
      const int64_t count = end - begin;
      std::vector<__m512> states(count * N), as(count * N);  // [block][n], transposed: one lane per channel
      const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(N)));
      auto mask_of = [&](int64_t blk) {
        return static_cast<__mmask16>((1u << std::min(kLanes, D - blk * kLanes)) - 1u);
      };
      for (int64_t i = 0; i < count; ++i) {
        const int64_t d0 = (begin + i) * kLanes;
        for (int64_t n = 0; n < N; ++n) {
          states[i * N + n] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask_of(begin + i), idx, hp + d0 * N + n, 4);
          as[i * N + n] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask_of(begin + i), idx, Ap + d0 * N + n, 4);
        }
      }
      for (int64_t t0 = 0; t0 < L; t0 += kTokens) {
        const int64_t t1 = std::min(L, t0 + kTokens);
        for (int64_t i = 0; i < count; ++i) {
          const int64_t d0 = (begin + i) * kLanes, width = std::min(kLanes, D - d0);
          const auto run = N == 16 ? scan_block<16> : scan_block<32>;
          run(d0, width, t0, t1, D, N, up, dtp, &as[i * N], Bp, Cp, &states[i * N], yp, sp, Dp, gp, want.data(),
              round_to_bf16);
        }
      }
      for (int64_t i = 0; i < count; ++i)
        for (int64_t n = 0; n < N; ++n)
          _mm512_mask_i32scatter_ps(hp + (begin + i) * kLanes * N + n, mask_of(begin + i), idx, states[i * N + n], 4);
      return;
    }
#endif
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t d0 = blk * kLanes, width = std::min(kLanes, D - d0);
      // portable path: one channel at a time
      for (int64_t d = d0; d < d0 + width; ++d) {
        float* hd = hp + d * N;
        const float* ad = Ap + d * N;
        for (int64_t t = 0; t < L; ++t) {
          const float dv = dtp[t * D + d], uv = up[t * D + d];
          float acc = 0.f;
          for (int64_t n = 0; n < N; ++n) {
            hd[n] = std::exp(dv * ad[n]) * hd[n] + (dv * Bp[t * N + n]) * uv;
            const float hr = round_to_bf16 ? static_cast<float>(static_cast<at::BFloat16>(hd[n])) : hd[n];
            acc += hr * Cp[t * N + n];
          }
          if (round_to_bf16) acc = static_cast<float>(static_cast<at::BFloat16>(acc));
          yp[t * D + d] = Dp ? (acc + uv * Dp[d]) * gp[t * D + d] : acc;
          if (want[t + 1] >= 0) std::copy(hd, hd + N, sp + (want[t + 1] * D + d) * N);
        }
      }
    }
  });
  return {y, h, snaps};
}
