// Decode attention over the paged KV cache, reading K/V blocks in place (no gather copy).
// One task per (sequence, kv head); the query heads of a GQA group share each K/V row read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#include "simd.h"

namespace {
// scores: [group, len] -> exp(score - row max) in place; returns each row's sum (the softmax denominators).
std::vector<float> exp_scores_(float* scores, int64_t group, int64_t len) {
  std::vector<float> denom(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    denom[g] = sum;
  }
  return denom;
}

#if defined(__AVX512F__)
using stateserve_simd::exp_ps;
using stateserve_simd::load16;

// One task: kv heads [kh0, kh1) of one sequence (their query heads: `group` per kv head), head_dim = 16 * nv
// (NV > 0: known at compile time, so q and the accumulators stay in registers; NV == 0: nv at run time). Keys
// are taken 16 at a time, walked block by block with running (block, offset) counters: their rows, every head of
// the task side by side, are read from memory once and then served from L1 to each head in turn. Each head
// reduces its 16 scores in one transpose-and-add tree, the softmax is vectorised, and the V pass keeps two
// accumulator sets (even/odd keys) so the FMA chains overlap.
template <int NV, typename scalar_t>
void decode_task_avx512(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                        int64_t len, scalar_t* out, int64_t s, int64_t kh0, int64_t kh1, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t group, float scale,
                        std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
  const int64_t nv = NV > 0 ? NV : head_dim / 16;
  const int64_t row_stride = num_kv_heads * head_dim, block_stride = block_size * row_stride;
  const int64_t padded = (len + 15) / 16 * 16;
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;  // the task's query heads
  scores.resize(nh * padded);
  qf.resize(nh * head_dim);
  acc.assign(nh * head_dim, 0.f);
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < head_dim; ++d)
      qf[i * head_dim + d] = static_cast<float>(q[(s * num_heads + h0 + i) * head_dim + d]) * scale;
  const scalar_t* rows[16];
  auto gather_rows = [&](const scalar_t* cache, int64_t n, int64_t& block, int64_t& offset) {
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = cache + table[block] * block_stride + offset * row_stride;
      if (++offset == block_size) offset = 0, ++block;
    }
  };
  int64_t block = 0, offset = 0;
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    gather_rows(k_cache, n, block, offset);
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t kv_offset = (kh0 + i / group) * head_dim;
      __m512 qv[16];
      for (int64_t v = 0; v < nv; ++v) qv[v] = _mm512_loadu_ps(qf.data() + i * head_dim + 16 * v);
      __m512 dots[16];
      for (int64_t j = 0; j < n; ++j) {
        const scalar_t* k = rows[j] + kv_offset;
        __m512 dot = _mm512_mul_ps(load16(k), qv[0]);
        for (int64_t v = 1; v < nv; ++v) dot = _mm512_fmadd_ps(load16(k + 16 * v), qv[v], dot);
        dots[j] = dot;
      }
      for (int64_t j = n; j < 16; ++j) dots[j] = _mm512_setzero_ps();
      _mm512_storeu_ps(scores.data() + i * padded + t0, stateserve_simd::reduce16_ps(dots));
    }
  }
  // softmax numerators in place, per head; lanes past len are masked out of the max and the sum
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - (padded - 16))) - 1u);
  float inv[256];  // nh <= num_heads <= 256: checked by the caller
  for (int64_t i = 0; i < nh; ++i) {
    float* sg = scores.data() + i * padded;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < padded; t0 += 16)
      mv = _mm512_mask_max_ps(mv, t0 + 16 < padded ? __mmask16(0xFFFF) : tail, mv, _mm512_loadu_ps(sg + t0));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < padded; t0 += 16) {
      const __mmask16 lanes = t0 + 16 < padded ? __mmask16(0xFFFF) : tail;
      const __m512 e = _mm512_maskz_mov_ps(lanes, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), m)));
      _mm512_storeu_ps(sg + t0, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[i] = 1.f / _mm512_reduce_add_ps(sum);
  }
  block = offset = 0;
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    gather_rows(v_cache, n, block, offset);
    for (int64_t i = 0; i < nh; ++i) {
      const int64_t kv_offset = (kh0 + i / group) * head_dim;
      const float* p = scores.data() + i * padded + t0;
      float* a = acc.data() + i * head_dim;
      __m512 acc0[16], acc1[16];
      for (int64_t v = 0; v < nv; ++v) acc0[v] = _mm512_loadu_ps(a + 16 * v), acc1[v] = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 1 < n; j += 2) {
        const scalar_t *v0 = rows[j] + kv_offset, *v1 = rows[j + 1] + kv_offset;
        const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
        for (int64_t v = 0; v < nv; ++v) {
          acc0[v] = _mm512_fmadd_ps(p0, load16(v0 + 16 * v), acc0[v]);
          acc1[v] = _mm512_fmadd_ps(p1, load16(v1 + 16 * v), acc1[v]);
        }
      }
      if (j < n) {
        const scalar_t* v0 = rows[j] + kv_offset;
        const __m512 p0 = _mm512_set1_ps(p[j]);
        for (int64_t v = 0; v < nv; ++v) acc0[v] = _mm512_fmadd_ps(p0, load16(v0 + 16 * v), acc0[v]);
      }
      for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(a + 16 * v, _mm512_add_ps(acc0[v], acc1[v]));
    }
  }
  for (int64_t i = 0; i < nh; ++i) {
    scalar_t* o = out + (s * num_heads + h0 + i) * head_dim;
    const float* a = acc.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(a[d] * inv[i]);
  }
}

