// Decode attention over the paged KV cache, reading K/V blocks in place (no gather copy).
// One task per sequence (or a share of its kv heads); the query heads of a GQA group share each K/V row read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "paged_attention.h"
#include "simd.h"

namespace {
using stateserve_attention::TaskView;
using stateserve_attention::prefetch_piece;
using stateserve_attention::walk_keys;
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
using stateserve_simd::load_row16;
using stateserve_simd::pair_index;

// scores: [nh, stride], the first len of each row valid -> softmax numerators exp(score - row max) in place (lanes
// past len masked out of the max and the sum); inv[i] = 1 / row i's sum.
inline void softmax_numerators(float* scores, int64_t nh, int64_t stride, int64_t len, float* inv) {
  auto lanes = [&](int64_t t0) {
    return len - t0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (len - t0)) - 1u);
  };
  for (int64_t i = 0; i < nh; ++i) {
    float* sg = scores + i * stride;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < len; t0 += 16) mv = _mm512_mask_max_ps(mv, lanes(t0), mv, _mm512_loadu_ps(sg + t0));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
      const __m512 e = _mm512_maskz_mov_ps(lanes(t0), exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sg + t0), m)));
      _mm512_storeu_ps(sg + t0, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[i] = 1.f / _mm512_reduce_add_ps(sum);
  }
}

// One task in float32 arithmetic (float32, float16, and bfloat16 without vdpbf16ps): head_dim = 16 * nv (NV > 0:
// known at compile time, so q and the accumulators stay in registers; NV == 0: nv at run time). Keys go 16 at a
// time within a block: each head reduces its 16 scores in one transpose-and-add tree, and the V pass keeps two
// accumulator sets (even/odd keys) so the FMA chains overlap. q: the task's first query head's row.
template <int NV, typename scalar_t>
void decode_task_avx512(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const TaskView& tv,
                        scalar_t* out, float scale, std::vector<float>& scores, std::vector<float>& qf,
                        std::vector<float>& acc) {
  const int64_t head_dim = tv.head_dim, nv = NV > 0 ? NV : head_dim / 16;
  const bool pairs = std::is_same_v<scalar_t, at::BFloat16> && nv % 2 == 0;
  const int64_t nh = tv.num_query_heads(), stride = tv.score_stride(), group = tv.group;
  scores.resize(nh * stride);
  qf.resize(nh * head_dim);
  acc.assign(nh * head_dim, 0.f);
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < head_dim; ++d)
      qf[i * head_dim + (pairs ? pair_index(d) : d)] = static_cast<float>(q[i * head_dim + d]) * scale;
  walk_keys(k_cache, tv, [&](int64_t t0, int64_t n, const scalar_t* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const scalar_t* k = rows + (tv.kh0 + i / group) * tv.head_stride;
      __m512 qv[16];
      for (int64_t v = 0; v < nv; ++v) qv[v] = _mm512_loadu_ps(qf.data() + i * head_dim + 16 * v);
      __m512 dots[16];
      for (int64_t j = 0; j < n; ++j, k += head_dim) {
        __m512 dot = _mm512_mul_ps(load_row16(k, 0, pairs), qv[0]);
        for (int64_t v = 1; v < nv; ++v) dot = _mm512_fmadd_ps(load_row16(k, v, pairs), qv[v], dot);
        dots[j] = dot;
      }
      for (int64_t j = n; j < 16; ++j) dots[j] = _mm512_setzero_ps();
      _mm512_storeu_ps(scores.data() + i * stride + t0, stateserve_simd::reduce16_ps(dots));
    }
  });
  float inv[256];  // nh <= num_heads <= 256: checked by the caller
  softmax_numerators(scores.data(), nh, stride, tv.len, inv);
  walk_keys(v_cache, tv, [&](int64_t t0, int64_t n, const scalar_t* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const scalar_t* vr = rows + (tv.kh0 + i / group) * tv.head_stride;
      const float* p = scores.data() + i * stride + t0;
      float* a = acc.data() + i * head_dim;
      __m512 acc0[16], acc1[16];
      for (int64_t v = 0; v < nv; ++v) acc0[v] = _mm512_loadu_ps(a + 16 * v), acc1[v] = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 1 < n; j += 2) {
        const scalar_t *v0 = vr + j * head_dim, *v1 = v0 + head_dim;
        const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
        for (int64_t v = 0; v < nv; ++v) {
          acc0[v] = _mm512_fmadd_ps(p0, load_row16(v0, v, pairs), acc0[v]);
          acc1[v] = _mm512_fmadd_ps(p1, load_row16(v1, v, pairs), acc1[v]);
        }
      }
      if (j < n) {
        const scalar_t* v0 = vr + j * head_dim;
        const __m512 p0 = _mm512_set1_ps(p[j]);
        for (int64_t v = 0; v < nv; ++v) acc0[v] = _mm512_fmadd_ps(p0, load_row16(v0, v, pairs), acc0[v]);
      }
      for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(a + 16 * v, _mm512_add_ps(acc0[v], acc1[v]));
    }
  });
  for (int64_t i = 0; i < nh; ++i) {
    scalar_t* o = out + i * head_dim;
    const float* a = acc.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(a[pairs ? pair_index(d) : d] * inv[i]);
  }
}

