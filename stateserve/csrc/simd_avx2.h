// The AVX2 side of simd.h: F32x8, the 8-lane float32 operations under the names simd_avx512.h's F32x16 gives them,
// for CPUs with AVX2 + FMA and no AVX-512 (Zen 2/3, Intel client cores), then the 8-lane helpers only AVX2 kernels
// use (row tails, the 8x8 transpose). Included by simd.h in AVX2 builds.
#pragma once
#include <immintrin.h>

namespace stateserve_simd {

// float32 -> bfloat16 (round to nearest even) -> float32, lane by lane.
inline __m256 round_bf16_ps(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// 8 consecutive elements as float32 lanes (bfloat16: exact, a shift into the high half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Stores 8 float32 lanes as T (bfloat16: rounded to nearest even).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(v)), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// Lanes [0, n) of 8 set, the others clear (n clamped to [0, 8]): a blend or and-mask for a row's tail.
inline __m256 first_lanes8(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int count = static_cast<int>(n < 0 ? 0 : (n > 8 ? 8 : n));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
}

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

// In place, r[i] lane j <- r[j] lane i.
inline void transpose8x8_ps(__m256* r) {
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
  using Mask = __m256;  // all bits of a lane set or clear
  static constexpr int kWidth = 8;
  template <typename T>
  static constexpr bool kLoads = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V zero() { return _mm256_setzero_ps(); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V abs(V x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }
  static V neg(V x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.f)); }  // the sign bit flipped (-0 from 0, NaNs too)
  static V sqrt(V x) { return _mm256_sqrt_ps(x); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^k for whole k (no scalef): two exponent-field powers 2^(k/2) 2^(k - k/2), each a normal float for k down
  // to -150, so very negative k still underflows to 0 smoothly
  static V scale_pow2(V p, V k) {
    const __m256i ki = _mm256_cvtps_epi32(k);
    const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const auto pow2 = [](__m256i e) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
    };
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2(k1)), pow2(k2));
  }
  static V where_gt(V x, V limit, V then_v, V else_v) {
    return _mm256_blendv_ps(else_v, then_v, _mm256_cmp_ps(x, limit, _CMP_GT_OQ));
  }
  static Mask first(int64_t n) { return first_lanes8(n); }
  static V select(Mask m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
  static V keep(Mask m, V v) { return _mm256_and_ps(v, m); }
  static float hmax(V v) { return hmax8(v); }
  static float hsum(V v) { return hsum8(v); }
  static V reduce(const V* v) { return reduce8_ps(v); }
  static void transpose(V* r) { transpose8x8_ps(r); }
  static V round_bf16(V v) { return round_bf16_ps(v); }
  template <typename T>
  static V load_from(const T* p) { return load8(p); }
  template <typename T>
  static void store_to(T* p, V v) { store8(p, v); }
};

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

}  // namespace stateserve_simd
