// Decode attention over the paged KV cache, reading K/V blocks in place (no gather copy).
// One task per (sequence, kv head); the query heads of a GQA group share each K/V row read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
// 16 consecutive elements as float32 lanes.
template <typename T>
inline __m512 load16(const T* p) {  // any other dtype (double): element by element
  alignas(64) float tmp[16];
  for (int j = 0; j < 16; ++j) tmp[j] = static_cast<float>(p[j]);
  return _mm512_load_ps(tmp);
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// head_dim a multiple of 16 and at most 256: q and the accumulators live in registers as 16-lane vectors;
// each K row costs D/16 FMAs and one horizontal sum per query head, each V row D/16 FMAs per query head.
template <typename scalar_t>
void decode_task_avx512(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                        int64_t len, scalar_t* out, int64_t s, int64_t kh, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t block_size, int64_t group, float scale, std::vector<float>& scores,
                        std::vector<float>& acc) {
  const int64_t nv = head_dim / 16;
  scores.resize(group * len);
  acc.assign(group * head_dim, 0.f);
  std::vector<float> qf(group * head_dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_dim; ++d)
      qf[g * head_dim + d] = static_cast<float>(q[(s * num_heads + kh * group + g) * head_dim + d]) * scale;
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* k = k_cache + ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + kh) * head_dim;
    __m512 kv[16];
    for (int64_t i = 0; i < nv; ++i) kv[i] = load16(k + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      __m512 dot = _mm512_mul_ps(kv[0], _mm512_loadu_ps(qg));
      for (int64_t i = 1; i < nv; ++i) dot = _mm512_fmadd_ps(kv[i], _mm512_loadu_ps(qg + 16 * i), dot);
      scores[g * len + t] = _mm512_reduce_add_ps(dot);
    }
  }
  const std::vector<float> denom = exp_scores_(scores.data(), group, len);
  for (int64_t g = 0; g < group; ++g) {
    __m512 av[16];
    for (int64_t i = 0; i < nv; ++i) av[i] = _mm512_setzero_ps();
    const float* sg = scores.data() + g * len;
    for (int64_t t = 0; t < len; ++t) {
      const scalar_t* v = v_cache + ((table[t / block_size] * block_size + t % block_size) * num_kv_heads + kh) * head_dim;
      const __m512 p = _mm512_set1_ps(sg[t]);
      for (int64_t i = 0; i < nv; ++i) av[i] = _mm512_fmadd_ps(p, load16(v + 16 * i), av[i]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / denom[g]);
    scalar_t* o = out + (s * num_heads + kh * group + g) * head_dim;
    for (int64_t i = 0; i < nv; ++i) {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, _mm512_mul_ps(av[i], inv));
      for (int j = 0; j < 16; ++j) o[16 * i + j] = static_cast<scalar_t>(tmp[j]);
    }
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
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kh = task % num_kv_heads;
      const int64_t len = seq_lens[s];
#if defined(__AVX512F__)
      if (head_dim % 16 == 0 && head_dim <= 256) {
        decode_task_avx512(q, k_cache, v_cache, block_tables + s * max_blocks, len, out, s, kh, num_heads,
                           num_kv_heads, head_dim, block_size, group, scale, scores, acc);
        continue;
      }
#endif
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