#if defined(__AVX512BF16__)
// Where element d of a 32-element chunk lands after _mm512_unpack{lo,hi}_epi16 of two rows: the low result's
// 32-bit lane l holds element 8 (l / 4) + l % 4, the high result's element 8 (l / 4) + 4 + l % 4.
inline int64_t unpacked_index(int64_t d) {
  const int64_t r = d % 32, lane = r / 8, w = r % 8;
  return d / 32 * 32 + (w < 4 ? 0 : 16) + 4 * lane + w % 4;
}

// One task in bfloat16 with head_dim = 32 * nc (NC > 0: known at compile time): both products on vdpbf16ps, two
// multiply-adds per lane and instruction and no conversion of the cache's rows (the float32 path spends two
// conversions and two FMAs where this spends one instruction, and was compute-bound where float32 was not). Scores
// from q's raw bfloat16 pairs against each key row, scaled afterwards; P.V from probabilities rounded to bfloat16
// (as the prefill kernel, flash attention and transformers' eager bfloat16 attention do) against pairs of value
// rows interleaved by _mm512_unpack{lo,hi}_epi16, whose lane order `unpacked_index` undoes at the output.
template <int NC>
void decode_task_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                      const TaskView& tv, at::BFloat16* out, float scale, std::vector<float>& scores,
                      std::vector<float>& acc) {
  const int64_t head_dim = tv.head_dim, nc = NC > 0 ? NC : head_dim / 32;
  const int64_t nh = tv.num_query_heads(), stride = tv.score_stride(), group = tv.group;
  scores.resize(nh * stride);
  acc.assign(nh * head_dim, 0.f);
  const __m512 scale_v = _mm512_set1_ps(scale);
  walk_keys(k_cache, tv, [&](int64_t t0, int64_t n, const at::BFloat16* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const at::BFloat16* k = rows + (tv.kh0 + i / group) * tv.head_stride;
      __m512bh qv[8];
      for (int64_t c = 0; c < nc; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + i * head_dim + 32 * c);
      __m512 dots[16];
      for (int64_t j = 0; j < n; ++j, k += head_dim) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(k), qv[0]);
        for (int64_t c = 1; c < nc; ++c)
          dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(k + 32 * c), qv[c]);
        dots[j] = dot;
      }
      for (int64_t j = n; j < 16; ++j) dots[j] = _mm512_setzero_ps();
      _mm512_storeu_ps(scores.data() + i * stride + t0, _mm512_mul_ps(stateserve_simd::reduce16_ps(dots), scale_v));
    }
  });
  float inv[256];  // nh <= num_heads <= 256: checked by the caller
  softmax_numerators(scores.data(), nh, stride, tv.len, inv);
  walk_keys(v_cache, tv, [&](int64_t t0, int64_t n, const at::BFloat16* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const at::BFloat16* vr = rows + (tv.kh0 + i / group) * tv.head_stride;
      alignas(32) int32_t pw[8];  // pw[m] = (p[2m], p[2m + 1]) as bfloat16, the first in the low half
      _mm256_store_si256(reinterpret_cast<__m256i*>(pw),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores.data() + i * stride + t0)));
      float* a = acc.data() + i * head_dim;
      __m512 lo[8], hi[8];
      for (int64_t c = 0; c < nc; ++c) lo[c] = _mm512_loadu_ps(a + 32 * c), hi[c] = _mm512_loadu_ps(a + 32 * c + 16);
      for (int64_t j = 0; j < n; j += 2) {
        const __m512bh pm = (__m512bh)_mm512_set1_epi32(pw[j / 2]);
        const at::BFloat16 *v0 = vr + j * head_dim, *v1 = v0 + head_dim;
        for (int64_t c = 0; c < nc; ++c) {
          // the row after the group's last is zeros, not the cache's next row (whose bits may be NaN)
          const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
          const __m512i y = j + 1 < n ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
          lo[c] = _mm512_dpbf16_ps(lo[c], (__m512bh)_mm512_unpacklo_epi16(x, y), pm);
          hi[c] = _mm512_dpbf16_ps(hi[c], (__m512bh)_mm512_unpackhi_epi16(x, y), pm);
        }
      }
      for (int64_t c = 0; c < nc; ++c) _mm512_storeu_ps(a + 32 * c, lo[c]), _mm512_storeu_ps(a + 32 * c + 16, hi[c]);
    }
  });
  for (int64_t i = 0; i < nh; ++i) {
    at::BFloat16* o = out + i * head_dim;
    const float* a = acc.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<at::BFloat16>(a[unpacked_index(d)] * inv[i]);
  }
}
#endif

