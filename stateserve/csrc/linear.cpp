// y = x @ W^T (+ bias) for few rows of x: the shape of a decode step. W keeps nn.Linear's [N, K] layout, so
// each output is a dot product along contiguous memory. Register tiles of MR rows of x by NR rows of W,
// one AVX-512 accumulator per output, reduced once at the end. Every output is summed in the same order
// whatever the number of rows, and packed_linear.cpp's panel kernel (more rows) sums in this order too
// (panel_layout.h), so a request's logits do not depend on what it is batched with.
// Why it exists: PyTorch's CPU GEMV/small-M matmul on this class of machine streams weights at well under
// half the memory bandwidth in float32, and bfloat16 GEMV is slower still; decoding is exactly that op.
// On AVX2-only CPUs (8-lane vectors) the same holds: the linears of a Mamba-base decode step took 19 ms here against
// 28 ms through oneDNN at one row, 20 vs 40 at four (2 Zen 3 cores, DRAM-resident float32 weights); oneDNN's call
// overhead alone was ~30 us on the one-row [80, 1536] and [1536, 48] products (kernel: 6-11 us). There oneDNN has
// no bfloat16 at all and PyTorch's bfloat16 GEMV streams ~20 GB/s; this kernel ~28 (a base model's weights, 1 row).
// Every build has it, in both dtypes (the fused decode calls run their float projections through it, beside the
// quantized ones): AVX-512 without vdpbf16ps widens bfloat16 as the AVX2 path does, and a build without vectors
// runs the portable loops at the end (one chain per output as well).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "kernels.h"
#include "simd.h"
#include "linear_lanes.h"

namespace {

using namespace stateserve_linear;

// rows of W per tile. AVX2 has 16 vector registers: 4 x 4 accumulators plus the loads spilled, and 4 x 2 ran
// 10-15% faster at 4-16 rows (2 cores, float32, [3072, 768] and [768, 1536] weights).
constexpr int kNR = SS_HAS_AVX2 ? 2 : 4;
constexpr int kMR = 4;  // rows of x per tile
// With one row of x, 4 accumulators leave the bfloat16 kernel bound by vdpbf16ps latency (~36 GB/s of weights);
// 8 rows of W per tile reach ~45 (the memory). Each output is still one chain over k, so sums do not change.
constexpr int kWideNR = 8;
// With one row of x the kernel walks W row after row (`accumulate`): each output's sum over k is the same
// chain as in the tiles of several rows (so results do not change), but the loads go out in address order, a
// single stream that the hardware prefetcher follows. The earlier order, k-step by k-step across the tile's 8
// rows, read 8 streams 1.5 KB apart and needed software prefetch to reach ~30 GB/s where a plain read reached
// ~34; row after row without prefetch streams at the read's speed (Llama-base bfloat16 weights, one process: 35
// vs 29.5 GB/s medians), and out-of-order execution overlaps the 8 rows' dependent chains.
// Tiles of up to this many rows of x walk W row after row as well. Two rows (two requests decoding) streamed
// base-model weights at 22.7 GB/s in the k-step order against 57 for one row; row after row both run at the same
// speed. From 4 rows on, each W row is reused across several x rows while it is in L1 and the k-step order with
// its prefetch is faster (bfloat16, 8 rows: 21 vs 16 GB/s; 16 rows: 16 vs 10.5).
constexpr int kRowByRowMaxMR = 2;
#if SS_HAS_AVX512
// The sum of v's 16 lanes: halves (l_i + l_(i+8)), then quarters (+ 4 apart), then the 4 lanes as
// (l0 + l2) + (l1 + l3). Spelled out rather than left to the compiler's _mm512_reduce_add_ps (GCC's is this tree,
// but no header promises an order): the panel kernel's lane order (panel_layout.h) reproduces exactly this tree.
inline float reduce_add16(__m512 v) {
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(v),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  const __m128 pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));  // [q0 + q2, q1 + q3, ...]
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

// The horizontal sums of v[0..7] as the 8 lanes of one vector, each added in exactly the order of reduce_add16,
// which the tiles of several rows use: a row's outputs do not depend on which path computed them. One
// transpose-and-add tree instead of 8 separate reductions: with one row of x (12 KB of bfloat16 W per 8 rows at K = 768) the 8
// reductions and scalar stores were ~15% of the tile's instructions, and the kernel issues its loads that much
// later.
inline __m256 reduce8_ps(const __m512* v) {
  __m512 halves[4];
  for (int j = 0; j < 4; ++j)  // [v(2j) lo + hi | v(2j+1) lo + hi]
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  // 128-bit quarter q of lo: the 4 partial sums of v[q]; of hi: of v[4 + q]
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                                  _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2], halves[3], 0x88),
                                  _mm512_shuffle_f32x4(halves[2], halves[3], 0xDD));
  // per quarter: [lo0 + lo2, hi0 + hi2, lo1 + lo3, hi1 + hi3], then lane 0 + lane 2 and lane 1 + lane 3
  const __m512 pairs = _mm512_add_ps(_mm512_unpacklo_ps(lo, hi), _mm512_unpackhi_ps(lo, hi));
  const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0x4E));
  // lane 4q: sum of v[q], lane 4q + 1: sum of v[4 + q]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}
