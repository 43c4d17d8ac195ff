// Decode attention over the paged KV cache, reading K/V blocks in place (no gather copy).
// One task per sequence (or a share of its kv heads); the query heads of a GQA group share each K/V row read. The
// vector task is written once over the build's float32 vector (16 lanes with AVX-512, 8 with AVX2); AVX-512 + BF16
// adds one on vdpbf16ps for bfloat16; builds without vectors, and dtypes the vector loads do not take, run a loop.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <xmmintrin.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "kernels.h"
#include "simd.h"

namespace {

// Where a task reads: kv heads [kh0, kh1) of one sequence of `len` keys, whose blocks `table` lists, in a cache laid
// out [num_blocks, num_kv_heads, block_size, head_dim]: one head's keys of a block are one contiguous piece.
struct TaskView {
  const int64_t* table;
  int64_t len, kh0, kh1, group, head_dim, block_size, head_stride, block_stride, piece_bytes;
  int64_t num_query_heads() const { return (kh1 - kh0) * group; }
  int64_t score_stride() const { return len + 16; }  // per head: room for a full 16-lane store at any key
};

// Visits the keys of one cache in groups of at most 16 within a block: fn(t0, n, rows, next) with rows pointing at
// key t0 of kv head 0 (kv head h: + h * head_stride), and next at the following block on a block's first group
// (else null), for fn to prefetch that block's piece of each head as it takes the head: spread out like that, the
// prefetches measured 7-25% faster than issuing the whole block's at once.
template <typename scalar_t, typename Fn>
inline void walk_keys(const scalar_t* cache, const TaskView& tv, Fn&& fn) {
  const int64_t num_blocks = (tv.len + tv.block_size - 1) / tv.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const scalar_t* base = cache + tv.table[b] * tv.block_stride;
    const char* next =
        b + 1 < num_blocks ? reinterpret_cast<const char*>(cache + tv.table[b + 1] * tv.block_stride) : nullptr;
    const int64_t keys = std::min(tv.block_size, tv.len - b * tv.block_size);
    for (int64_t o = 0; o < keys; o += 16)
      fn(b * tv.block_size + o, std::min<int64_t>(16, keys - o), base + o * tv.head_dim, o == 0 ? next : nullptr);
  }
}

// kv head kv's piece of the next block, into L2 (into L1 it evicts what is being computed; without it a pass
// waits on every piece).
inline void prefetch_piece(const char* next, int64_t kv, const TaskView& tv) {
  if (next == nullptr) return;
  for (int64_t x = 0; x < tv.piece_bytes; x += 64) _mm_prefetch(next + kv * tv.piece_bytes + x, _MM_HINT_T1);
}

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

#if SS_HAS_SIMD
using stateserve_simd::F32Vec;
using stateserve_simd::VecF;
using stateserve_simd::exp_ps;

// What the vector task does differently with each width, tuned on each, the rest written once below.
#if SS_HAS_AVX512
struct Tuning {
  // the V pass keeps two accumulator sets (even and odd keys) so that the FMA chains overlap
  static constexpr int kPvChains = 2;
  static float sum(VecF v) { return _mm512_reduce_add_ps(v); }  // of the softmax's numerators
  // bfloat16 rows of an even number of vectors are read as pairs (simd_avx512.h): no cross-lane shuffle
  template <typename T>
  static bool pairs(int64_t nv) { return std::is_same_v<T, at::BFloat16> && nv % 2 == 0; }
  template <typename T>
  static VecF load_row(const T* row, int64_t v, bool pairs) { return stateserve_simd::load_row16(row, v, pairs); }
  static int64_t lane_of(int64_t d, bool pairs) { return pairs ? stateserve_simd::pair_index(d) : d; }
};
#else
struct Tuning {
  static constexpr int kPvChains = 1;  // one chain per 8 columns: nv chains a key already
  static float sum(VecF v) {  // lane by lane
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    float total = 0.f;
    for (const float x : lanes) total += x;
    return total;
  }
  template <typename T>
  static bool pairs(int64_t) { return false; }
  template <typename T>
  static VecF load_row(const T* row, int64_t v, bool) { return F32Vec::load_from(row + 8 * v); }
  static int64_t lane_of(int64_t d, bool) { return d; }
};
#endif

