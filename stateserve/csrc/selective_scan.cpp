// Mamba1 prefill: the selective scan of one sequence's chunk, sequential in time, with the state in registers.
// h_t[d, n] = exp(dt_t[d] * A[d, n]) * h_{t-1}[d, n] + (dt_t[d] * B_t[n]) * u_t[d];  y_t[d] = sum_n h_t[d, n] C_t[n].
// PyTorch has to materialise [tokens, D, N] decay and input tensors (transformers: for the whole prompt; our
// PyTorch path: per chunk, with a log-depth scan). Here each thread owns blocks of 16 channels (8 with AVX2), keeps
// their N states in vector registers (one lane per channel) and streams the tokens once: memory stays O(L * D).
// u, dt and z are read in the model dtype T where they lie (no float32 copies), and the gated output is written in T.
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

using stateserve_simd::round_to;
using stateserve_simd::silu_rounded;

// Rows of the [L, D] inputs; `stride` = elements between tokens (u and dt are contiguous, z is a column slice).
template <typename T>
struct Rows {
  const T* data;
  int64_t stride;
  const T* at(int64_t t, int64_t d) const { return data + t * stride + d; }
};

template <typename T>
struct ScanArgs {
  Rows<T> u, dt, z;  // z.data == nullptr: no gate
  const float* dt_bias;  // [D]: dt holds raw values, the step is softplus(dt + dt_bias) in T; nullptr: dt is the step
  const float *A, *B, *C, *Dskip;  // A [D, N], B/C [L, N], Dskip [D] float32
  int64_t D, N;
  float* h;  // [D, N] float32, updated
  float* y_float;  // [L, D] ungated output
  T* y_model;  // [L, D] gated output (y + u * Dskip) * silu(z), in T
  float* snaps;  // [num_offsets, D, N]
  const int64_t* want;  // want[t] = snapshot index after t tokens, or -1
};

#if SS_HAS_AVX512_BW
using stateserve_simd::exp_ps;
using stateserve_simd::load16_masked;
using stateserve_simd::round_bf16_ps;

// Tokens t0 .. t1-1 of one block of up to 16 channels (lane j = channel d0 + j). The block's state is kept
// transposed, state[n] = h[d0 .. d0+15, n], and a[n] likewise holds A. MaxN is a compile-time bound so the loops
// over n unroll and the states stay in registers.
template <int MaxN, typename T>
inline void scan_block(const ScanArgs<T>& p, int64_t d0, __mmask16 mask, int64_t t0, int64_t t1, const __m512* a,
                       __m512* state) {
  constexpr bool kRound = std::is_same_v<T, at::BFloat16>;  // y = C . h comes out of a T matmul in PyTorch
  const int64_t N = p.N;
  __m512 hv[MaxN];
  for (int64_t n = 0; n < N; ++n) hv[n] = state[n];
  const __m512 dskip = p.z.data ? _mm512_maskz_loadu_ps(mask, p.Dskip + d0) : _mm512_setzero_ps();
  const __m512 dt_bias = p.dt_bias ? _mm512_maskz_loadu_ps(mask, p.dt_bias + d0) : _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    __m512 dtv = load16_masked(p.dt.at(t, d0), mask);
    if (p.dt_bias) {  // as F.softplus(dt + bias) in T: the sum and the result each rounded to T
      dtv = stateserve_simd::round_to_ps<T>(stateserve_simd::softplus_ps(
          stateserve_simd::round_to_ps<T>(_mm512_add_ps(dtv, dt_bias))));
    }
    const __m512 uv = load16_masked(p.u.at(t, d0), mask);
    const float* bt = p.B + t * N;
    const float* ct = p.C + t * N;
    __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 32
    for (int n = 0; n < MaxN; ++n) {
      if (MaxN != 16 && n >= N) break;
      const __m512 decay = exp_ps(_mm512_mul_ps(dtv, a[n]));
      const __m512 inp = _mm512_mul_ps(_mm512_mul_ps(dtv, _mm512_set1_ps(bt[n])), uv);  // (dt * B) * u
      hv[n] = _mm512_fmadd_ps(decay, hv[n], inp);
      const __m512 hr = kRound ? round_bf16_ps(hv[n]) : hv[n];
      acc = _mm512_fmadd_ps(hr, _mm512_set1_ps(ct[n]), acc);
    }
    if (kRound) acc = round_bf16_ps(acc);
    if (p.z.data) {
      acc = _mm512_fmadd_ps(uv, dskip, acc);
      acc = _mm512_mul_ps(acc, stateserve_simd::silu_rounded_ps<T>(load16_masked(p.z.at(t, d0), mask)));
      stateserve_simd::store16_masked(p.y_model + t * p.D + d0, mask, acc);
    } else {
      _mm512_mask_storeu_ps(p.y_float + t * p.D + d0, mask, acc);
    }
    if (p.want[t + 1] >= 0) {
      const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(static_cast<int>(N)));
      float* dst = p.snaps + p.want[t + 1] * p.D * N;
      for (int64_t n = 0; n < N; ++n) _mm512_mask_i32scatter_ps(dst + d0 * N + n, mask, idx, hv[n], 4);
    }
  }
  for (int64_t n = 0; n < N; ++n) state[n] = hv[n];
}