#endif

#if SS_HAS_SIMD
// acc[i][j] = x[i] . w[j] for MR rows of x and NR rows of W, each a chain over k in ascending order (so every
// path gives the same sums). Up to kRowByRowMaxMR rows of x: one row of W after the other (see above); more: k-step
// by k-step across the tile, prefetching `pf` (the next tile, or null) into L1.
template <typename Ops, int MR, int NR>
inline void accumulate(const typename Ops::Scalar* x, int64_t ldx, const typename Ops::Scalar* w, int64_t ldw,
                       int64_t K, const typename Ops::Scalar* pf, typename Ops::Acc (&acc)[MR][NR]) {
  constexpr int S = Ops::kStep;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Ops::zero();
  const int64_t full = K - K % S, rest = K % S;  // k below `full` in whole vectors, then `rest` values
  if constexpr (MR <= kRowByRowMaxMR) {
    for (int j = 0; j < NR; ++j) {
      const typename Ops::Scalar* wr = w + j * ldw;
      for (int64_t k = 0; k < full; k += S) {
        const typename Ops::Vec wv = Ops::load(wr + k);
        for (int i = 0; i < MR; ++i) acc[i][j] = Ops::madd(acc[i][j], Ops::load(x + i * ldx + k), wv);
      }
      if (rest) {
        const typename Ops::Vec wv = Ops::load_first(wr + full, rest);
        for (int i = 0; i < MR; ++i) acc[i][j] = Ops::madd(acc[i][j], Ops::load_first(x + i * ldx + full, rest), wv);
      }
    }
  } else {
    for (int64_t k = 0; k < full; k += S) {
      typename Ops::Vec wv[NR];
      for (int j = 0; j < NR; ++j) {
        wv[j] = Ops::load(w + j * ldw + k);
        if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + j * ldw + k), _MM_HINT_T0);
      }
      for (int i = 0; i < MR; ++i) {
        const typename Ops::Vec xv = Ops::load(x + i * ldx + k);
        for (int j = 0; j < NR; ++j) acc[i][j] = Ops::madd(acc[i][j], xv, wv[j]);
      }
    }
    if (rest) {
      typename Ops::Vec wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = Ops::load_first(w + j * ldw + full, rest);
      for (int i = 0; i < MR; ++i) {
        const typename Ops::Vec xv = Ops::load_first(x + i * ldx + full, rest);
        for (int j = 0; j < NR; ++j) acc[i][j] = Ops::madd(acc[i][j], xv, wv[j]);
      }
    }
  }
}
#endif

#if SS_HAS_AVX512
// An MR x NR tile of float32 outputs.
template <int MR, int NR>
inline void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out,
                     int64_t ldo, const float* bias, const float* pf) {
  __m512 acc[MR][NR];
  accumulate<F32Lanes>(x, ldx, w, ldw, K, pf, acc);
  if constexpr (MR == 1 && NR == 8) {
    const __m256 sums = reduce8_ps(acc[0]);
    _mm256_storeu_ps(out, bias ? _mm256_add_ps(sums, _mm256_loadu_ps(bias)) : sums);
    return;
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = reduce_add16(acc[i][j]) + (bias ? bias[j] : 0.f);
}
#endif

#if SS_HAS_AVX2
// An MR x NR tile of outputs of type T on AVX2 (float32 sums). Each row's NR sums come from one reduce8_ps over its
// accumulators (the missing ones zero): a lane's sum involves only its own vector, so every output is added in the
// same order whichever tile it falls in.
template <typename Ops, typename T, int MR, int NR>
inline void tile8(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, T* out, int64_t ldo, const T* bias,
                  const T* pf) {
  using namespace stateserve_simd;
  using S = typename Ops::Scalar;
  static_assert(NR <= 8, "one reduce8_ps per row of the tile");
  typename Ops::Acc acc[MR][NR];
  accumulate<Ops>(reinterpret_cast<const S*>(x), ldx, reinterpret_cast<const S*>(w), ldw, K,
                  reinterpret_cast<const S*>(pf), acc);
  const __m256 b = bias == nullptr ? _mm256_setzero_ps() : NR == 8 ? load8(bias) : load8_first(bias, NR);
  for (int i = 0; i < MR; ++i) {
    __m256 v[8];
    for (int j = 0; j < 8; ++j) v[j] = j < NR ? Ops::total(acc[i][j]) : _mm256_setzero_ps();
    const __m256 sums = _mm256_add_ps(reduce8_ps(v), b);  // bfloat16: rounded once, after the bias
    if constexpr (NR == 8) store8(out + i * ldo, sums);
    else store8_first(out + i * ldo, NR, sums);
  }
}

template <int MR, int NR>
inline void tile_f32(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* out, int64_t ldo,
                     const float* bias, const float* pf) {
  tile8<F32Lanes8, float, MR, NR>(x, ldx, w, ldw, K, out, ldo, bias, pf);
}

template <int MR, int NR>
inline void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t K,
                      at::BFloat16* out, int64_t ldo, const at::BFloat16* bias, const at::BFloat16* pf) {
  tile8<Bf16Lanes8, at::BFloat16, MR, NR>(x, ldx, w, ldw, K, out, ldo, bias, pf);
}
#endif