template <typename scalar_t>
void decode_task_avx512_dispatch(int64_t nv, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                                 const int64_t* table, int64_t len, scalar_t* out, int64_t s, int64_t kh0,
                                 int64_t kh1, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, int64_t group, float scale, std::vector<float>& scores,
                                 std::vector<float>& qf, std::vector<float>& acc) {
  switch (nv) {  // the common head sizes 64 and 128 get register-resident rows
    case 4:
      return decode_task_avx512<4>(q, k_cache, v_cache, table, len, out, s, kh0, kh1, num_heads, num_kv_heads,
                                   head_dim, block_size, group, scale, scores, qf, acc);
    case 8:
      return decode_task_avx512<8>(q, k_cache, v_cache, table, len, out, s, kh0, kh1, num_heads, num_kv_heads,
                                   head_dim, block_size, group, scale, scores, qf, acc);
    default:
      return decode_task_avx512<0>(q, k_cache, v_cache, table, len, out, s, kh0, kh1, num_heads, num_kv_heads,
                                   head_dim, block_size, group, scale, scores, qf, acc);
  }
}
#endif
}  // namespace

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
#if defined(__AVX512F__)
  if (head_dim % 16 == 0 && head_dim <= 256 && num_heads <= 256) {
    // A task is a sequence's kv heads, split only when there are too few sequences to keep every thread busy.
    const int64_t threads = at::get_num_threads();
    const int64_t splits = std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
    const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    at::parallel_for(0, num_seqs * splits, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / splits, kh0 = (task % splits) * heads_per_task;
        const int64_t kh1 = std::min(num_kv_heads, kh0 + heads_per_task);
        if (kh0 >= kh1) continue;
        decode_task_avx512_dispatch(head_dim / 16, q, k_cache, v_cache, block_tables + s * max_blocks, seq_lens[s],
                                    out, s, kh0, kh1, num_heads, num_kv_heads, head_dim, block_size, group, scale,
                                    scores, qf, acc);
      }
    });
    return;
  }
#endif
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;
      const int64_t len = seq_lens[s];
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = static_cast<float>(q[(s * num_heads + kh * group + g) * head_dim + d]) * scale;
      const int64_t* table = block_tables + s * max_blocks;
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* k = k_cache + ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + kh) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
          scores[g * len + t] = dot;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const std::vector<float> denom = exp_scores_(scores.data(), group, len);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* v = v_cache + ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + kh) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(s * num_heads + kh * group + g) * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d] / denom[g]);
    }
  });
}

// q: [S, H, D]; k_cache, v_cache: [num_blocks, block_size, KH, D]; block_tables: [S, max_blocks] int64;
// seq_lens: [S] int64 (each >= 1). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), KH = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            S, H, KH, D, bs, tables.size(1), static_cast<float>(scale));
  });
  return out;
}
