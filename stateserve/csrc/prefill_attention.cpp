// Causal attention of a prompt chunk over the paged KV cache (its own keys already written there), on CPU.
// PyTorch's CPU flash kernel reaches only ~50-100 GFLOP/s at these sizes in bfloat16 (it runs its products through
// float32 sgemm) and needs the context gathered and transposed first; this one reads the cache's blocks in place.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include "simd.h"

#if defined(__AVX512F__)
namespace {
using stateserve_simd::exp_ps;
using stateserve_simd::load_row16;
using stateserve_simd::pair_index;

constexpr int kRows = 16;  // query rows per task
constexpr int kKeys = 16;  // keys per step: one vector of scores per row

// One task: query head h, rows [r0, r0 + 16) of the chunk (row r at position ctx + r sees keys 0..ctx + r).
// Online softmax over steps of up to 16 keys within a cache block: scores as one vector per row (16 dot products
// reduced by one transpose-and-add tree), then P.V with the value rows shared by R query rows at a time, so R x NV
// accumulators stay in registers. q, o and the value rows are in bfloat16 pair order (see simd.h).
template <int NV, typename scalar_t>
void prefill_task(const scalar_t* q, int64_t q_row_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int64_t* table, int64_t ctx, int64_t num_rows, int64_t r0, int64_t h, int64_t group,
                  int64_t num_kv_heads, int64_t block_size, float scale, scalar_t* out, int64_t out_row_stride) {
  constexpr int64_t D = 16 * NV;
  constexpr int R = NV >= 16 ? 1 : 16 / NV;
  constexpr bool pairs = std::is_same_v<scalar_t, at::BFloat16> && NV % 2 == 0;
  const int64_t kh = h / group, head_stride = block_size * D, block_stride = num_kv_heads * head_stride;
  const int64_t rows = std::min<int64_t>(kRows, num_rows - r0);
  alignas(64) float qs[kRows][D];  // q * scale, rows past the chunk 0
  alignas(64) float o[kRows][D];
  alignas(64) float p[kRows][kKeys];
  float m[kRows], l[kRows], alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int64_t d = 0; d < D; ++d) {
      qs[r][pairs ? pair_index(d) : d] = r < rows ? static_cast<float>(q[(r0 + r) * q_row_stride + h * D + d]) * scale : 0.f;
      o[r][d] = 0.f;
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const int64_t end = ctx + r0 + rows;  // keys [0, end) are visible to some row of the task
  for (int64_t t0 = 0; t0 < end;) {
    const int64_t off = t0 % block_size;
    const int64_t n = std::min<int64_t>({kKeys, block_size - off, end - t0});
    const int64_t piece = table[t0 / block_size] * block_stride + kh * head_stride + off * D;
    const scalar_t *kr = k_cache + piece, *vr = v_cache + piece;
    for (int r = 0; r < kRows; ++r) {
      const int64_t visible = std::min<int64_t>(n, ctx + r0 + r - t0 + 1);  // keys of this step row r sees
      if (visible <= 0) {
        alpha[r] = 1.f;
        _mm512_storeu_ps(p[r], _mm512_setzero_ps());
        continue;
      }
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_load_ps(qs[r] + 16 * v);
      __m512 dots[kKeys];
      for (int64_t j = 0; j < kKeys; ++j) {
        if (j >= visible) { dots[j] = _mm512_setzero_ps(); continue; }
        const scalar_t* k = kr + j * D;
        __m512 dot = _mm512_mul_ps(load_row16(k, 0, pairs), qv[0]);
        for (int v = 1; v < NV; ++v) dot = _mm512_fmadd_ps(load_row16(k, v, pairs), qv[v], dot);
        dots[j] = dot;
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << visible) - 1u);
      const __m512 s = stateserve_simd::reduce16_ps(dots);
      const float m_new = std::max(m[r], _mm512_mask_reduce_max_ps(lanes, s));
      const __m512 e = _mm512_maskz_mov_ps(lanes, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      alpha[r] = std::exp(m[r] - m_new);  // 0 on the first step (m = -inf)
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
      m[r] = m_new;
      _mm512_storeu_ps(p[r], e);
    }
    for (int r = 0; r < kRows; r += R) {
      __m512 acc[R][NV];
      for (int i = 0; i < R; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[r + i]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_load_ps(o[r + i] + 16 * v), a);
      }
      for (int64_t j = 0; j < n; ++j) {
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = load_row16(vr + j * D, v, pairs);
        for (int i = 0; i < R; ++i) {
          const __m512 pj = _mm512_set1_ps(p[r + i][j]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(pj, vv[v], acc[i][v]);
        }
      }
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < NV; ++v) _mm512_store_ps(o[r + i] + 16 * v, acc[i][v]);
    }
    t0 += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out + (r0 + r) * out_row_stride + h * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[r][pairs ? pair_index(d) : d] * inv);
  }
}
}  // namespace
#endif

bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512F__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 64 || head_dim == 128);
#else
  return false;
#endif
}

// q: [Lq, H, D] (rows may be strided, heads and dims contiguous); k_cache, v_cache: [num_blocks, KH, block_size,
// D] holding keys 0..ctx + Lq - 1 of the sequence; block_table: its blocks, int64. Returns [Lq, H, D].
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill_attention: q layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.scalar_type() == k_cache.scalar_type(),
              "paged_prefill_attention: caches must be contiguous and of q's dtype");
  const int64_t Lq = q.size(0), H = q.size(1), D = q.size(2), KH = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(prefill_attention_supported(q.scalar_type(), D) && k_cache.size(3) == D && H % KH == 0,
              "paged_prefill_attention: unsupported dtype or shape");
  auto table = block_table.to(torch::kInt64).contiguous();
  TORCH_CHECK(table.numel() * bs >= ctx + Lq, "paged_prefill_attention: block table shorter than the sequence");
  auto out = torch::empty({Lq, H, D}, q.options());
#if defined(__AVX512F__)
  const int64_t num_tasks = H * ((Lq + kRows - 1) / kRows);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_prefill_attention", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t* tp = table.data_ptr<int64_t>();
    const int64_t q_blocks = (Lq + kRows - 1) / kRows;
    at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / q_blocks, r0 = task % q_blocks * kRows;
        if (D == 64)
          prefill_task<4>(qp, q.stride(0), kc, vc, tp, ctx, Lq, r0, h, H / KH, KH, bs, float(scale), op, H * D);
        else
          prefill_task<8>(qp, q.stride(0), kc, vc, tp, ctx, Lq, r0, h, H / KH, KH, bs, float(scale), op, H * D);
      }
    });
  });
#endif
  return out;
}
