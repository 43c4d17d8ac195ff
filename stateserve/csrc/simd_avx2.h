// The 8-lane (AVX2 + FMA) counterparts of simd.h's AVX-512 helpers, same names on __m256; included by simd.h only.
#pragma once
#include <torch/extension.h>
#include <type_traits>

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define STATESERVE_SIMD_AVX2 1

namespace stateserve_simd {

// 8-lane (AVX2 + FMA) counterparts of the helpers above, same names on __m256, for CPUs without AVX-512 (Zen 2/3,
// Intel client cores): without them the kernels would fall back to scalar loops there.

// exp(x) as the 16-lane exp_ps (same reduction and polynomial); 2^k is applied as two exponent-field powers
// 2^(k/2) 2^(k - k/2), each a normal float for k down to -150, so very negative x still underflows to 0 smoothly.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-104.f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i ki = _mm256_cvtps_epi32(k);
  const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(k1)), pow2(k2));
}

// 8 consecutive elements as float32 lanes (bfloat16: exact, a shift into the high half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// float32 -> bfloat16 (round to nearest even) -> float32, lane by lane.
inline __m256 round_bf16_ps(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

template <typename T>
inline __m256 round_to_ps(__m256 v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) return round_bf16_ps(v);
  return v;
}

// Stores 8 float32 lanes as T (bfloat16: rounded to nearest even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The first n (< 8) elements, the other lanes 0; and the matching store of the first n lanes. For row tails.
template <typename T>
inline __m256 load8_first(const T* p, int64_t n) {
  alignas(32) float tmp[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t j = 0; j < n; ++j) tmp[j] = static_cast<float>(p[j]);
  return _mm256_load_ps(tmp);
}
template <typename T>
inline void store8_first(T* p, int64_t n, __m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t j = 0; j < n; ++j) p[j] = static_cast<T>(tmp[j]);
}

// Lanes [0, n) of 8 set, the others clear (n clamped to [0, 8]): a blend or and-mask for a row's tail.
inline __m256 first_lanes8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int count = static_cast<int>(n < 0 ? 0 : (n > 8 ? 8 : n));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
}

// F.softplus (beta 1, threshold 20), as the 16-lane softplus_ps.
inline __m256 softplus_ps(__m256 x) {
  const __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  const __m256 y = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), abs_x));
  const __m256 s = _mm256_div_ps(y, _mm256_add_ps(_mm256_set1_ps(2.f), y));
  const __m256 s2 = _mm256_mul_ps(s, s);
  __m256 p = _mm256_set1_ps(1.f / 15.f);
  for (const float c : {1.f / 13.f, 1.f / 11.f, 1.f / 9.f, 1.f / 7.f, 1.f / 5.f, 1.f / 3.f, 1.f})
    p = _mm256_fmadd_ps(p, s2, _mm256_set1_ps(c));
  const __m256 log1p = _mm256_mul_ps(_mm256_add_ps(s, s), p);
  const __m256 r = _mm256_add_ps(_mm256_max_ps(x, _mm256_setzero_ps()), log1p);
  return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.f), _CMP_GT_OQ));
}

inline __m256 silu_ps(__m256 v) {
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}

template <typename T>
inline __m256 silu_rounded_ps(__m256 v) { return round_to_ps<T>(silu_ps(round_to_ps<T>(v))); }

// The horizontal sums of v[0..7] as the lanes of one vector (lane j = sum of v[j]): three rounds of pairwise adds.
inline __m256 reduce8_ps(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // 128-bit half 0 of u0 holds the partial sums of v[0..3] over lanes 0-3, half 1 over lanes 4-7; u1 for v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The largest and the sum of v's 8 lanes (halves, then pairs, then the last two).
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// In place, r[i] lane j <- r[j] lane i (the 8-lane transpose16x16_ps).
inline void transpose8x8_ps(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

struct F32x8 {  // see F32x16
  using V = __m256;
  static constexpr int kWidth = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V exp(V x) { return exp_ps(x); }
  template <typename T>
  static V load_from(const T* p) { return load8(p); }
  template <typename T>
  static void store_to(T* p, V v) { store8(p, v); }
  static V reduce(const V* v) { return reduce8_ps(v); }
};

}  // namespace stateserve_simd
#endif