#if SS_HAS_AVX512
// An MR x NR tile of bfloat16 outputs (summed in float32).
template <int MR, int NR>
inline void tile_bf16(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t ldw, int64_t K,
                      at::BFloat16* out, int64_t ldo, const at::BFloat16* bias, const at::BFloat16* pf) {
  Bf16Lanes::Acc chains[MR][NR];
  const auto as16 = [](const at::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  accumulate<Bf16Lanes>(as16(x), ldx, as16(w), ldw, K, as16(pf), chains);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Bf16Lanes::total(chains[i][j]);
#if SS_HAS_AVX512_BW
  if constexpr (MR == 1 && NR == 8) {  // the 8 sums in the low lanes; the store rounds as the cast below
    using namespace stateserve_simd;
    constexpr __mmask16 kEight = 0xff;
    const __m512 sums = _mm512_zextps256_ps512(reduce8_ps(acc[0]));
    store16_masked(out, kEight, bias ? _mm512_add_ps(sums, load16_masked(bias, kEight)) : sums);
    return;
  }
#endif
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      const float b = bias ? static_cast<float>(bias[j]) : 0.f;
      out[i * ldo + j] = static_cast<at::BFloat16>(reduce_add16(acc[i][j]) + b);
    }
}
#endif

// Dispatch a tile of runtime size (mr <= kMR, nr <= kNR) to its compiled template.
#define SS_TILE_FN(NAME, T)                                                                                  \
  template <int MR>                                                                                          \
  inline void NAME##_nr(int nr, const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, T* out,        \
                        int64_t ldo, const T* bias, const T* pf) {                                                        \
    switch (nr) {                                                                                            \
      case 4: NAME<MR, 4>(x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                         \
      case 3: NAME<MR, 3>(x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                         \
      case 2: NAME<MR, 2>(x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                         \
      default: NAME<MR, 1>(x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                        \
    }                                                                                                        \
  }                                                                                                          \
  /* one row of x: kWideNR rows of W per tile (more chains in flight), remainders by 4 */                      \
  inline void NAME##_row(int nr, const T* x, const T* w, int64_t ldw, int64_t K, T* out, const T* bias) {     \
    if (nr == kWideNR)                                                                                       \
      return NAME<1, kWideNR>(x, K, w, ldw, K, out, nr, bias, nullptr);                                    \
    for (int j = 0; j < nr; j += kNR)                                                                        \
      NAME##_nr<1>(std::min(kNR, nr - j), x, K, w + j * ldw, ldw, K, out + j, nr, bias ? bias + j : nullptr,  \
                   nullptr);                                                                                 \
  }                                                                                                          \
  inline void NAME##_any(int mr, int nr, const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, T* out, \
                         int64_t ldo, const T* bias, const T* pf) {                                                       \
    switch (mr) {                                                                                            \
      case 4: NAME##_nr<4>(nr, x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                    \
      case 3: NAME##_nr<3>(nr, x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                    \
      case 2: NAME##_nr<2>(nr, x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                    \
      default: NAME##_nr<1>(nr, x, ldx, w, ldw, K, out, ldo, bias, pf); break;                                   \
    }                                                                                                        \
  }

#if SS_HAS_SIMD
SS_TILE_FN(tile_f32, float)
SS_TILE_FN(tile_bf16, at::BFloat16)
#endif

// Threads split W's rows; each thread walks its W tiles once and reuses each tile (hot in L1) for all rows of x.
template <typename T, typename TileFn, typename RowFn>
void run_linear(const T* x, int64_t ldx, const T* w, int64_t K, int64_t M, int64_t N, T* out, const T* bias,
                TileFn tile, RowFn row) {
  if (M == 1) {
    at::parallel_for(0, (N + kWideNR - 1) / kWideNR, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kWideNR;
        row(static_cast<int>(std::min<int64_t>(kWideNR, N - n0)), x, w + n0 * K, K, out + n0,
            bias ? bias + n0 : nullptr);
      }
    });
    return;
  }
  const int64_t num_tiles = (N + kNR - 1) / kNR;
  at::parallel_for(0, num_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kNR;
      const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMR, M - m0));
        // Prefetch the next tile of W (streamed from DRAM) while this one is multiplied by every row of x: one
        // tile ahead is 4*K elements, far enough to hide the latency, near enough to stay in L1. (A single row
        // takes the path above, without software prefetch.)
        tile(mr, nr, x + m0 * ldx, ldx, w + n0 * K, K, K, out + m0 * N + n0, N, bias ? bias + n0 : nullptr,
             w + std::min<int64_t>(n0 + kNR, N - 1) * K);
      }
    }
  });
}

