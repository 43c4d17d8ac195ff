// The dtypes' vector operations the few-row linear tiles (linear.cpp) are written over: F32Lanes / Bf16Lanes
// (AVX-512, with or without vdpbf16ps) and F32Lanes8 / Bf16Lanes8 (AVX2), the same names on each: how many values of
// k a vector holds (kStep), how a vector is loaded (whole, or the first n values with the rest zero), the
// multiply-add into float32 accumulators and their total.
#pragma once
#include <cstdint>
#include <cstring>
#include "simd.h"

namespace stateserve_linear {

#if SS_HAS_AVX512
// What differs between the dtypes' products: how many values of k a vector holds, how a vector is loaded (whole,
// or the first n values with the rest zero) and the multiply-add into float32 lanes.
struct F32Lanes {  // float32: 16 values of k per vector, FMA
  using Scalar = float;
  using Vec = __m512;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static constexpr int kStep = 16;
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_first(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
  }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
};
#endif

#if SS_HAS_AVX512_BF16
struct Bf16Lanes {  // bfloat16: 32 values of k per vector, vdpbf16ps adds pairs of products into 16 float32 lanes
  using Scalar = uint16_t;
  using Vec = __m512bh;
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static constexpr int kStep = 32;
  static Vec load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec load_first(const uint16_t* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1u), p);
  }
  static __m512 madd(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
  static __m512 total(Acc acc) { return acc; }
};
#elif SS_HAS_AVX512
// bfloat16 on AVX-512 without vdpbf16ps (Skylake-SP, Ice Lake): Bf16Lanes8 below on 16 lanes, 32 values of k per
// step widened exactly to float32 (the even values by a shift, the odd ones by a mask), two FMA chains per output.
struct Bf16Lanes {
  using Scalar = uint16_t;
  struct Vec {
    __m512 even, odd;
  };
  using Acc = Vec;
  static constexpr int kStep = 32;
  static Acc zero() { return {_mm512_setzero_ps(), _mm512_setzero_ps()}; }
  static Vec widen(__m512i words) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)),
            _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static Vec load(const uint16_t* p) { return widen(_mm512_loadu_si512(p)); }
  static Vec load_first(const uint16_t* p, int64_t n) {  // the first n (< 32) values, the rest 0 (and not read)
    alignas(64) uint16_t tmp[32] = {};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return widen(_mm512_load_si512(tmp));
  }
  static Acc madd(Acc acc, Vec x, Vec w) {
    return {_mm512_fmadd_ps(x.even, w.even, acc.even), _mm512_fmadd_ps(x.odd, w.odd, acc.odd)};
  }
  static __m512 total(Acc acc) { return _mm512_add_ps(acc.even, acc.odd); }
};
#endif

#if SS_HAS_AVX2
struct F32Lanes8 {  // float32 on AVX2: 8 values of k per vector, FMA
  using Scalar = float;
  using Vec = __m256;
  using Acc = __m256;
  static constexpr int kStep = 8;
  static Acc zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_first(const float* p, int64_t n) {  // lanes below n, the rest 0 (and not read)
    return _mm256_maskload_ps(p, _mm256_castps_si256(stateserve_simd::first_lanes8(n)));
  }
  static Acc madd(Acc acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
  static __m256 total(Acc acc) { return acc; }
};

// bfloat16 on AVX2 (no vdpbf16ps): 16 values of k per step, read as 8 32-bit words and widened exactly to float32
// without shuffles: the even values by a 16-bit shift, the odd ones by masking off the low half. Each half goes
// through FMA into its own accumulator (two chains per output, added at the end). The weights stream at half of
// float32's bytes, which is what a decode step waits for. (Widening 8 values at a time with vpmovzxwd + shift
// bound one row of x at ~30 GB/s of weights in L2 on a Zen 3 core pair, against float32's ~60.)
struct Bf16Lanes8 {
  using Scalar = uint16_t;
  struct Vec {
    __m256 even, odd;
  };
  using Acc = Vec;
  static constexpr int kStep = 16;
  static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec widen(__m256i words) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(words, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
  static Vec load(const uint16_t* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load_first(const uint16_t* p, int64_t n) {  // the first n (< 16) values, the rest 0 (and not read)
    alignas(32) uint16_t tmp[16] = {};
    std::memcpy(tmp, p, n * sizeof(uint16_t));
    return widen(_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp)));
  }
  static Acc madd(Acc acc, Vec x, Vec w) {
    return {_mm256_fmadd_ps(x.even, w.even, acc.even), _mm256_fmadd_ps(x.odd, w.odd, acc.odd)};
  }
  static __m256 total(Acc acc) { return _mm256_add_ps(acc.even, acc.odd); }
};
#endif

}  // namespace stateserve_linear