// Channel blocks [begin, end) over all L tokens. Time-major inputs: token t of a block is 64 bytes of a D-wide row,
// so scanning one block over all tokens would touch a new page per token and stream (no prefetch, a TLB miss
// each); instead every block of the range advances kTokens tokens in turn and the rows are read across.
template <typename T>
void scan_blocks_avx512(const ScanArgs<T>& p, int64_t L, int64_t begin, int64_t end) {
  constexpr int64_t kLanes = 16, kTokens = 32;
  const int64_t N = p.N, count = end - begin;
  std::vector<__m512> states(count * N), as(count * N);  // [block][n], transposed: one lane per channel
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(N)));
  auto mask_of = [&](int64_t blk) {
    return static_cast<__mmask16>((1u << std::min(kLanes, p.D - blk * kLanes)) - 1u);
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t d0 = (begin + i) * kLanes;
    for (int64_t n = 0; n < N; ++n) {
      states[i * N + n] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask_of(begin + i), idx, p.h + d0 * N + n, 4);
      as[i * N + n] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask_of(begin + i), idx, p.A + d0 * N + n, 4);
    }
  }
  const auto run = N == 16 ? scan_block<16, T> : scan_block<32, T>;
  for (int64_t t0 = 0; t0 < L; t0 += kTokens)
    for (int64_t i = 0; i < count; ++i)
      run(p, (begin + i) * kLanes, mask_of(begin + i), t0, std::min(L, t0 + kTokens), &as[i * N], &states[i * N]);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t n = 0; n < N; ++n)
      _mm512_mask_i32scatter_ps(p.h + (begin + i) * kLanes * N + n, mask_of(begin + i), idx, states[i * N + n], 4);
}
#endif

#if SS_HAS_AVX2
// The AVX2 form of scan_block: 8 channels per block (lane j = channel d0 + j, `lanes` of them valid), the same
// arithmetic and rounding; the state lives in a [N] array of vectors that the compiler keeps in registers as far
// as 16 of them go.
template <int MaxN, typename T>
inline void scan_block8(const ScanArgs<T>& p, int64_t d0, int64_t lanes, int64_t t0, int64_t t1, const __m256* a,
                        __m256* state) {
  using namespace stateserve_simd;
  constexpr bool kRound = std::is_same_v<T, at::BFloat16>;
  const int64_t N = p.N;
  const bool full = lanes == 8;
  const auto load = [&](const auto* ptr) { return full ? load8(ptr) : load8_first(ptr, lanes); };
  __m256 hv[MaxN];
  for (int64_t n = 0; n < N; ++n) hv[n] = state[n];
  const __m256 dskip = p.z.data ? load(p.Dskip + d0) : _mm256_setzero_ps();
  const __m256 dt_bias = p.dt_bias ? load(p.dt_bias + d0) : _mm256_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    __m256 dtv = load(p.dt.at(t, d0));
    if (p.dt_bias) dtv = round_to_ps<T>(softplus_ps(round_to_ps<T>(_mm256_add_ps(dtv, dt_bias))));
    const __m256 uv = load(p.u.at(t, d0));
    const float* bt = p.B + t * N;
    const float* ct = p.C + t * N;
    __m256 acc = _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int n = 0; n < MaxN; ++n) {
      if (MaxN != 16 && n >= N) break;
      const __m256 decay = exp_ps(_mm256_mul_ps(dtv, a[n]));
      const __m256 inp = _mm256_mul_ps(_mm256_mul_ps(dtv, _mm256_set1_ps(bt[n])), uv);  // (dt * B) * u
      hv[n] = _mm256_fmadd_ps(decay, hv[n], inp);
      acc = _mm256_fmadd_ps(kRound ? round_bf16_ps(hv[n]) : hv[n], _mm256_set1_ps(ct[n]), acc);
    }
    if (kRound) acc = round_bf16_ps(acc);
    if (p.z.data) {
      acc = _mm256_fmadd_ps(uv, dskip, acc);
      acc = _mm256_mul_ps(acc, silu_rounded_ps<T>(load(p.z.at(t, d0))));
      T* dst = p.y_model + t * p.D + d0;
      full ? store8(dst, acc) : store8_first(dst, lanes, acc);
    } else {
      float* dst = p.y_float + t * p.D + d0;
      full ? store8(dst, acc) : store8_first(dst, lanes, acc);
    }
    if (p.want[t + 1] >= 0) {
      float* dst = p.snaps + (p.want[t + 1] * p.D + d0) * N;
      alignas(32) float lane[8];
      for (int64_t n = 0; n < N; ++n) {
        _mm256_store_ps(lane, hv[n]);
        for (int64_t j = 0; j < lanes; ++j) dst[j * N + n] = lane[j];
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) state[n] = hv[n];
}