// Runs one task through the fastest variant for its dtype and head size. q: the task's first query head's row;
// out: where that head's output goes.
template <typename scalar_t>
void decode_task_dispatch(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const TaskView& tv,
                          scalar_t* out, float scale, std::vector<float>& scores, std::vector<float>& qf,
                          std::vector<float>& acc) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (tv.head_dim % 32 == 0) {
      if (tv.head_dim == 64) return decode_task_bf16<2>(q, k_cache, v_cache, tv, out, scale, scores, acc);
      if (tv.head_dim == 128) return decode_task_bf16<4>(q, k_cache, v_cache, tv, out, scale, scores, acc);
      return decode_task_bf16<0>(q, k_cache, v_cache, tv, out, scale, scores, acc);
    }
  }
#endif
  switch (tv.head_dim / 16) {  // the common head sizes 64 and 128 get register-resident rows
    case 4: return decode_task_avx512<4>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    case 8: return decode_task_avx512<8>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    default: return decode_task_avx512<0>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
  }
}
#endif

// Splits tasks [0, num_tasks) into `parts` consecutive runs of about equal cost (cost(task): its keys): bounds[p] to
// bounds[p + 1] is run p. In serving, sequences' lengths differ up to ~20x, and splitting by count left one thread
// waiting on the other for a tenth of some steps.
template <typename Cost>
std::vector<int64_t> balanced_bounds(int64_t num_tasks, int64_t parts, Cost&& cost) {
  int64_t total = 0;
  for (int64_t t = 0; t < num_tasks; ++t) total += cost(t);
  std::vector<int64_t> bounds(parts + 1, num_tasks);
  bounds[0] = 0;
  int64_t done = 0, part = 1;
  for (int64_t t = 0; t < num_tasks && part < parts; ++t) {
    done += cost(t);
    while (part < parts && done * parts >= part * total) bounds[part++] = t + 1;  // run `part` starts after t
  }
  return bounds;
}
}  // namespace

template <typename scalar_t>
static void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                          const int64_t* block_tables, const int64_t* seq_lens, scalar_t* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
#if defined(__AVX512F__)
  const bool vector_task = head_dim % 16 == 0;
#else  // the AVX2 task, in builds that have it (float16 and no-SIMD builds: the portable loop below)
  constexpr bool kHasTask = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>;
  const bool vector_task = kHasTask && head_dim % 8 == 0 && stateserve_attention::decode_task_x8_supported();
