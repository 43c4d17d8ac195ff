// Helpers shared by the kernels: scalar rounding to the model dtype, SiLU and softplus as PyTorch computes them in
// that dtype, a scalar SSD row update, (only with __AVX512F__) lane conversions and a vector exp, their 8-lane
// forms for AVX2 in simd_avx2.h, and at the end F32Vec, the parallel-grain rule and a SiLU over float arrays;
// cpu_kernels.py hashes the headers into the build flags so edits trigger a rebuild.
#pragma once
#include <torch/extension.h>
#include <cmath>
#include <type_traits>

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

#if defined(__AVX512F__)
#include <immintrin.h>

namespace stateserve_simd {

// exp(x) for float32 lanes: x = k ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial for e^r (relative error
// ~2e-7, two float ulps), then scaled by 2^k with scalef (which underflows to 0 for very negative x).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);  // ln2 split in hi + lo for accuracy
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// 16 consecutive elements as float32 lanes.
template <typename T>
inline __m512 load16(const T* p) {  // any other dtype (double): element by element
  alignas(64) float tmp[16];
  for (int j = 0; j < 16; ++j) tmp[j] = static_cast<float>(p[j]);
  return _mm512_load_ps(tmp);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
// 16 bfloat16 values (raw 16-bit words in a register) as float32 lanes: exact, a shift into the high half.
inline __m512 widen_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::BFloat16* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// bfloat16 rows as "pairs": 32 elements loaded as one vector whose 32-bit lane l holds elements 2l (low half) and
// 2l + 1 (high half); the even elements widen to float32 by a shift, the odd ones by a mask, with no cross-lane
// shuffle (load16 needs one per 16 elements). Vector v of a row is then the even (v % 2 == 0) or odd elements of
// its 32-element chunk v / 2; q and the accumulators are kept in that order, and only the output is put back.
inline __m512 load_pair_half(const at::BFloat16* row, int64_t v) {
  const __m512i raw = _mm512_loadu_si512(row + 32 * (v / 2));
  return _mm512_castsi512_ps(v % 2 == 0 ? _mm512_slli_epi32(raw, 16)
                                        : _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline int64_t pair_index(int64_t d) { return d / 32 * 32 + (d % 2) * 16 + (d % 32) / 2; }  // element d, paired

template <typename scalar_t>
inline __m512 load_row16(const scalar_t* row, int64_t v, bool pairs) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (pairs) return load_pair_half(row, v);
  }
  return load16(row + 16 * v);
}

// float32 -> bfloat16 (round to nearest even) -> float32, lane by lane.
inline __m512 round_bf16_ps(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Rounds float32 lanes to T as static_cast<T> would (float32: unchanged).
template <typename T>
inline __m512 round_to_ps(__m512 v) { return v; }
template <>
inline __m512 round_to_ps<at::BFloat16>(__m512 v) { return round_bf16_ps(v); }

// Stores 16 float32 lanes as T (bfloat16: rounded to nearest even).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define STATESERVE_SIMD_MASKED_16BIT 1
// The first lanes of `m` from p (the rest 0), widened to float32; and the matching masked stores (bfloat16: rounded
// to nearest even). For row tails narrower than 16.
inline __m512 load16_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16_masked(const at::BFloat16* p, __mmask16 m) {
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}
inline void store16_masked(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16_masked(at::BFloat16* p, __mmask16 m, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bits));
}
#endif

// The 16 horizontal sums of v[0..15] as the lanes of one vector (lane i = sum of v[i]): a transpose-and-add tree
// of 45 shuffles/adds instead of 16 separate reductions (~8 dependent ops each).
inline __m512 reduce16_ps(const __m512* v) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // per 128-bit lane: one partial sum of each of v[4k..4k+3]
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // add the four 128-bit lanes of each y[k]: lane group k of the result holds the sums of v[4k..4k+3]
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// float32 vector operations under one name per ISA (this one and F32x8 below), for kernels written once for both.
struct F32x16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
  static V exp(V x) { return exp_ps(x); }
  template <typename T>
  static V load_from(const T* p) { return load16(p); }  // T values widened to float32
  template <typename T>
  static void store_to(T* p, V v) { store16(p, v); }  // rounded to T
  static V reduce(const V* v) { return reduce16_ps(v); }  // lane j: the sum of v[j]'s lanes
};

// Transposes 16 vectors of 16 32-bit lanes in place (r[i] lane j <-> r[j] lane i): unpacks within 128-bit lanes,
// 64-bit shuffles, then two rounds of 128-bit lane shuffles; 64 shuffles in all.
inline void transpose16x16_ps(__m512* r) {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // lane L of u[4k + c]: column 4L + c of rows 4k..4k+3
    u[4 * k] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * k + 1] = _mm512_shuffle_ps(t[4 * k], t[4 * k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * k + 2] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * k + 3] = _mm512_shuffle_ps(t[4 * k + 1], t[4 * k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// The horizontal sums of a, b, c, d as the four lanes of one 128-bit vector (the first two levels of reduce16_ps,
// then the four 128-bit lanes added).
inline __m128 reduce4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// F.softplus (beta 1, threshold 20) for float32 lanes: x past 20 as is, else max(x, 0) + log1p(exp(-|x|)), with
// log1p(y) = 2 atanh(s), s = y / (2 + y) <= 1/3, as an odd series to s^15 (relative error ~2e-8 before rounding):
// no 1 + y is formed, so small results keep their relative precision.
inline __m512 softplus_ps(__m512 x) {
  const __m512 y = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 s = _mm512_div_ps(y, _mm512_add_ps(_mm512_set1_ps(2.f), y));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(1.f / 15.f);
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 13.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 11.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 9.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 7.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 5.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 3.f));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f));
  const __m512 log1p = _mm512_mul_ps(_mm512_add_ps(s, s), p);
  const __m512 r = _mm512_add_ps(_mm512_max_ps(x, _mm512_setzero_ps()), log1p);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(20.f), _CMP_GT_OQ), r, x);
}

