// Decode attention's task for CPUs with AVX2 + FMA and no AVX-512, for float32 and bfloat16 caches
// (paged_attention.cpp runs it there; float16 caches keep the portable loop). bfloat16 keys and values are widened
// exactly to float32 as they are loaded; every sum is in float32. Same passes as the AVX-512 task: scores of up to
// 16 keys of a block at a time, each 8 of them reduced by one transpose-and-add, a masked softmax, then P.V; q and
// the accumulators in 8-lane registers for the common head sizes 64 and 128.
#include "paged_attention.h"
#include <cmath>
#include <limits>
#include "simd.h"

namespace stateserve_attention {

#if defined(STATESERVE_SIMD_AVX2)
namespace {
using stateserve_simd::exp_ps;
using stateserve_simd::first_lanes8;
using stateserve_simd::load8;
using stateserve_simd::reduce8_ps;

// scores: [nh, stride], the first len of each row valid -> exp(score - row max) in place, lanes past len zero (the
// stride leaves room for whole vectors); inv[i] = 1 / row i's sum.
void softmax_numerators8(float* scores, int64_t nh, int64_t stride, int64_t len, float* inv) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < nh; ++i) {
    float* sg = scores + i * stride;
    __m256 mv = minus_inf;
    for (int64_t t0 = 0; t0 < len; t0 += 8)
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(sg + t0), first_lanes8(len - t0)));
    const __m256 m = _mm256_set1_ps(stateserve_simd::hmax8(mv));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
      const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + t0), m)), first_lanes8(len - t0));
      _mm256_storeu_ps(sg + t0, e);
      sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    float total = 0.f;  // lane by lane
    for (const float x : lanes) total += x;
    inv[i] = 1.f / total;
  }
}

// head_dim = 8 * nv (NV > 0: known at compile time, q in registers; NV == 0: nv at run time, up to 32).
template <typename T, int NV>
void task(const T* q, const T* k_cache, const T* v_cache, const TaskView& tv, T* out, float scale,
          std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  constexpr int kMaxNV = NV > 0 ? NV : 32;
  const int64_t head_dim = tv.head_dim, nv = NV > 0 ? NV : head_dim / 8;
  const int64_t nh = tv.num_query_heads(), stride = tv.score_stride(), group = tv.group;
  scores.resize(nh * stride);
  qf.resize(nh * head_dim);
  acc.assign(nh * head_dim, 0.f);
  for (int64_t x = 0; x < nh * head_dim; ++x) qf[x] = static_cast<float>(q[x]) * scale;
  walk_keys(k_cache, tv, [&](int64_t t0, int64_t n, const T* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const T* k = rows + (tv.kh0 + i / group) * tv.head_stride;
      __m256 qv[kMaxNV];
      for (int64_t v = 0; v < nv; ++v) qv[v] = _mm256_loadu_ps(qf.data() + i * head_dim + 8 * v);
      for (int64_t h = 0; h < n; h += 8) {  // 8 keys, one reduction
        __m256 dots[8];
        const int64_t m = std::min<int64_t>(8, n - h);
        for (int64_t j = 0; j < m; ++j) {
          const T* kr = k + (h + j) * head_dim;
          __m256 dot = _mm256_mul_ps(load8(kr), qv[0]);
          for (int64_t v = 1; v < nv; ++v) dot = _mm256_fmadd_ps(load8(kr + 8 * v), qv[v], dot);
          dots[j] = dot;
        }
        for (int64_t j = m; j < 8; ++j) dots[j] = _mm256_setzero_ps();
        _mm256_storeu_ps(scores.data() + i * stride + t0 + h, reduce8_ps(dots));
      }
    }
  });
  float inv[256];  // nh <= num_heads <= 256: checked by the caller
  softmax_numerators8(scores.data(), nh, stride, tv.len, inv);
  walk_keys(v_cache, tv, [&](int64_t t0, int64_t n, const T* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const T* vr = rows + (tv.kh0 + i / group) * tv.head_stride;
      const float* p = scores.data() + i * stride + t0;
      float* a = acc.data() + i * head_dim;
      __m256 av[kMaxNV];  // one accumulator per 8 columns: nv independent FMA chains a key
      for (int64_t v = 0; v < nv; ++v) av[v] = _mm256_loadu_ps(a + 8 * v);
      for (int64_t j = 0; j < n; ++j) {
        const T* vj = vr + j * head_dim;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int64_t v = 0; v < nv; ++v) av[v] = _mm256_fmadd_ps(pj, load8(vj + 8 * v), av[v]);
      }
      for (int64_t v = 0; v < nv; ++v) _mm256_storeu_ps(a + 8 * v, av[v]);
    }
  });
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < head_dim; ++d) out[i * head_dim + d] = static_cast<T>(acc[i * head_dim + d] * inv[i]);
}

}  // namespace

bool decode_task_x8_supported() { return true; }

template <typename T>
void decode_task_x8(const T* q, const T* k_cache, const T* v_cache, const TaskView& tv, T* out, float scale,
                    std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  switch (tv.head_dim / 8) {  // the common head sizes 64 and 128 get register-resident rows
    case 8: return task<T, 8>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    case 16: return task<T, 16>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    default: return task<T, 0>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
  }
}
#else
bool decode_task_x8_supported() { return false; }

template <typename T>
void decode_task_x8(const T*, const T*, const T*, const TaskView&, T*, float, std::vector<float>&,
                    std::vector<float>&, std::vector<float>&) {
  TORCH_CHECK(false, "decode_task_x8: not built (no AVX2, or AVX-512 present)");
}
#endif

template void decode_task_x8(const float*, const float*, const float*, const TaskView&, float*, float,
                             std::vector<float>&, std::vector<float>&, std::vector<float>&);
template void decode_task_x8(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, const TaskView&,
                             at::BFloat16*, float, std::vector<float>&, std::vector<float>&, std::vector<float>&);

}  // namespace stateserve_attention
