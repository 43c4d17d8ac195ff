// Causal attention of a prompt chunk over the paged KV cache (its own keys already written there), on CPU.
// PyTorch's CPU flash kernel reaches only ~50-100 GFLOP/s at these sizes in bfloat16 (it runs its products through
// float32 sgemm) and needs the context gathered and transposed first; this one reads the cache's blocks in place.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include "prefill_attention.h"
#include "simd.h"

#if defined(__AVX512F__)
namespace {
using stateserve_simd::exp_ps;
using stateserve_simd::load_row16;

constexpr int kRows = 16;  // query rows per task
constexpr int kKeys = 16;  // keys per step: one vector of scores per row
constexpr int kDotRows = 8;  // rows whose scores are accumulated together (independent FMA chains)

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// The step's keys with key j in lane j: float32 (one vector per dimension) or, for bfloat16 dot products, one
// vector per pair of dimensions (lane j = 32-bit word (k[j][2i], k[j][2i + 1])). Rows past n read as zeros.
template <int W, typename scalar_t>
inline void transpose_keys(const scalar_t* kr, int64_t n, int64_t row_len, __m512* kt) {
  for (int64_t c = 0; c < W; c += 16) {
    __m512 r[16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) { r[j] = _mm512_setzero_ps(); continue; }
      if constexpr (std::is_same_v<scalar_t, float>) r[j] = _mm512_loadu_ps(kr + j * row_len + c);
      else r[j] = _mm512_castsi512_ps(_mm512_loadu_si512(kr + j * row_len + 2 * c));  // 16 words = 32 elements
    }
    stateserve_simd::transpose16x16_ps(r);
    for (int64_t i = 0; i < 16; ++i) kt[c + i] = r[i];
  }
}