// Channels [d_begin, d_end) in blocks of 8, every block advancing kTokens tokens in turn (see scan_blocks_avx512).
template <typename T>
void scan_blocks_avx2(const ScanArgs<T>& p, int64_t L, int64_t d_begin, int64_t d_end) {
  constexpr int64_t kLanes = 8, kTokens = 32;
  const int64_t N = p.N, count = (d_end - d_begin + kLanes - 1) / kLanes;
  std::vector<__m256> states(count * N), as(count * N);  // [block][n], transposed: one lane per channel
  alignas(32) float h_lanes[8], a_lanes[8];
  const auto lanes_of = [&](int64_t i) { return std::min(kLanes, d_end - d_begin - i * kLanes); };
  for (int64_t i = 0; i < count; ++i)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t d = d_begin + i * kLanes + std::min(j, lanes_of(i) - 1);  // unused lanes repeat the last
        h_lanes[j] = p.h[d * N + n], a_lanes[j] = p.A[d * N + n];
      }
      states[i * N + n] = _mm256_load_ps(h_lanes), as[i * N + n] = _mm256_load_ps(a_lanes);
    }
  const auto run = N == 16 ? scan_block8<16, T> : scan_block8<32, T>;
  for (int64_t t0 = 0; t0 < L; t0 += kTokens)
    for (int64_t i = 0; i < count; ++i)
      run(p, d_begin + i * kLanes, lanes_of(i), t0, std::min(L, t0 + kTokens), &as[i * N], &states[i * N]);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t n = 0; n < N; ++n) {
      _mm256_store_ps(h_lanes, states[i * N + n]);
      for (int64_t j = 0; j < lanes_of(i); ++j) p.h[(d_begin + i * kLanes + j) * N + n] = h_lanes[j];
    }
}
#endif

// Portable path: channels [d_begin, d_end) one at a time, the same arithmetic and rounding.
template <typename T>
void scan_channels(const ScanArgs<T>& p, int64_t L, int64_t d_begin, int64_t d_end) {
  constexpr bool kRound = std::is_same_v<T, at::BFloat16>;
  const int64_t N = p.N;
  for (int64_t d = d_begin; d < d_end; ++d) {
    float* hd = p.h + d * N;
    const float* ad = p.A + d * N;
    for (int64_t t = 0; t < L; ++t) {
      float dv = static_cast<float>(*p.dt.at(t, d));
      if (p.dt_bias) {
        dv = round_to<T>(dv + p.dt_bias[d]);
        dv = stateserve_simd::softplus_rounded<T>(dv);
      }
      const float uv = static_cast<float>(*p.u.at(t, d));
      float acc = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        hd[n] = std::exp(dv * ad[n]) * hd[n] + (dv * p.B[t * N + n]) * uv;
        acc += (kRound ? round_to<T>(hd[n]) : hd[n]) * p.C[t * N + n];
      }
      if (kRound) acc = round_to<T>(acc);
      if (p.z.data)
        p.y_model[t * p.D + d] = static_cast<T>((acc + uv * p.Dskip[d]) * silu_rounded<T>(static_cast<float>(*p.z.at(t, d))));
      else
        p.y_float[t * p.D + d] = acc;
      if (p.want[t + 1] >= 0) std::copy(hd, hd + N, p.snaps + (p.want[t + 1] * p.D + d) * N);
    }
  }
}

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0)};
}

// Last dimension contiguous (a column slice such as z of [x | z] is fine); converted only if not already dtype.
at::Tensor rows_in(const at::Tensor& t, at::ScalarType dtype) {
  auto r = t.scalar_type() == dtype ? t : t.to(dtype);
  return r.stride(1) == 1 ? r : r.contiguous();
}
}  // namespace