// silu(v) = v / (1 + exp(-v)) for float32 lanes.
inline __m512 silu_ps(__m512 v) {
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

// F.silu applied to a tensor of dtype T, lane by lane: the input rounded to T, silu in float32, rounded to T again.
template <typename T>
inline __m512 silu_rounded_ps(__m512 v) { return round_to_ps<T>(silu_ps(round_to_ps<T>(v))); }

}  // namespace stateserve_simd
#endif

#include "simd_avx2.h"  // the 8-lane helpers where AVX-512 is missing

namespace stateserve_simd {

#if defined(__AVX512F__)
using F32Vec = F32x16;  // the widest float32 vector this build has, if any (STATESERVE_SIMD_F32VEC)
#define STATESERVE_SIMD_F32VEC 1
#elif defined(STATESERVE_SIMD_AVX2)
using F32Vec = F32x8;
#define STATESERVE_SIMD_F32VEC 1
#endif

// Rows per parallel chunk such that a chunk holds at least ~32K elements (~10-20 us of work): a decode step's
// few rows then run inline on the calling thread. Forking the OpenMP team for a microsecond of work costs more
// than the work, and on a busy machine a region waits for whichever thread was descheduled.
inline int64_t rows_grain(int64_t elements_per_row, int64_t min_rows) {
  constexpr int64_t kInlineElements = 32768;
  return std::max<int64_t>(min_rows, kInlineElements / std::max<int64_t>(1, elements_per_row));
}

// out[i] = silu(v) with v = in[i] rounded to T, the result rounded to T again and kept as float32: F.silu applied to
// a T tensor. The vectorised prefix; returns how many elements it did.
template <typename T>
inline int64_t silu_rounded_simd(const float* in, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, silu_rounded_ps<T>(_mm512_loadu_ps(in + i)));
  }
#elif defined(STATESERVE_SIMD_AVX2)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(out + i, silu_rounded_ps<T>(_mm256_loadu_ps(in + i)));
  }
#endif
  return i;
}

}  // namespace stateserve_simd
