// Causal prefill attention over the paged cache for CPUs with AVX2 + FMA and no AVX-512 (prefill_attention.cpp
// runs it there), float32 and bfloat16 (widened to float32 as keys and values are read; every product and sum in
// float32). The AVX-512 task's passes with 8 lanes: a step takes up to 16 keys of one cache block, transposes them
// once (lane j = key j, so a row's scores are two vectors and need no horizontal sums) and reuses them for 32 query
// rows; an online softmax; P.V with each value row widened once per step.
// Why: PyTorch's CPU flash attention ran 32-61 GFLOP/s at 256-512 rows (12 heads of 64, 2 Zen 3 cores; this task
// 42-98), and for a chunk after cached context the engine copied the context out and called it twice. Past ~4096
// keys its blocked products lead (~120 vs ~100), so layers/attention.py sends longer sequences there.
#include "prefill_attention.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include "simd.h"

namespace stateserve_attention {

#if defined(STATESERVE_SIMD_AVX2)
namespace {
using stateserve_simd::exp_ps;
using stateserve_simd::first_lanes8;
using stateserve_simd::hmax8;
using stateserve_simd::hsum8;
using stateserve_simd::load8;

constexpr int kRows = 32;      // query rows per task
constexpr int kKeys = 16;      // keys per step: two vectors of scores per row
constexpr int kDotRows = 4;    // rows whose scores are accumulated together: 4 x 2 independent FMA chains
constexpr int kPvRows = 2;     // rows of P.V accumulated together ...
constexpr int kPvVectors = 4;  // ... over 32 of their output dimensions (8 accumulators)

// One task: query head h, rows [r0, r0 + kRows) of the chunk (row r at position ctx + r sees keys 0..ctx + r).
template <int D, typename T>
void task(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx,
          int64_t num_rows, int64_t r0, int64_t h, int64_t group, int64_t num_kv_heads, int64_t block_size,
          float scale, T* out, int64_t out_row_stride) {
  constexpr int NV = D / 8;
  const int64_t kh = h / group, head_stride = block_size * D, block_stride = num_kv_heads * head_stride;
  const int64_t rows = std::min<int64_t>(kRows, num_rows - r0);
  alignas(32) float qs[kRows][D];  // q * scale, rows past the chunk zero
  alignas(32) float o[kRows][D];
  alignas(32) float p[kRows][kKeys];
  alignas(32) float vf[kKeys][D];  // the step's n value rows in float32
  alignas(32) __m256 kt[2][D];     // the step's keys transposed: kt[j / 8][d] lane j % 8 = key j's dimension d
  float m[kRows], l[kRows], alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    const T* qr = q + (r0 + r) * q_row_stride + h * D;
    for (int d = 0; d < D; ++d) qs[r][d] = r < rows ? static_cast<float>(qr[d]) * scale : 0.f;
    std::fill(o[r], o[r] + D, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const int64_t end = ctx + r0 + rows;  // keys [0, end) are visible to some row of the task
  for (int64_t t0 = 0; t0 < end;) {
    const int64_t off = t0 % block_size;
    const int64_t n = std::min<int64_t>({kKeys, block_size - off, end - t0});
    const int64_t piece = table[t0 / block_size] * block_stride + kh * head_stride + off * D;
    const T *kr = k_cache + piece, *vr = v_cache + piece;
    for (int half = 0; half < 2; ++half) {
      if (half * 8 >= n) break;  // keys past n are never read back (their scores are masked below)
      for (int c = 0; c < D; c += 8) {
        __m256 r8[8];
        for (int j = 0; j < 8; ++j) {
          const int64_t key = half * 8 + j;
          r8[j] = key < n ? load8(kr + key * D + c) : _mm256_setzero_ps();
        }
        stateserve_simd::transpose8x8_ps(r8);
        for (int i = 0; i < 8; ++i) kt[half][c + i] = r8[i];
      }
    }
    for (int64_t j = 0; j < n; ++j)
      for (int c = 0; c < D; c += 8) _mm256_store_ps(vf[j] + c, load8(vr + j * D + c));
    const bool two = n > 8;  // the second vector of keys holds any
    for (int r = 0; r < kRows; r += kDotRows) {  // scores: kDotRows rows x 16 keys
      __m256 acc[kDotRows][2];
      for (int i = 0; i < kDotRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
      if (two) {
        for (int d = 0; d < D; ++d) {
          const __m256 k0 = kt[0][d], k1 = kt[1][d];
          for (int i = 0; i < kDotRows; ++i) {
            const __m256 qd = _mm256_broadcast_ss(&qs[r + i][d]);
            acc[i][0] = _mm256_fmadd_ps(qd, k0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qd, k1, acc[i][1]);
          }
        }
      } else {
        for (int d = 0; d < D; ++d)
          for (int i = 0; i < kDotRows; ++i)
            acc[i][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(&qs[r + i][d]), kt[0][d], acc[i][0]);
      }
      for (int i = 0; i < kDotRows; ++i) {
        _mm256_store_ps(p[r + i], acc[i][0]);
        _mm256_store_ps(p[r + i] + 8, acc[i][1]);
      }
    }
    const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < kRows; ++r) {  // online softmax: p[r] <- exp(s - new max), lanes the row does not see 0
      const int64_t visible = std::min<int64_t>(n, ctx + r0 + r - t0 + 1);
      if (visible <= 0) {
        alpha[r] = 1.f;
        _mm256_store_ps(p[r], _mm256_setzero_ps());
        _mm256_store_ps(p[r] + 8, _mm256_setzero_ps());
        continue;
      }
      const __m256 lanes0 = first_lanes8(visible), lanes1 = first_lanes8(visible - 8);
      const __m256 s0 = _mm256_load_ps(p[r]), s1 = _mm256_load_ps(p[r] + 8);
      const float step_max =
          hmax8(_mm256_max_ps(_mm256_blendv_ps(minus_inf, s0, lanes0), _mm256_blendv_ps(minus_inf, s1, lanes1)));
      const float m_new = std::max(m[r], step_max);
      const __m256 mv = _mm256_set1_ps(m_new);
      const __m256 e0 = _mm256_and_ps(exp_ps(_mm256_sub_ps(s0, mv)), lanes0);
      const __m256 e1 = visible > 8 ? _mm256_and_ps(exp_ps(_mm256_sub_ps(s1, mv)), lanes1) : _mm256_setzero_ps();
      alpha[r] = m_new == m[r] ? 1.f : std::exp(m[r] - m_new);  // 0 on the first step (m = -inf)
      l[r] = l[r] * alpha[r] + hsum8(_mm256_add_ps(e0, e1));
      m[r] = m_new;
      _mm256_store_ps(p[r], e0);
      _mm256_store_ps(p[r] + 8, e1);
    }
    for (int r = 0; r < kRows; r += kPvRows) {  // o = o * alpha + p . V, 2 rows x 32 dimensions at a time
      for (int c0 = 0; c0 < NV; c0 += kPvVectors) {
        __m256 acc[kPvRows][kPvVectors];
        for (int i = 0; i < kPvRows; ++i) {
          const __m256 a = _mm256_set1_ps(alpha[r + i]);
          for (int v = 0; v < kPvVectors; ++v) acc[i][v] = _mm256_mul_ps(_mm256_load_ps(o[r + i] + 8 * (c0 + v)), a);
        }
        for (int64_t j = 0; j < n; ++j) {
          __m256 vv[kPvVectors];
          for (int v = 0; v < kPvVectors; ++v) vv[v] = _mm256_load_ps(vf[j] + 8 * (c0 + v));
          for (int i = 0; i < kPvRows; ++i) {
            const __m256 pj = _mm256_broadcast_ss(&p[r + i][j]);
            for (int v = 0; v < kPvVectors; ++v) acc[i][v] = _mm256_fmadd_ps(pj, vv[v], acc[i][v]);
          }
        }
        for (int i = 0; i < kPvRows; ++i)
          for (int v = 0; v < kPvVectors; ++v) _mm256_store_ps(o[r + i] + 8 * (c0 + v), acc[i][v]);
      }
    }
    t0 += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (r0 + r) * out_row_stride + h * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r][d] * inv);
  }
}

}  // namespace