// u, dt: [L, D] in the model dtype T (float32 or bfloat16; dt the step, after bias and softplus, or with dt_bias
// [D] the raw values, the softplus of dt + dt_bias taken here as F.softplus in T does); A: [D, N] float32; B, C:
// [L, N]; h0: [D, N] float32 or empty (zeros); offsets: token counts (1..L) after which the state is wanted. With
// Dskip [D] and z [L, D] (in T, the gate before its SiLU) the output is (y + u * Dskip) * silu(z) in T, the block's
// skip and gate fused in; without them y in float32. With T = bfloat16 the state is rounded to T before the product
// with C and y once after it, as PyTorch's T matmul does.
// Returns (y [L, D], final state [D, N] float32, states after each offset [num_offsets, D, N] float32).
std::vector<at::Tensor> selective_scan_fwd(at::Tensor u, at::Tensor dt, at::Tensor A, at::Tensor B,
                                              at::Tensor C, c10::optional<at::Tensor> h0,
                                              std::vector<int64_t> offsets, c10::optional<at::Tensor> skip,
                                              c10::optional<at::Tensor> z, c10::optional<at::Tensor> dt_bias) {
  const auto dtype = u.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "selective_scan_fwd: float32 or bfloat16 u");
  TORCH_CHECK(u.dim() == 2 && dt.dim() == 2 && A.dim() == 2 && B.dim() == 2 && C.dim() == 2,
              "selective_scan_fwd: u, dt [L, D], A [D, N], B, C [L, N]");
  u = rows_in(u, dtype), dt = rows_in(dt, dtype);
  A = A.to(at::kFloat).contiguous(), B = B.to(at::kFloat).contiguous(), C = C.to(at::kFloat).contiguous();
  const int64_t L = u.size(0), D = u.size(1), N = A.size(1);
  TORCH_CHECK(dt.size(0) == L && dt.size(1) == D && A.size(0) == D && B.size(0) == L && B.size(1) == N &&
                  C.size(0) == L && C.size(1) == N,
              "selective_scan_fwd: shapes do not agree");
  for (int64_t off : offsets) TORCH_CHECK(off >= 1 && off <= L, "selective_scan_fwd: offset ", off, " outside 1..", L);
  const bool gated = z.has_value() && z->defined();
  TORCH_CHECK(gated == (skip.has_value() && skip->defined()), "selective_scan_fwd: D and z come together");
  at::Tensor Dv, zv;
  if (gated) {
    Dv = skip->to(at::kFloat).contiguous(), zv = rows_in(*z, dtype);
    TORCH_CHECK(Dv.numel() == D && zv.dim() == 2 && zv.size(0) == L && zv.size(1) == D,
                "selective_scan_fwd: D [D] and z [L, D]");
  }
  at::Tensor bias;
  if (dt_bias.has_value() && dt_bias->defined()) {
    bias = dt_bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.numel() == D, "selective_scan_fwd: dt_bias [D]");
  }
  auto h = (h0.has_value() && h0->defined()) ? h0->to(at::kFloat).contiguous().clone()
                                             : at::zeros({D, N}, u.options().dtype(at::kFloat));
  auto y = at::empty({L, D}, u.options().dtype(gated ? dtype : at::kFloat));
  auto snaps = at::empty({static_cast<int64_t>(offsets.size()), D, N}, h.options());
  std::vector<int64_t> want(L + 1, -1);
  for (size_t i = 0; i < offsets.size(); ++i) want[offsets[i]] = static_cast<int64_t>(i);
  constexpr int64_t kLanes = 16;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "selective_scan_fwd", [&] {
    ScanArgs<scalar_t> p{rows_of<scalar_t>(u), rows_of<scalar_t>(dt),
                         gated ? rows_of<scalar_t>(zv) : Rows<scalar_t>{nullptr, 0},
                         bias.defined() ? bias.data_ptr<float>() : nullptr, A.data_ptr<float>(), B.data_ptr<float>(), C.data_ptr<float>(),
                         gated ? Dv.data_ptr<float>() : nullptr, D, N, h.data_ptr<float>(),
                         gated ? nullptr : y.data_ptr<float>(), gated ? y.data_ptr<scalar_t>() : nullptr,
                         snaps.data_ptr<float>(), want.data()};
    at::parallel_for(0, (D + kLanes - 1) / kLanes, 1, [&](int64_t begin, int64_t end) {
#if SS_HAS_AVX512_BW
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
        if (N <= 32) return scan_blocks_avx512(p, L, begin, end);
      }
#elif SS_HAS_AVX2
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
        if (N <= 32) return scan_blocks_avx2(p, L, begin * kLanes, std::min(D, end * kLanes));
      }
#endif
      scan_channels(p, L, begin * kLanes, std::min(D, end * kLanes));
    });
  });
  return {y, h, snaps};
}