// scores: [nh, stride], the first len of each row valid -> softmax numerators exp(score - row max) in place (lanes
// past len masked out of the max and the sum, and stored as 0: the stride leaves room for whole vectors);
// inv[i] = 1 / row i's sum.
inline void softmax_numerators(float* scores, int64_t nh, int64_t stride, int64_t len, float* inv) {
  using V = F32Vec;
  constexpr int W = V::kWidth;
  const VecF minus_inf = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < nh; ++i) {
    float* sg = scores + i * stride;
    VecF mv = minus_inf;
    for (int64_t t0 = 0; t0 < len; t0 += W)
      mv = V::max(mv, V::select(V::first(len - t0), V::load(sg + t0), minus_inf));
    const VecF m = V::set1(V::hmax(mv));
    VecF sum = V::zero();
    for (int64_t t0 = 0; t0 < len; t0 += W) {
      const VecF e = V::keep(V::first(len - t0), exp_ps(V::sub(V::load(sg + t0), m)));
      V::store(sg + t0, e);
      sum = V::add(sum, e);
    }
    inv[i] = 1.f / Tuning::sum(sum);
  }
}

// One task in float32 arithmetic (float32, and other dtypes the vector loads take, widened as loaded): head_dim =
// W * nv for the build's W lanes (NV > 0: known at compile time, so q and the accumulators stay in registers; NV ==
// 0: nv at run time). Keys go up to 16 at a time within a block: each head reduces W scores in one transpose-and-add
// tree, and the V pass runs Tuning::kPvChains accumulator sets over alternate keys. q: the task's first query
// head's row. Not inlined: inlined into the parallel region, the 8-lane head-64 task ran ~20% slower.
template <int NV, typename T>
__attribute__((noinline)) void decode_task(const T* q, const T* k_cache, const T* v_cache, const TaskView& tv,
                                           T* out, float scale, std::vector<float>& scores, std::vector<float>& qf,
                                           std::vector<float>& acc) {
  using V = F32Vec;
  constexpr int W = V::kWidth, kMaxNV = NV > 0 ? NV : 256 / W, C = Tuning::kPvChains;
  const int64_t head_dim = tv.head_dim, nv = NV > 0 ? NV : head_dim / W;
  const bool pairs = Tuning::pairs<T>(nv);
  const int64_t nh = tv.num_query_heads(), stride = tv.score_stride(), group = tv.group;
  scores.resize(nh * stride);
  qf.resize(nh * head_dim);
  acc.assign(nh * head_dim, 0.f);
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t d = 0; d < head_dim; ++d)
      qf[i * head_dim + Tuning::lane_of(d, pairs)] = static_cast<float>(q[i * head_dim + d]) * scale;
  walk_keys(k_cache, tv, [&](int64_t t0, int64_t n, const T* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const T* k = rows + (tv.kh0 + i / group) * tv.head_stride;
      VecF qv[kMaxNV];
      for (int64_t v = 0; v < nv; ++v) qv[v] = V::load(qf.data() + i * head_dim + W * v);
      for (int64_t h = 0; h < n; h += W) {  // W keys, one reduction
        VecF dots[W];
        const int64_t m = std::min<int64_t>(W, n - h);
        for (int64_t j = 0; j < m; ++j) {
          const T* kr = k + (h + j) * head_dim;
          VecF dot = V::mul(Tuning::load_row(kr, 0, pairs), qv[0]);
          for (int64_t v = 1; v < nv; ++v) dot = V::fmadd(Tuning::load_row(kr, v, pairs), qv[v], dot);
          dots[j] = dot;
        }
        for (int64_t j = m; j < W; ++j) dots[j] = V::zero();
        V::store(scores.data() + i * stride + t0 + h, V::reduce(dots));
      }
    }
  });
  float inv[256];  // nh <= num_heads <= 256: checked by the caller
  softmax_numerators(scores.data(), nh, stride, tv.len, inv);
  walk_keys(v_cache, tv, [&](int64_t t0, int64_t n, const T* rows, const char* next) {
    for (int64_t i = 0; i < nh; ++i) {
      if (i % group == 0) prefetch_piece(next, tv.kh0 + i / group, tv);
      const T* vr = rows + (tv.kh0 + i / group) * tv.head_stride;
      const float* p = scores.data() + i * stride + t0;
      float* a = acc.data() + i * head_dim;
      VecF av[C * kMaxNV];  // chain c's accumulator of vector v at c * kMaxNV + v
      for (int64_t v = 0; v < nv; ++v) {
        av[v] = V::load(a + W * v);
        for (int c = 1; c < C; ++c) av[c * kMaxNV + v] = V::zero();
      }
      int64_t j = 0;
      for (; j + C <= n; j += C) {
        VecF pc[C];
        for (int c = 0; c < C; ++c) pc[c] = V::set1(p[j + c]);
        for (int64_t v = 0; v < nv; ++v)
          for (int c = 0; c < C; ++c) {
            VecF& chain = av[c * kMaxNV + v];
            chain = V::fmadd(pc[c], Tuning::load_row(vr + (j + c) * head_dim, v, pairs), chain);
          }
      }
      for (; j < n; ++j) {  // the last key of an odd count, with two chains
        const VecF pj = V::set1(p[j]);
        const T* vj = vr + j * head_dim;
        for (int64_t v = 0; v < nv; ++v) av[v] = V::fmadd(pj, Tuning::load_row(vj, v, pairs), av[v]);
      }
      for (int64_t v = 0; v < nv; ++v) {
        VecF total = av[v];
        for (int c = 1; c < C; ++c) total = V::add(total, av[c * kMaxNV + v]);
        V::store(a + W * v, total);
      }
    }
  });
  for (int64_t i = 0; i < nh; ++i) {
    T* o = out + i * head_dim;
    const float* a = acc.data() + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(a[Tuning::lane_of(d, pairs)] * inv[i]);
  }
}