#endif
  if (vector_task && head_dim <= 256 && num_heads <= 256) {
    // A task is a sequence's kv heads, split only when there are too few sequences to keep every thread busy.
    const int64_t threads = at::get_num_threads();
    const int64_t splits = std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
    const int64_t heads_per_task = (num_kv_heads + splits - 1) / splits;
    const int64_t head_stride = block_size * head_dim;
    auto first_head = [&](int64_t task) { return (task % splits) * heads_per_task; };  // the task's kv heads:
    auto end_head = [&](int64_t task) { return std::min(num_kv_heads, first_head(task) + heads_per_task); };  // [,)
    const std::vector<int64_t> bounds = balanced_bounds(num_seqs * splits, threads, [&](int64_t task) {
      return (seq_lens[task / splits] + 16) * std::max<int64_t>(0, end_head(task) - first_head(task));
    });
    at::parallel_for(0, threads, 1, [&](int64_t part_begin, int64_t part_end) {
      std::vector<float> scores, qf, acc;
      for (int64_t task = bounds[part_begin]; task < bounds[part_end]; ++task) {
        const int64_t s = task / splits, kh0 = first_head(task), kh1 = end_head(task);
        if (kh0 >= kh1) continue;
        const TaskView tv{block_tables + s * max_blocks, seq_lens[s], kh0, kh1, group, head_dim, block_size,
                          head_stride, num_kv_heads * head_stride,
                          head_stride * static_cast<int64_t>(sizeof(scalar_t))};
        const int64_t first = (s * num_heads + kh0 * group) * head_dim;  // the task's first query head
#if defined(__AVX512F__)
        decode_task_dispatch(q + first, k_cache, v_cache, tv, out + first, scale, scores, qf, acc);
#else
        if constexpr (kHasTask)
          stateserve_attention::decode_task_x8(q + first, k_cache, v_cache, tv, out + first, scale, scores, qf, acc);
#endif
      }
    });
    return;
  }
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
        const scalar_t* k = k_cache + ((table[t / block_size] * num_kv_heads + kh) * block_size + t % block_size) * head_dim;
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
        const scalar_t* v = v_cache + ((table[t / block_size] * num_kv_heads + kh) * block_size + t % block_size) * head_dim;
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

// q: [S, H, D]; k_cache, v_cache: [num_blocks, KH, block_size, D]; block_tables: [S, max_blocks] int64;
// seq_lens: [S] int64 (each >= 1). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KH = k_cache.size(1), bs = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            S, H, KH, D, bs, tables.size(1), static_cast<float>(scale));
  });
  return out;
}

// Writes new keys and values into their cache rows. k, v: [T, KH, D] in the cache's dtype; slots: [T] int64
// (block * block_size + offset); caches [num_blocks, KH, block_size, D], so each head's row is its own copy.
void write_kv_cache(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "write_kv_cache: tensors must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "write_kv_cache: k/v dtype differs from the cache's");
  TORCH_CHECK(k_cache.dim() == 4 && k.dim() == 3 && k.sizes() == v.sizes() && k_cache.sizes() == v_cache.sizes() &&
              k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3), "write_kv_cache: shapes do not match");
  auto slot_t = slots.to(torch::kInt64).contiguous();
  TORCH_CHECK(slot_t.numel() == k.size(0), "write_kv_cache: one slot per token");
  const int64_t T = k.size(0), KH = k_cache.size(1), bs = k_cache.size(2), D = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * bs, elem = k.element_size(), row_bytes = D * elem;
  const int64_t* slot = slot_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv_cache: slot ", slot[t], " outside the cache");
  const char *ks = static_cast<const char*>(k.data_ptr()), *vs = static_cast<const char*>(v.data_ptr());
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slot[t] / bs, offset = slot[t] % bs;
      for (int64_t h = 0; h < KH; ++h) {
        const int64_t dst = ((block * KH + h) * bs + offset) * row_bytes, src = (t * KH + h) * row_bytes;
        std::memcpy(kc + dst, ks + src, row_bytes);
        std::memcpy(vc + dst, vs + src, row_bytes);
      }
    }
  };
  if (T * KH * row_bytes < (1 << 18)) body(0, T);  // a decode step's few rows: less than forking the team
  else at::parallel_for(0, T, 16, body);
}
