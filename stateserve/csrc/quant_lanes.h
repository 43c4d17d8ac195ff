// The vector operations the quantized tiles are written over (quant_a8.cpp, quant_exact.cpp: Q8_0; quant_q4_a8.cpp,
// quant_q4_exact.cpp: Q4; quant_q6k_a8.cpp, quant_q6k_exact.cpp: Q6_K): Lanes16 (AVX-512: 16 rows of a panel per
// vector) and Lanes8 (AVX2: a panel's 16 rows as two vectors of 8), the same operations under the same names. I holds
// int32 lanes (or the 4 bytes of a lane), F float32 lanes; the byte loads read kLanes rows' values of one unit of a
// panel (quant_tiles.h).
#pragma once
#include <cstdint>
#include <cstring>
#include "simd.h"

namespace stateserve_quant {

#if SS_HAS_AVX512
struct Lanes16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 4 bytes of each of 16 rows
  static I broadcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi32(v);
  }
  static I set1i(int32_t v) { return _mm512_set1_epi32(v); }
  static I zeroi() { return _mm512_setzero_si512(); }
  static I and_bytes(I v, uint8_t m) { return _mm512_and_si512(v, _mm512_set1_epi8(static_cast<char>(m))); }
  template <int S>
  static I shift_right(I v) { return S == 0 ? v : _mm512_srli_epi32(v, S); }  // each 32-bit lane
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
  static F load_f32(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F load_f16(const uint8_t* p) {  // 16 float16 values, widened exactly
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_u8(const uint8_t* p) {  // 16 unsigned bytes as float32
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static F fma(float dx, F dw, F y, F acc) {  // acc + (dx * dw) * y: the product rounded, then one fused step
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dx), dw), y, acc);
  }
  static F fma(float dx, F dw, I dot, F acc) { return fma(dx, dw, _mm512_cvtepi32_ps(dot), acc); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
using Lanes = Lanes16;
#elif SS_HAS_AVX2
struct Lanes8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I broadcast4(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_set1_epi32(v);
  }
  static I set1i(int32_t v) { return _mm256_set1_epi32(v); }
  static I zeroi() { return _mm256_setzero_si256(); }
  static I and_bytes(I v, uint8_t m) { return _mm256_and_si256(v, _mm256_set1_epi8(static_cast<char>(m))); }
  template <int S>
  static I shift_right(I v) { return S == 0 ? v : _mm256_srli_epi32(v, S); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F load_f32(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  static F load_f16(const uint8_t* p) {
#if SS_HAS_F16C
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float v[8];
    for (int i = 0; i < 8; ++i) {
      at::Half h;
      std::memcpy(&h, p + 2 * i, 2);
      v[i] = static_cast<float>(h);
    }
    return _mm256_load_ps(v);
#endif
  }
  static F load_u8(const uint8_t* p) {
    int64_t v;
    std::memcpy(&v, p, sizeof(v));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v)));
  }
  static F fma(float dx, F dw, F y, F acc) { return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dx), dw), y, acc); }
  static F fma(float dx, F dw, I dot, F acc) { return fma(dx, dw, _mm256_cvtepi32_ps(dot), acc); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
using Lanes = Lanes8;
#endif

// A float16 value from its two bytes (the scalar paths).
inline float half_at(const uint8_t* p) {
  at::Half h;
  std::memcpy(&h, p, sizeof(h));
  return static_cast<float>(h);
}

}  // namespace stateserve_quant
