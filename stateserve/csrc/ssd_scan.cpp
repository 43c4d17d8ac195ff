// Mamba2 prefill: the SSD recurrence of one sequence's chunk, sequential in time.
// S_t[h] = exp(dt_t[h] * A[h]) * S_{t-1}[h] + (x_t[h] * dt_t[h]) B_t[g]^T;  y_t[h] = S_t[h] C_t[g] + D[h] x_t[h].
// The chunked (quadratic) form that GPUs prefer costs ~2x the FLOPs of this recurrence at Q = 64 and many passes
// over [chunks, H, Q, Q] temporaries; on a CPU the recurrence wins. Each task owns a block of a head's state rows,
// keeps them in L1 and streams the tokens once, with the same arithmetic as the decode update (ssm_update.cpp),
// so a prompt and its token-by-token replay agree.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <tuple>
#include <cmath>
#include <vector>

#include "simd.h"
#if defined(__AVX512F__)

namespace {
// kRows rows of one head over tokens t0 .. t1-1, N = 16 * kVecs, with the state in registers. Per token only
// B_t, C_t and x_t are loaded; the loop-carried dependency is one FMA per state vector.
template <int kVecs, int kRows>
void scan_rows_in_registers(float* state, const float* xp, const float* dtp, const float* decays, const float* Bp,
                            const float* Cp,
                            float* yp, float* snaps, const int64_t* want, int64_t t0, int64_t t1, int64_t H,
                            int64_t G, int64_t P, int64_t h, int64_t g, int64_t p0, const float* skip) {
  constexpr int64_t N = 16 * kVecs;
  __m512 s[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) s[r][v] = _mm512_loadu_ps(state + r * N + 16 * v);
  for (int64_t t = t0; t < t1; ++t) {
    const float d = dtp[t * H + h];
    const __m512 decay = _mm512_set1_ps(decays[t * H + h]);
    const float* b = Bp + (t * G + g) * N;
    const float* c = Cp + (t * G + g) * N;
    const float* xt = xp + (t * H + h) * P + p0;
    __m512 bv[kVecs], cv[kVecs];
    for (int v = 0; v < kVecs; ++v) bv[v] = _mm512_loadu_ps(b + 16 * v), cv[v] = _mm512_loadu_ps(c + 16 * v);
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) {
      const __m512 dx = _mm512_set1_ps(xt[r] * d);
      acc[r] = _mm512_setzero_ps();
      for (int v = 0; v < kVecs; ++v) {
        s[r][v] = _mm512_fmadd_ps(s[r][v], decay, _mm512_mul_ps(dx, bv[v]));
        acc[r] = _mm512_fmadd_ps(s[r][v], cv[v], acc[r]);
      }
    }
    float* yt = yp + (t * H + h) * P + p0;
    if constexpr (kRows % 4 == 0) {  // four rows' C . S_t sums in one reduction tree
      for (int r = 0; r < kRows; r += 4) {
        __m128 out = stateserve_simd::reduce4_ps(acc[r], acc[r + 1], acc[r + 2], acc[r + 3]);
        if (skip) out = _mm_fmadd_ps(_mm_set1_ps(*skip), _mm_loadu_ps(xt + r), out);
        _mm_storeu_ps(yt + r, out);
      }
    } else {
      for (int r = 0; r < kRows; ++r) {
        const float out = _mm512_reduce_add_ps(acc[r]);
        yt[r] = skip ? out + *skip * xt[r] : out;
      }
    }
    if (want[t + 1] >= 0) {
      float* dst = snaps + (want[t + 1] * H * P + h * P + p0) * N;
      for (int r = 0; r < kRows; ++r)
        for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(dst + r * N + 16 * v, s[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(state + r * N + 16 * v, s[r][v]);
}
}  // namespace
#endif

// x: [L, H, P], dt: [L, H] (after softplus and clamp), B, C: [L, G, N], A, D: [H] (D may be empty), h0: [H, P, N]
// or empty (zeros); all float32. offsets: token counts (1..L) after which the state is wanted.
// Returns (y [L, H, P], final state [H, P, N], states after each offset [num_offsets, H, P, N]).
std::vector<torch::Tensor> ssd_scan_fwd(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                        torch::Tensor C, c10::optional<torch::Tensor> D,
                                        c10::optional<torch::Tensor> h0, std::vector<int64_t> offsets) {
  for (const auto* t : {&x, &dt, &A, &B, &C})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ssd_scan_fwd: float32 inputs");
  x = x.contiguous(), dt = dt.contiguous(), A = A.contiguous(), B = B.contiguous(), C = C.contiguous();
  TORCH_CHECK(x.dim() == 3 && B.dim() == 3, "ssd_scan_fwd: x [L, H, P] and B, C [L, G, N]");
  const int64_t L = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  TORCH_CHECK(dt.size(0) == L && dt.size(1) == H && A.numel() == H && B.size(0) == L && C.sizes() == B.sizes() &&
                  G >= 1 && H % G == 0,
              "ssd_scan_fwd: shapes do not agree");
  for (int64_t off : offsets) TORCH_CHECK(off >= 1 && off <= L, "ssd_scan_fwd: offset ", off, " outside 1..", L);
  auto state = (h0.has_value() && h0->defined()) ? h0->to(at::kFloat).contiguous().clone()
                                                 : torch::zeros({H, P, N}, x.options());
  TORCH_CHECK(state.numel() == H * P * N, "ssd_scan_fwd: initial state is not [H, P, N]");
  torch::Tensor Dv;
  if (D.has_value() && D->defined()) Dv = D->to(at::kFloat).contiguous();
  auto y = torch::empty({L, H, P}, x.options());
  auto snaps = torch::empty({static_cast<int64_t>(offsets.size()), H, P, N}, x.options());
  std::vector<int64_t> want(L + 1, -1);  // want[t] = index of the snapshot taken after t tokens
  for (size_t i = 0; i < offsets.size(); ++i) want[offsets[i]] = static_cast<int64_t>(i);

  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  const float* Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>(), *snp = snaps.data_ptr<float>();
  const int64_t heads_per_group = H / G;
  // exp(dt * A) of every token and head, computed once: each of a head's row blocks needs all of them, and a
  // scalar exp per token per block cost as much as the block's state update.
  std::vector<float> decays(L * H);
  at::parallel_for(0, L, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * H; i < end * H; ++i) decays[i] = std::exp(dtp[i] * Ap[i % H]);
  });
  const float* dcp = decays.data();
  // A task is kRows rows of one head: 16 x N floats (4 KB at N = 64) stay in L1 while all tokens stream past.
  constexpr int64_t kRows = 16;
  const int64_t blocks_per_head = (P + kRows - 1) / kRows;
  at::parallel_for(0, H * blocks_per_head, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks_per_head, p0 = (task % blocks_per_head) * kRows;
      const int64_t rows = std::min(kRows, P - p0), g = h / heads_per_group;
      float* block = sp + (h * P + p0) * N;  // rows p0 .. p0+rows-1 of head h, updated in place
      const float skip = Dp ? Dp[h] : 0.f;
#if defined(__AVX512F__)
      // 16 state vectors in registers per call, leaving room for B_t, C_t and the accumulators.
      if ((N == 16 || N == 32 || N == 64 || N == 128) && rows % (256 / N) == 0) {
        // Token rows of x and y are H * P floats apart (a new page per token): the row groups of the block take
        // kTokens tokens in turn, so the pages of those tokens are reused by every group while they are hot.
        constexpr int64_t kTokens = 32;
        const int64_t step = 256 / N;
        for (int64_t t0 = 0; t0 < L; t0 += kTokens) {
          const int64_t t1 = std::min(L, t0 + kTokens);
          for (int64_t r0 = 0; r0 < rows; r0 += step) {
            float* st = block + r0 * N;
            const auto args = std::make_tuple(st, xp, dtp, dcp, Bp, Cp, yp, snp, want.data(), t0, t1, H, G, P, h, g,
                                              p0 + r0, Dp ? &skip : nullptr);
            if (N == 16) std::apply(scan_rows_in_registers<1, 16>, args);
            else if (N == 32) std::apply(scan_rows_in_registers<2, 8>, args);
            else if (N == 64) std::apply(scan_rows_in_registers<4, 4>, args);
            else std::apply(scan_rows_in_registers<8, 2>, args);
          }
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < L; ++t) {
        const float d = dtp[t * H + h];
        const float decay = dcp[t * H + h];
        const float* b = Bp + (t * G + g) * N;
        const float* c = Cp + (t * G + g) * N;
        const float* xt = xp + (t * H + h) * P + p0;
        float* yt = yp + (t * H + h) * P + p0;
        for (int64_t r = 0; r < rows; ++r) {
          const float xv = xt[r];
          const float dx = xv * d;
          const float acc = stateserve_simd::ssd_row_update(block + r * N, decay, dx, b, c, N);
          yt[r] = Dp ? acc + skip * xv : acc;
        }
        if (want[t + 1] >= 0)
          std::copy(block, block + rows * N, snp + (want[t + 1] * H * P + h * P + p0) * N);
      }
    }
  });
  return {y, state, snaps};
}