// One task: query head h, rows [r0, r0 + 16) of the chunk (row r at position ctx + r sees keys 0..ctx + r).
// Online softmax over steps of up to 16 keys within a cache block. Each step transposes its keys once (so scores
// need no horizontal sums: lane j of a row's score vector is key j) and reuses them for all 16 rows. In bfloat16
// both products run on vdpbf16ps (two multiply-adds per lane and instruction, no conversion): scores from q's raw
// pairs, and P.V from probabilities rounded to bfloat16 (as flash attention and transformers' eager bfloat16
// attention do) against value rows interleaved pairwise. Float32 uses FMAs, with the value rows shared by R query
// rows at a time so that R x NV accumulators stay in registers.
template <int NV, typename scalar_t>
void prefill_task(const scalar_t* q, int64_t q_row_stride, const scalar_t* k_cache, const scalar_t* v_cache,
                  const int64_t* table, int64_t ctx, int64_t num_rows, int64_t r0, int64_t h, int64_t group,
                  int64_t num_kv_heads, int64_t block_size, float scale, scalar_t* out, int64_t out_row_stride) {
  constexpr int64_t D = 16 * NV;
  constexpr int R = NV >= 16 ? 1 : 16 / NV;
  constexpr bool bf16_dot = kHaveBf16Dot && std::is_same_v<scalar_t, at::BFloat16>;
  constexpr int64_t W = bf16_dot ? D / 2 : D;  // key vectors per step
  const int64_t kh = h / group, head_stride = block_size * D, block_stride = num_kv_heads * head_stride;
  const int64_t rows = std::min<int64_t>(kRows, num_rows - r0);
  alignas(64) float qs[kRows][D];      // float32: q * scale; bfloat16: q's raw pairs as 32-bit words (first D / 2)
  alignas(64) float o[kRows][D];
  alignas(64) float p[kRows][kKeys];
  alignas(64) __m512 kt[W];
  float m[kRows], l[kRows], alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    const scalar_t* qr = q + (r0 + r) * q_row_stride + h * D;
    if constexpr (bf16_dot) {
      if (r < rows) std::memcpy(qs[r], qr, D * sizeof(scalar_t));
      else std::memset(qs[r], 0, D * sizeof(scalar_t));
    } else {
      for (int64_t d = 0; d < D; ++d) qs[r][d] = r < rows ? static_cast<float>(qr[d]) * scale : 0.f;
    }
    for (int64_t d = 0; d < D; ++d) o[r][d] = 0.f;
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const int64_t end = ctx + r0 + rows;  // keys [0, end) are visible to some row of the task
  for (int64_t t0 = 0; t0 < end;) {
    const int64_t off = t0 % block_size;
    const int64_t n = std::min<int64_t>({kKeys, block_size - off, end - t0});
    const int64_t piece = table[t0 / block_size] * block_stride + kh * head_stride + off * D;
    const scalar_t *kr = k_cache + piece, *vr = v_cache + piece;
    transpose_keys<W>(kr, n, D, kt);
    for (int r = 0; r < kRows; r += kDotRows) {
      __m512 acc[kDotRows];
      for (int i = 0; i < kDotRows; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t w = 0; w < W; ++w) {
        for (int i = 0; i < kDotRows; ++i) {
          if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
            const __m512i qw = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(qs[r + i])[w]);
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_castps_si512(kt[w]), (__m512bh)qw);
#endif
          } else {
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r + i][w]), kt[w], acc[i]);
          }
        }
      }
      for (int i = 0; i < kDotRows; ++i) _mm512_store_ps(p[r + i], bf16_dot ? _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)) : acc[i]);
    }
    for (int r = 0; r < kRows; ++r) {  // online softmax: p[r] <- exp(s - new max), lanes the row does not see 0
      const int64_t visible = std::min<int64_t>(n, ctx + r0 + r - t0 + 1);
      if (visible <= 0) {
        alpha[r] = 1.f;
        _mm512_store_ps(p[r], _mm512_setzero_ps());
        continue;
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << visible) - 1u);
      const __m512 sv = _mm512_load_ps(p[r]);
      const float m_new = std::max(m[r], _mm512_mask_reduce_max_ps(lanes, sv));
      const __m512 e = _mm512_maskz_mov_ps(lanes, exp_ps(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
      alpha[r] = std::exp(m[r] - m_new);  // 0 on the first step (m = -inf)
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
      m[r] = m_new;
      _mm512_store_ps(p[r], e);
    }
    if constexpr (bf16_dot) {
#if defined(__AVX512BF16__)
      // value rows 2m and 2m + 1 interleaved: vectors of 16 dimensions x (v[2m][d], v[2m + 1][d])
      alignas(64) __m512i vp[kKeys / 2][NV];
      const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                          39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
      for (int64_t mm = 0; mm < kKeys / 2; ++mm) {
        for (int64_t c = 0; c < NV; c += 2) {
          const __m512i a = 2 * mm < n ? _mm512_loadu_si512(vr + 2 * mm * D + 16 * c) : _mm512_setzero_si512();
          const __m512i b = 2 * mm + 1 < n ? _mm512_loadu_si512(vr + (2 * mm + 1) * D + 16 * c) : _mm512_setzero_si512();
          vp[mm][c] = _mm512_permutex2var_epi16(a, lo, b);
          vp[mm][c + 1] = _mm512_permutex2var_epi16(a, hi, b);
        }
      }
      for (int r = 0; r < kRows; r += R) {
        __m512 acc[R][NV];
        alignas(32) int32_t pw[R][kKeys / 2];
        for (int i = 0; i < R; ++i) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(pw[i]), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[r + i])));
          const __m512 a = _mm512_set1_ps(alpha[r + i]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_load_ps(o[r + i] + 16 * v), a);
        }
        for (int64_t mm = 0; mm < (n + 1) / 2; ++mm)
          for (int i = 0; i < R; ++i) {
            const __m512bh pm = (__m512bh)_mm512_set1_epi32(pw[i][mm]);
            for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], (__m512bh)vp[mm][v], pm);
          }
        for (int i = 0; i < R; ++i)
          for (int v = 0; v < NV; ++v) _mm512_store_ps(o[r + i] + 16 * v, acc[i][v]);
      }
#endif
    } else {
      for (int r = 0; r < kRows; r += R) {
        __m512 acc[R][NV];
        for (int i = 0; i < R; ++i) {
          const __m512 a = _mm512_set1_ps(alpha[r + i]);
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(_mm512_load_ps(o[r + i] + 16 * v), a);
        }
        for (int64_t j = 0; j < n; ++j) {
          __m512 vv[NV];
          for (int v = 0; v < NV; ++v) vv[v] = load_row16(vr + j * D, v, false);
          for (int i = 0; i < R; ++i) {
            const __m512 pj = _mm512_set1_ps(p[r + i][j]);
            for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(pj, vv[v], acc[i][v]);
          }
        }
        for (int i = 0; i < R; ++i)
          for (int v = 0; v < NV; ++v) _mm512_store_ps(o[r + i] + 16 * v, acc[i][v]);
      }
    }
    t0 += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = out + (r0 + r) * out_row_stride + h * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[r][d] * inv);
  }
}
}  // namespace
#endif

bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim) {
#if defined(__AVX512F__)
  return (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 64 || head_dim == 128);
#else  // the AVX2 task where it is built
  return (dtype == at::kFloat || dtype == at::kBFloat16) && stateserve_attention::prefill_x8_supported(head_dim);
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
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
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
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
#else
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    stateserve_attention::prefill_x8(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                                     v_cache.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), ctx, Lq, H, KH, D, bs,
                                     static_cast<float>(scale), out.data_ptr<scalar_t>());
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
#endif
  return out;
}