bool prefill_x8_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

template <typename T>
void prefill_x8(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t ctx, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                int64_t block_size, float scale, T* out) {
  const int64_t q_blocks = (num_rows + kRows - 1) / kRows, group = num_heads / num_kv_heads;
  const int64_t out_row_stride = num_heads * head_dim;
  at::parallel_for(0, num_heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / q_blocks, r0 = t % q_blocks * kRows;
      if (head_dim == 64)
        task<64>(q, q_row_stride, k_cache, v_cache, table, ctx, num_rows, r0, h, group, num_kv_heads, block_size,
                 scale, out, out_row_stride);
      else
        task<128>(q, q_row_stride, k_cache, v_cache, table, ctx, num_rows, r0, h, group, num_kv_heads, block_size,
                  scale, out, out_row_stride);
    }
  });
}
#else
bool prefill_x8_supported(int64_t) { return false; }

template <typename T>
void prefill_x8(const T*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                int64_t, float, T*) {
  TORCH_CHECK(false, "prefill_x8: not built (no AVX2, or AVX-512 present)");
}
#endif

template void prefill_x8(const float*, int64_t, const float*, const float*, const int64_t*, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, float, float*);
template void prefill_x8(const at::BFloat16*, int64_t, const at::BFloat16*, const at::BFloat16*, const int64_t*,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, at::BFloat16*);

}  // namespace stateserve_attention
