// The AVX-512 side of simd.h: F32x16, the 16-lane float32 operations under the names simd.h's vector math and the
// kernels written once over a vector type call (simd_avx2.h's F32x8 has the same), then what only AVX-512 kernels
// use (bfloat16 pairs, masked 16-bit rows, the 16x16 transpose). Included by simd.h in AVX-512 builds.
#pragma once
#include <immintrin.h>

namespace stateserve_simd {

// float32 -> bfloat16 (round to nearest even) -> float32, lane by lane.
inline __m512 round_bf16_ps(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
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

// Stores 16 float32 lanes as T (bfloat16: rounded to nearest even).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_ps(v)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

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

struct F32x16 {
  using V = __m512;
  using Mask = __mmask16;  // one bit per lane
  static constexpr int kWidth = 16;
  template <typename T>  // element types load_from takes: float32, bfloat16, float16, and others element-wise
  static constexpr bool kLoads = true;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V zero() { return _mm512_setzero_ps(); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
  static V abs(V x) { return _mm512_abs_ps(x); }
  static V neg(V x) {  // the sign bit flipped (-0 from 0, NaNs too)
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
  }
  static V sqrt(V x) { return _mm512_sqrt_ps(x); }  // correctly rounded, as std::sqrt
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // p * 2^k for whole k: scalef, which underflows to 0 smoothly for very negative k
  static V scale_pow2(V p, V k) { return _mm512_scalef_ps(p, k); }
  static V where_gt(V x, V limit, V then_v, V else_v) {  // per lane: x > limit ? then_v : else_v
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, limit, _CMP_GT_OQ), else_v, then_v);
  }
  static Mask first(int64_t n) {  // lanes [0, n)
    return n >= 16 ? Mask(0xFFFF) : n <= 0 ? Mask(0) : static_cast<Mask>((1u << n) - 1u);
  }
  static V select(Mask m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // per lane: m ? a : b
  static V keep(Mask m, V v) { return _mm512_maskz_mov_ps(m, v); }          // per lane: m ? v : 0
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  static V reduce(const V* v) { return reduce16_ps(v); }  // lane j: the sum of v[j]'s lanes
  static void transpose(V* r) { transpose16x16_ps(r); }  // r[i] lane j <-> r[j] lane i
  static V round_bf16(V v) { return round_bf16_ps(v); }
  template <typename T>
  static V load_from(const T* p) { return load16(p); }  // T values widened to float32
  template <typename T>
  static void store_to(T* p, V v) { store16(p, v); }  // rounded to T
};

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

#if SS_HAS_AVX512_BW
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

}  // namespace stateserve_simd
