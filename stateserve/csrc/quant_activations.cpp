// x's rows quantized per block of 32 as llama.cpp's quantize_row_q8_0 (the int8-activation mode of the quantized
// linears, quant_tiles.h): d = amax / 127, id = 1 / d (0 when d is 0), code = roundf(x * id) (half away from zero),
// the product using float(float16(d)) as block_q8_0 stores it. The same codes in every path: AVX-512, AVX2, the
// portable loop.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include "quant_tiles.h"

namespace stateserve_quant {
namespace {

inline float block_scale(float amax, float* id) {
  const float d = amax / 127.f;
  *id = d != 0.f ? 1.f / d : 0.f;
  return static_cast<float>(static_cast<at::Half>(d));  // the product uses the float16 scale, as block_q8_0
}

template <typename T>
void quantize_row(const T* x, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sums, int64_t sum_values) {
  const int64_t blocks = K / kBlock;
#if SS_HAS_AVX512
  using stateserve_simd::load16;
  const __m128i flip = _mm_set1_epi8(static_cast<char>(offset ? 0x80 : 0));
  for (int64_t b = 0; b < blocks; ++b) {
    const __m512 v[2] = {load16(x + b * kBlock), load16(x + b * kBlock + 16)};
    float id;
    d[b] = block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))), &id);
    for (int h = 0; h < 2; ++h) {
      // roundf: the whole part, then one away from zero where the (exact) fraction is at least a half
      const __m512 p = _mm512_mul_ps(v[h], _mm512_set1_ps(id));
      __m512 r = _mm512_roundscale_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m512 frac = _mm512_sub_ps(p, r);
      r = _mm512_mask_add_ps(r, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(0.5f), _CMP_GE_OQ), r, _mm512_set1_ps(1.f));
      r = _mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(frac, _mm512_set1_ps(-0.5f), _CMP_LE_OQ), r,
                             _mm512_set1_ps(1.f));
      const __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h), _mm_xor_si128(bytes, flip));
    }
  }
#elif SS_HAS_AVX2
  using stateserve_simd::load8;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(offset ? 0x80 : 0));
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kBlock + 8 * i);
      m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
    }
    float id;
    d[b] = block_scale(stateserve_simd::hmax8(m), &id);
    __m256i n[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 p = _mm256_mul_ps(v[i], _mm256_set1_ps(id));
      __m256 r = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __m256 frac = _mm256_sub_ps(p, r), one = _mm256_set1_ps(1.f);
      r = _mm256_add_ps(r, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ), one));
      r = _mm256_sub_ps(r, _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(-0.5f), _CMP_LE_OQ), one));
      n[i] = _mm256_cvttps_epi32(r);
    }
    // int32 -> int8 (in range, no saturation): the packs interleave 128-bit lanes, the permute puts them back
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_xor_si256(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                         flip));
  }
#else
  for (int64_t b = 0; b < blocks; ++b) {
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(static_cast<float>(x[b * kBlock + j])));
    float id;
    d[b] = block_scale(amax, &id);
    for (int64_t j = 0; j < kBlock; ++j) {
      const int code = static_cast<int>(std::roundf(static_cast<float>(x[b * kBlock + j]) * id));
      q[b * kBlock + j] = static_cast<uint8_t>(offset ? code + 128 : code);
    }
  }
#endif
  if (sums == nullptr) return;
  TORCH_INTERNAL_ASSERT(!offset, "code sums are of signed codes");
  TORCH_INTERNAL_ASSERT(sum_values > 0 && kBlock % sum_values == 0, "sums of whole blocks or parts of one");
  for (int64_t g = 0; g < K / sum_values; ++g) {
    int32_t s = 0;
    for (int64_t j = 0; j < sum_values; ++j) s += static_cast<int8_t>(q[g * sum_values + j]);
    sums[g] = s;
  }
}

}  // namespace

void a8_quantize_row(const float* x, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sums,
                     int64_t sum_values) {
  quantize_row(x, K, offset, q, d, sums, sum_values);
}
void a8_quantize_row(const at::BFloat16* x, int64_t K, bool offset, uint8_t* q, float* d, int32_t* sums,
                     int64_t sum_values) {
  quantize_row(x, K, offset, q, d, sums, sum_values);
}

}  // namespace stateserve_quant
