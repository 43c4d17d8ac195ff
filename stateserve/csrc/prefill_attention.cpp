// Causal attention of a prompt chunk over the paged KV cache (its own keys already written there), on CPU.
// PyTorch's CPU flash kernel reaches only ~50-100 GFLOP/s at these sizes in bfloat16 (it runs its products through
// float32 sgemm) and needs the context gathered and transposed first; this one reads the cache's blocks in place.
// With AVX2 (2 Zen 3 cores, 12 heads of 64) the flash kernel ran 32-61 GFLOP/s at 256-512 rows, this one 42-98; past
// ~4096 keys the flash kernel's blocked products lead (~120 vs ~100), so the kernel table sends longer sequences there.
// The task is written once over the build's float32 vector (16 lanes with AVX-512, 8 with AVX2); how each width
// tiles it is in Tiles, and with AVX-512 + BF16 both products of a bfloat16 chunk run on vdpbf16ps.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include "kernels.h"
#include "simd.h"

#if SS_HAS_SIMD
namespace {
using stateserve_simd::F32Vec;
using stateserve_simd::VecF;
using stateserve_simd::exp_ps;

constexpr int W = F32Vec::kWidth;
constexpr int kKeys = 16;             // keys per step, within one cache block
constexpr int kKeyVecs = kKeys / W;   // score vectors per row and step: lane j of vector c is key c * W + j

// What each width tiles differently (tuned on Zen 5 and Zen 3): query rows per task, rows whose scores are summed
// together (independent FMA chains), and the P.V tile of rows by vectors of the head, whose accumulators stay in
// registers (AVX-512's 32, AVX2's 16); with AVX2 each step's value rows are widened once into float32.
#if SS_HAS_AVX512
struct Tiles {
  static constexpr int kRows = 16, kDotRows = 8;
  template <int NV>
  static constexpr int kPvRows = NV >= 16 ? 1 : 16 / NV;
  template <int NV>
  static constexpr int kPvVecs = NV;
  static constexpr bool kWidenValues = false;
  // the softmax denominator's rescale, l * alpha + sum, as one FMA (as this build always compiled it)
  static float rescaled(float l, float alpha, float sum) { return std::fma(l, alpha, sum); }
};
#else
struct Tiles {
  static constexpr int kRows = 32, kDotRows = 4;
  template <int NV>
  static constexpr int kPvRows = 2;
  template <int NV>
  static constexpr int kPvVecs = 4;
  static constexpr bool kWidenValues = true;
  // two roundings, as this build always compiled it: the SSE builtins keep the compiler from fusing them
  static float rescaled(float l, float alpha, float sum) {
    return _mm_cvtss_f32(_mm_add_ss(_mm_mul_ss(_mm_set_ss(l), _mm_set_ss(alpha)), _mm_set_ss(sum)));
  }
};
#endif
constexpr int kRows = Tiles::kRows;

#if SS_HAS_AVX512_BF16
// o[r] = o[r] * alpha[r] + p[r] . V for the step's n value rows (vr, D apart) in bfloat16 on vdpbf16ps: the
// probabilities rounded to bfloat16 (as flash attention and transformers' eager bfloat16 attention do) against value
// rows interleaved pairwise.
template <int NV>
void pv_bf16(const at::BFloat16* vr, int64_t n, float (*p)[kKeys], const float* alpha, float (*o)[16 * NV]) {
  constexpr int64_t D = 16 * NV;
  constexpr int R = Tiles::kPvRows<NV>;
  // value rows 2m and 2m + 1 interleaved: vectors of 16 dimensions x (v[2m][d], v[2m + 1][d])
  alignas(64) __m512i vp[kKeys / 2][NV];
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t mm = 0; mm < kKeys / 2; ++mm) {
    for (int64_t c = 0; c < NV; c += 2) {
      const __m512i a = 2 * mm < n ? _mm512_loadu_si512(vr + 2 * mm * D + 16 * c) : _mm512_setzero_si512();
      const __m512i b =
          2 * mm + 1 < n ? _mm512_loadu_si512(vr + (2 * mm + 1) * D + 16 * c) : _mm512_setzero_si512();
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
}
#endif

// p[r] = the step's scores for every row r of the task, kDotRows rows at a time, from KV of the key vectors (those
// holding the step's keys; the rest of p[r] is 0). bf16_dot: q's raw bfloat16 pairs against pairs of dimensions
// on vdpbf16ps, scaled afterwards.
template <int KV, bool bf16_dot, int64_t D, int64_t KW>
inline void step_scores(const float (*__restrict qs)[D], const VecF (*__restrict kt)[KW],
                        float (*__restrict p)[kKeys], float scale) {
  using V = F32Vec;
  static_assert(KV == 1 || KV == 2, "16 keys: one or two vectors of scores");
  for (int r = 0; r < kRows; r += Tiles::kDotRows) {
    VecF acc0[Tiles::kDotRows], acc1[Tiles::kDotRows];  // keys 0..W-1, W..2W-1 (separate arrays: in registers)
    for (int i = 0; i < Tiles::kDotRows; ++i) acc0[i] = acc1[i] = V::zero();
    for (int64_t w = 0; w < KW; ++w) {
      for (int i = 0; i < Tiles::kDotRows; ++i) {
        if constexpr (bf16_dot) {
#if SS_HAS_AVX512_BF16
          const __m512i qw = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(qs[r + i])[w]);
          acc0[i] = _mm512_dpbf16_ps(acc0[i], (__m512bh)_mm512_castps_si512(kt[0][w]), (__m512bh)qw);
#endif
        } else {
          const VecF qd = V::set1(qs[r + i][w]);
          acc0[i] = V::fmadd(qd, kt[0][w], acc0[i]);
          if constexpr (KV == 2) acc1[i] = V::fmadd(qd, kt[1][w], acc1[i]);
        }
      }
    }
    for (int i = 0; i < Tiles::kDotRows; ++i) {
      V::store(p[r + i], bf16_dot ? V::mul(acc0[i], V::set1(scale)) : acc0[i]);
      if constexpr (kKeyVecs == 2) V::store(p[r + i] + W, acc1[i]);
    }
  }
}

// One task: query head h, rows [r0, r0 + kRows) of the chunk (row r at position ctx + r sees keys 0..ctx + r), a
// head of D = W * NV. Online softmax over steps of up to 16 keys within a cache block. Each step transposes its keys
// once (so scores need no horizontal sums: lane j of a row's score vector is key j) and reuses them for every row;
// P.V runs FMAs of probabilities against the value rows. In bfloat16 with AVX-512 + BF16 both products run on
// vdpbf16ps instead (two multiply-adds per lane and instruction, no conversion): scores from q's raw pairs.
template <int NV, typename T>
void prefill_task(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int64_t* table,
                  int64_t ctx, int64_t num_rows, int64_t r0, int64_t h, int64_t group, int64_t num_kv_heads,
                  int64_t block_size, float scale, T* out, int64_t out_row_stride) {
  using V = F32Vec;
  constexpr int64_t D = W * NV;
  constexpr bool bf16_dot = SS_HAS_AVX512_BF16 && std::is_same_v<T, at::BFloat16>;
  constexpr int64_t KW = bf16_dot ? D / 2 : D;  // key vectors per step: dimensions, or pairs of them
  constexpr int PR = Tiles::kPvRows<NV>, PV = Tiles::kPvVecs<NV>;
  const int64_t kh = h / group, head_stride = block_size * D, block_stride = num_kv_heads * head_stride;
  const int64_t rows = std::min<int64_t>(kRows, num_rows - r0);
  alignas(64) float qs[kRows][D];  // float32: q * scale; bf16_dot: q's raw pairs as 32-bit words (first D / 2)
  alignas(64) float o[kRows][D];
  alignas(64) float p[kRows][kKeys];
  alignas(64) VecF kt[kKeyVecs][KW];  // kt[c][w] lane j: key c * W + j's dimension (pair) w
  alignas(64) float vf[Tiles::kWidenValues ? kKeys : 1][D];  // the step's value rows in float32
  float m[kRows], l[kRows], alpha[kRows];
  for (int r = 0; r < kRows; ++r) {
    const T* qr = q + (r0 + r) * q_row_stride + h * D;
    if constexpr (bf16_dot) {
      if (r < rows) std::memcpy(qs[r], qr, D * sizeof(T));
      else std::memset(qs[r], 0, D * sizeof(T));
    } else {
      for (int64_t d = 0; d < D; ++d) qs[r][d] = r < rows ? static_cast<float>(qr[d]) * scale : 0.f;
    }
    std::fill(o[r], o[r] + D, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  const VecF minus_inf = V::set1(-std::numeric_limits<float>::infinity());
  const int64_t end = ctx + r0 + rows;  // keys [0, end) are visible to some row of the task
  for (int64_t t0 = 0; t0 < end;) {
    const int64_t off = t0 % block_size;
    const int64_t n = std::min<int64_t>({kKeys, block_size - off, end - t0});
    const int64_t piece = table[t0 / block_size] * block_stride + kh * head_stride + off * D;
    const T *kr = k_cache + piece, *vr = v_cache + piece;
    const int active = static_cast<int>((n + W - 1) / W);  // score vectors holding any key (vectors past: unread)
    for (int c = 0; c < active; ++c)
      for (int64_t w0 = 0; w0 < KW; w0 += W) {
        VecF r[W];
        for (int j = 0; j < W; ++j) {  // keys past n read as zeros
          const T* row = kr + (c * W + j) * D;
          if (c * W + j >= n) {
            r[j] = V::zero();
          } else if constexpr (bf16_dot) {
#if SS_HAS_AVX512_BF16
            r[j] = _mm512_castsi512_ps(_mm512_loadu_si512(row + 2 * w0));  // 16 pairs: 32 values
#endif
          } else {
            r[j] = V::load_from(row + w0);
          }
        }
        V::transpose(r);
        for (int i = 0; i < W; ++i) kt[c][w0 + i] = r[i];
      }
    if (kKeyVecs == 1 || active == kKeyVecs) step_scores<kKeyVecs, bf16_dot>(qs, kt, p, scale);
    else step_scores<1, bf16_dot>(qs, kt, p, scale);  // the first of two key vectors holds every key
    for (int r = 0; r < kRows; ++r) {  // online softmax: p[r] <- exp(s - new max), lanes the row does not see 0
      const int64_t visible = std::min<int64_t>(n, ctx + r0 + r - t0 + 1);
      if (visible <= 0) {
        alpha[r] = 1.f;
        for (int c = 0; c < kKeyVecs; ++c) V::store(p[r] + c * W, V::zero());
        continue;
      }
      VecF sv[kKeyVecs], top = minus_inf;
      for (int c = 0; c < kKeyVecs; ++c) {
        sv[c] = V::load(p[r] + c * W);
        top = V::max(top, V::select(V::first(visible - c * W), sv[c], minus_inf));
      }
      const float m_new = std::max(m[r], V::hmax(top));
      VecF e[kKeyVecs];
      for (int c = 0; c < kKeyVecs; ++c) {
        e[c] = V::keep(V::first(visible - c * W), exp_ps(V::sub(sv[c], V::set1(m_new))));
        V::store(p[r] + c * W, e[c]);
      }
      VecF total = e[0];
      for (int c = 1; c < kKeyVecs; ++c) total = V::add(total, e[c]);
      alpha[r] = std::exp(m[r] - m_new);  // 0 on the first step (m = -inf)
      l[r] = Tiles::rescaled(l[r], alpha[r], V::hsum(total));
      m[r] = m_new;
    }
    if constexpr (bf16_dot) {
#if SS_HAS_AVX512_BF16
      pv_bf16<NV>(vr, n, p, alpha, o);
#endif
    } else {
      if constexpr (Tiles::kWidenValues)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < D; c += W) V::store(vf[j] + c, V::load_from(vr + j * D + c));
      for (int r = 0; r < kRows; r += PR) {  // o = o * alpha + p . V, PR rows x PV vectors at a time
        for (int v0 = 0; v0 < NV; v0 += PV) {
          VecF acc[PR][PV];
          for (int i = 0; i < PR; ++i) {
            const VecF a = V::set1(alpha[r + i]);
            for (int v = 0; v < PV; ++v) acc[i][v] = V::mul(V::load(o[r + i] + W * (v0 + v)), a);
          }
          for (int64_t j = 0; j < n; ++j) {
            VecF vv[PV];
            for (int v = 0; v < PV; ++v)
              vv[v] = Tiles::kWidenValues ? V::load(vf[j] + W * (v0 + v)) : V::load_from(vr + j * D + W * (v0 + v));
            for (int i = 0; i < PR; ++i) {
              const VecF pj = V::set1(p[r + i][j]);
              for (int v = 0; v < PV; ++v) acc[i][v] = V::fmadd(pj, vv[v], acc[i][v]);
            }
          }
          for (int i = 0; i < PR; ++i)
            for (int v = 0; v < PV; ++v) V::store(o[r + i] + W * (v0 + v), acc[i][v]);
        }
      }
    }
    t0 += n;
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (r0 + r) * out_row_stride + h * D;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r][d] * inv);
  }
}
}  // namespace
#endif

bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim) {
  return SS_HAS_SIMD && (dtype == at::kFloat || dtype == at::kBFloat16) && (head_dim == 64 || head_dim == 128);
}

// q: [Lq, H, D] (rows may be strided, heads and dims contiguous); k_cache, v_cache: [num_blocks, KH, block_size,
// D] holding keys 0..ctx + Lq - 1 of the sequence; block_table: its blocks, int64. Returns [Lq, H, D].
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_table, int64_t ctx, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill_attention: q layout");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && q.scalar_type() == k_cache.scalar_type(),
              "paged_prefill_attention: caches must be contiguous and of q's dtype");
  const int64_t Lq = q.size(0), H = q.size(1), D = q.size(2), KH = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK(prefill_attention_supported(q.scalar_type(), D) && k_cache.size(3) == D && H % KH == 0,
              "paged_prefill_attention: unsupported dtype or shape");
  auto table = block_table.to(at::kLong).contiguous();
  TORCH_CHECK(table.numel() * bs >= ctx + Lq, "paged_prefill_attention: block table shorter than the sequence");
  auto out = at::empty({Lq, H, D}, q.options());
#if SS_HAS_SIMD
  const int64_t q_blocks = (Lq + kRows - 1) / kRows;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T *qp = q.data_ptr<T>(), *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t* tp = table.data_ptr<int64_t>();
    at::parallel_for(0, H * q_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / q_blocks, r0 = task % q_blocks * kRows;
        if (D == 64)
          prefill_task<64 / W>(qp, q.stride(0), kc, vc, tp, ctx, Lq, r0, h, H / KH, KH, bs, float(scale), op, H * D);
        else
          prefill_task<128 / W>(qp, q.stride(0), kc, vc, tp, ctx, Lq, r0, h, H / KH, KH, bs, float(scale), op, H * D);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
#endif
  return out;
}