#if SS_HAS_AVX512_BF16
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
template <typename T>
void decode_task_dispatch(const T* q, const T* k_cache, const T* v_cache, const TaskView& tv, T* out, float scale,
                          std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& acc) {
#if SS_HAS_AVX512_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (tv.head_dim % 32 == 0) {
      if (tv.head_dim == 64) return decode_task_bf16<2>(q, k_cache, v_cache, tv, out, scale, scores, acc);
      if (tv.head_dim == 128) return decode_task_bf16<4>(q, k_cache, v_cache, tv, out, scale, scores, acc);
      return decode_task_bf16<0>(q, k_cache, v_cache, tv, out, scale, scores, acc);
    }
  }
#endif
  constexpr int W = F32Vec::kWidth;
  switch (tv.head_dim) {  // the common head sizes 64 and 128 get register-resident rows
    case 64: return decode_task<64 / W>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    case 128: return decode_task<128 / W>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
    default: return decode_task<0>(q, k_cache, v_cache, tv, out, scale, scores, qf, acc);
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
#if SS_HAS_SIMD  // the vector task where its loads take the dtype (AVX2: float32 and bfloat16), else the loop below
  if constexpr (F32Vec::kLoads<scalar_t>) {
    if (head_dim % F32Vec::kWidth == 0 && head_dim <= 256 && num_heads <= 256) {
      // A task is a sequence's kv heads, split only when there are too few sequences to keep every thread busy.
      const int64_t threads = at::get_num_threads();
      const int64_t splits =
          std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, (2 * threads + num_seqs - 1) / num_seqs));
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
          decode_task_dispatch(q + first, k_cache, v_cache, tv, out + first, scale, scores, qf, acc);
        }
      });
      return;
    }
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
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KH = k_cache.size(1), bs = k_cache.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                            S, H, KH, D, bs, tables.size(1), static_cast<float>(scale));
  });
  return out;
}