#if !SS_HAS_SIMD
// The portable loops (a build without AVX): each output one float32 chain over k in ascending order, the bias
// added and the result rounded once, as the vector paths do; kRows outputs side by side for independent chains.
template <typename T>
void run_linear_portable(const T* x, int64_t ldx, const T* w, int64_t K, int64_t M, int64_t N, T* out,
                         const T* bias) {
  constexpr int64_t kRows = 4;
  at::parallel_for(0, (N + kRows - 1) / kRows, stateserve_simd::rows_grain(kRows * K * M, 1),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kRows, nr = std::min(kRows, N - n0);
      const T* wt = w + n0 * K;
      for (int64_t m = 0; m < M; ++m) {
        const T* xr = x + m * ldx;
        float acc[kRows] = {};
        for (int64_t k = 0; k < K; ++k) {
          const float xv = static_cast<float>(xr[k]);
          for (int64_t j = 0; j < nr; ++j) acc[j] += xv * static_cast<float>(wt[j * K + k]);
        }
        for (int64_t j = 0; j < nr; ++j)
          out[m * N + n0 + j] = static_cast<T>(acc[j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.f));
      }
    }
  });
}
#endif

}  // namespace

bool fast_linear_supported(c10::ScalarType dtype) { return dtype == at::kFloat || dtype == at::kBFloat16; }

// x: [M, K] with unit stride along K; weight: [N, K] contiguous; bias: [N] or empty. Returns [M, N].
at::Tensor fast_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "fast_linear: x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(1) == weight.size(1), "fast_linear: x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "fast_linear: x and weight dtypes differ");
  TORCH_CHECK(fast_linear_supported(x.scalar_type()), "fast_linear: dtype not supported by this build");
  if (x.stride(1) != 1) x = x.contiguous();
  TORCH_CHECK(weight.is_contiguous(), "fast_linear: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto out = at::empty({M, N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == x.scalar_type(), "fast_linear: bias must be [N], same dtype");
  }
  if (M == 0 || N == 0) return out;
#if SS_HAS_SIMD
  if (x.scalar_type() == at::kFloat) {
    run_linear<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), K, M, N, out.data_ptr<float>(),
                      b.defined() ? b.data_ptr<float>() : nullptr,
                      [](int mr, int nr, const float* xp, int64_t ldx, const float* wp, int64_t ldw, int64_t k,
                         float* op, int64_t ldo, const float* bp, const float* pf) {
                        tile_f32_any(mr, nr, xp, ldx, wp, ldw, k, op, ldo, bp, pf);
                      },
                      [](int nr, const float* xp, const float* wp, int64_t k, float* op, const float* bp) {
                        tile_f32_row(nr, xp, wp, k, k, op, bp);
                      });
    return out;
  }
  {  // bfloat16 (fast_linear_supported checked the dtype)
    using bf = at::BFloat16;
    run_linear<bf>(x.data_ptr<bf>(), x.stride(0), weight.data_ptr<bf>(), K, M, N, out.data_ptr<bf>(),
                   b.defined() ? b.data_ptr<bf>() : nullptr,
                   [](int mr, int nr, const bf* xp, int64_t ldx, const bf* wp, int64_t ldw, int64_t k, bf* op,
                      int64_t ldo, const bf* bp, const bf* pf) { tile_bf16_any(mr, nr, xp, ldx, wp, ldw, k, op, ldo, bp, pf); },
                   [](int nr, const bf* xp, const bf* wp, int64_t k, bf* op, const bf* bp) {
                     tile_bf16_row(nr, xp, wp, k, k, op, bp);
                   });
    return out;
  }
#else
  const auto portable = [&](auto tag) {
    using T = decltype(tag);
    run_linear_portable<T>(x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), K, M, N, out.data_ptr<T>(),
                           b.defined() ? b.data_ptr<T>() : nullptr);
  };
  if (x.scalar_type() == at::kFloat) portable(float{});
  else portable(at::BFloat16{});
  return out;
#endif
}
