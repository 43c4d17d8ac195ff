// y = x @ W^T (+ bias) for a few to a few hundred rows of x (a batch of decoding requests), from W repacked once
// into panels of 48 output columns. Within a panel the weights of one k-step for all 48 columns are 48 adjacent
// 32-bit words (float32: w[n][k]; bfloat16: the pair w[n][2s], w[n][2s + 1]), so a register tile of up to 8 rows
// of x by 3 vectors of 16 columns takes, per k-step, 3 vector loads of W, one broadcast word of each x row and
// 24 independent FMAs (vdpbf16ps in bfloat16): an outer product, no horizontal sums. A panel (48 x K) stays in L2
// while every row tile passes over it, and panels are read in address order, one stream.
// Why: oneDNN with its own prepacked weights reaches 210-390 GFLOP/s in bfloat16 (100-200 in float32) at 8-64
// rows on the benchmark machine, this layout 370-410 (150-220); at 256-2048 rows they are within a few percent
// (peak: 470 and 235). At one or two rows csrc/linear.cpp streams the natural layout faster.
// Every output is the same chain of multiply-adds over k in order whatever the number of rows or the tile it falls
// in, so a row's result does not depend on what it is batched with (from 3 rows up).
// AVX2: the same layout, tiles of up to 6 rows by 16 columns, each panel in three such passes; float32 120-170
// GFLOP/s at 8-512 rows on 2 Zen 3 cores against oneDNN's 55-160 (its ~190 peak), bfloat16 (widened to float32 in
// registers; no oneDNN bfloat16 there) 140-185 on [3072, 768] (half the bytes of W through the caches). At a few
// rows the few-row kernel is faster there (linear.py's max_rows_prepacked).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "kernels.h"
#include "simd.h"

namespace {
constexpr int64_t kPanel = 48;  // output columns per panel
// rows of x per register tile. AVX2 (16 registers): 6 rows by 2 vectors of 8 columns, 12 accumulators, each panel
// in three passes of 16 columns.
#if SS_HAS_AVX2
constexpr int kMaxMR = 6;
#else
constexpr int kMaxMR = 8;
#endif
constexpr int64_t kRowBlock = 256;  // rows of x per pass over W

#if SS_HAS_AVX512
struct F32Words {  // one k per 32-bit word
  using T = float;
  using X = T;  // x's type as the tiles read it
  static constexpr int64_t kStep = 1;
  static __m512 madd(__m512 acc, __m512i w, __m512i x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
  }
};
#endif
#if SS_HAS_AVX512_BF16
struct Bf16Words {  // two consecutive k per 32-bit word; vdpbf16ps adds both products to the float32 lane
  using T = at::BFloat16;
  using X = T;
  static constexpr int64_t kStep = 2;
  static __m512 madd(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};
#endif

#if SS_HAS_AVX512
// c[r][0 .. 16 NV) = sum over k-steps of x row r's word times the panel's words (r < MR): x: row 0 of the tile
// (rows ldx elements apart); panel: [steps][kPanel] words; c: [MR][kPanel] float32.
template <typename L, int MR, int NV>
void tile(const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const int32_t* w = panel + s * kPanel;
    __m512i wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + 16 * v);
    for (int r = 0; r < MR; ++r) {
      int32_t word;
      std::memcpy(&word, x + r * ldx + s * L::kStep, sizeof(word));
      const __m512i xb = _mm512_set1_epi32(word);
      for (int v = 0; v < NV; ++v) acc[r][v] = L::madd(acc[r][v], wv[v], xb);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * kPanel + 16 * v, acc[r][v]);
}

template <typename L, int MR>
void tile_nv(int nv, const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  if (nv == 3) tile<L, MR, 3>(x, ldx, panel, steps, c);
  else if (nv == 2) tile<L, MR, 2>(x, ldx, panel, steps, c);
  else tile<L, MR, 1>(x, ldx, panel, steps, c);
}

template <typename L>
void tile_any(int mr, int nv, const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  switch (mr) {
    case 8: return tile_nv<L, 8>(nv, x, ldx, panel, steps, c);
    case 7: return tile_nv<L, 7>(nv, x, ldx, panel, steps, c);
    case 6: return tile_nv<L, 6>(nv, x, ldx, panel, steps, c);
    case 5: return tile_nv<L, 5>(nv, x, ldx, panel, steps, c);
    case 4: return tile_nv<L, 4>(nv, x, ldx, panel, steps, c);
    case 3: return tile_nv<L, 3>(nv, x, ldx, panel, steps, c);
    case 2: return tile_nv<L, 2>(nv, x, ldx, panel, steps, c);
    default: return tile_nv<L, 1>(nv, x, ldx, panel, steps, c);
  }
}

#endif

#if SS_HAS_AVX2
struct F32Words8 {  // float32 on AVX2: one k per 32-bit word, 8 columns per vector
  using T = float;
  using X = T;
  static constexpr int64_t kStep = 1;
  static __m256 value(__m256i words, int) { return _mm256_castsi256_ps(words); }
};
// bfloat16 on AVX2 (no vdpbf16ps): two consecutive k per word, split into two float32 vectors (k = 2s: the low
// halves shifted up; 2s + 1: the high halves masked) and multiplied with FMA by x, which packed_linear widens to
// float32 first (a broadcast from float32 memory costs no shuffle; widening x is M * K work against the product's
// M * K * N).
struct Bf16Words8 {
  using T = at::BFloat16;
  using X = float;
  static constexpr int64_t kStep = 2;
  static __m256 value(__m256i words, int half) {
    return _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(words, 16)
                                         : _mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
};

// c[r][0 .. 8 NV) = sum over k of x row r's value times the panel's columns (r < MR), for 8 NV of the panel's
// columns: panel and c point at the first of them, rows of the panel still kPanel words apart. Each k-step's words
// hold L::kStep values of k, taken in order (L::value): every output is one chain over k in order. Per value of k
// 12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16 registers.
template <typename L, int MR, int NV>
void tile8(const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const __m256i* w = reinterpret_cast<const __m256i*>(panel + s * kPanel);
    for (int half = 0; half < L::kStep; ++half) {
      __m256 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = L::value(_mm256_loadu_si256(w + v), half);
      for (int r = 0; r < MR; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + L::kStep * s + half);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(wv[v], xb, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + r * kPanel + 8 * v, acc[r][v]);
}

template <typename L, int MR>
void tile8_groups(int nv, const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  for (int g = 0; g < nv; ++g)  // nv groups of 16 columns (the panel's columns past N are zero)
    tile8<L, MR, 2>(x, ldx, panel + 16 * g, steps, c + 16 * g);
}

// The AVX-512 tile_any's counterpart: nv counts 16-column groups as there.
template <typename L>
void tile_any(int mr, int nv, const float* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c) {
  switch (mr) {
    case 6: return tile8_groups<L, 6>(nv, x, ldx, panel, steps, c);
    case 5: return tile8_groups<L, 5>(nv, x, ldx, panel, steps, c);
    case 4: return tile8_groups<L, 4>(nv, x, ldx, panel, steps, c);
    case 3: return tile8_groups<L, 3>(nv, x, ldx, panel, steps, c);
    case 2: return tile8_groups<L, 2>(nv, x, ldx, panel, steps, c);
    default: return tile8_groups<L, 1>(nv, x, ldx, panel, steps, c);
  }
}
#endif

#if SS_HAS_SIMD
// out[m][n] = c + bias for one tile's mr rows and the panel's cols (<= kPanel) columns, rounded to T.
template <typename T>
void store_tile(const float* c, int mr, int64_t cols, const T* bias, T* out, int64_t ldo) {
  using V = stateserve_simd::F32Vec;
  constexpr int64_t kWidth = V::kWidth;
  for (int r = 0; r < mr; ++r) {
    for (int64_t n = 0; n < cols; n += kWidth) {
      if (cols - n >= kWidth) {
        auto v = V::load(c + r * kPanel + n);
        if (bias != nullptr) v = V::add(v, V::load_from(bias + n));
        V::store_to(out + r * ldo + n, v);
      } else {  // the last panel's rest: element by element (less than a vector of a row)
        for (int64_t j = n; j < cols; ++j)
          out[r * ldo + j] = static_cast<T>(c[r * kPanel + j] + (bias != nullptr ? static_cast<float>(bias[j]) : 0.f));
      }
    }
  }
}

template <typename L>
void run_packed(const typename L::X* x, int64_t ldx, int64_t M, int64_t K, const int32_t* packed, int64_t N,
                const typename L::T* bias, typename L::T* out) {
  const int64_t steps = K / L::kStep, panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = at::get_num_threads();
  // Rows go kRowBlock at a time (a prefill chunk's 2048 rows: 8 passes over W), so that a pass's rows of x stay in
  // L2 while every panel of W comes by (one pass over all 2048: 4-8% slower in bfloat16). Within a pass, tasks are
  // (panel, chunk of rows), panel-major so that each thread reads its panels in address order; rows are split only
  // when the panels are too few to give every thread several. (Blocking K as well, so that a panel's piece stays in
  // L1 across the tiles, measured 3-8% slower: the partial sums' round trips cost more than L2 reads of W.)
  for (int64_t row0 = 0; row0 < M; row0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, M - row0);
    const int64_t tiles = (rows + kMaxMR - 1) / kMaxMR;
    const int64_t chunks = std::max<int64_t>(1, std::min(tiles, (4 * threads + panels - 1) / panels));
    const int64_t chunk_rows = (tiles + chunks - 1) / chunks * kMaxMR;
    const typename L::X* xb = x + row0 * ldx;
    typename L::T* ob = out + row0 * N;
    at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float c[kMaxMR * kPanel];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t p = task / chunks, n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        const int nv = static_cast<int>((cols + 15) / 16);
        const int32_t* panel = packed + p * steps * kPanel;
        const int64_t m_end = std::min(rows, (task % chunks + 1) * chunk_rows);
        for (int64_t m0 = (task % chunks) * chunk_rows; m0 < m_end; m0 += kMaxMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, m_end - m0));
          tile_any<L>(mr, nv, xb + m0 * ldx, ldx, panel, steps, c);
          store_tile(c, mr, cols, bias != nullptr ? bias + n0 : nullptr, ob + m0 * N + n0, N);
        }
      }
    });
  }
}
#endif

int64_t step_of(c10::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }
}  // namespace

bool packed_linear_supported(c10::ScalarType dtype, int64_t in_features) {
#if SS_HAS_AVX512_BF16 || SS_HAS_AVX2
  if (dtype == at::kBFloat16) return in_features % 2 == 0;
#endif
#if SS_HAS_SIMD
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// weight: [N, K] float32 or bfloat16 -> packed (int32, [ceil(N / 48), K / step, 48], written in place; columns past
// N zero), step = 1 (float32) or 2 (bfloat16: K must be even).
void pack_linear_weight_(at::Tensor packed, at::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "pack_linear_weight_: weight must be [N, K] contiguous");
  TORCH_CHECK(packed_linear_supported(weight.scalar_type(), weight.size(1)),
              "pack_linear_weight_: no packed kernel for this dtype / in_features in this build");
  const int64_t N = weight.size(0), K = weight.size(1), step = step_of(weight.scalar_type());
  const int64_t panels = (N + kPanel - 1) / kPanel, steps = K / step;
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kInt && packed.dim() == 3 &&
                  packed.size(0) == panels && packed.size(1) == steps && packed.size(2) == kPanel,
              "pack_linear_weight_: packed must be int32 [", panels, ", ", steps, ", ", kPanel, "]");
  const char* w = static_cast<const char*>(weight.data_ptr());
  int32_t* dst = packed.data_ptr<int32_t>();
  const int64_t row_bytes = K * weight.element_size(), word_bytes = step * weight.element_size();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t n = p * kPanel + j;
          int32_t word = 0;
          if (n < N) std::memcpy(&word, w + n * row_bytes + s * word_bytes, sizeof(word));
          dst[(p * steps + s) * kPanel + j] = word;
        }
  });
}

// x: [M, K] with unit stride along K; packed: from pack_linear_weight_ of a [N, K] weight of x's dtype; bias: [N]
// or None. Returns [M, N] in x's dtype (float32 sums, the bias added before rounding).
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "packed_linear: x must be [M, K]");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features, step = step_of(x.scalar_type());
  TORCH_CHECK(packed_linear_supported(x.scalar_type(), K), "packed_linear: no kernel for this dtype / K here");
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == K / step && packed.size(2) == kPanel,
              "packed_linear: packed weight does not match x's K = ", K, " and out_features = ", N);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == x.scalar_type(), "packed_linear: bias must be [N], x's dtype");
  }
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if SS_HAS_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) {
    using bf = at::BFloat16;
    run_packed<Bf16Words>(x.data_ptr<bf>(), x.stride(0), M, K, packed.data_ptr<int32_t>(), N,
                          b.defined() ? b.data_ptr<bf>() : nullptr, out.data_ptr<bf>());
    return out;
  }
#endif
#if SS_HAS_AVX2
  if (x.scalar_type() == at::kBFloat16) {
    using bf = at::BFloat16;
    const at::Tensor xf = x.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);  // [M, K]
    run_packed<Bf16Words8>(xf.data_ptr<float>(), K, M, K, packed.data_ptr<int32_t>(), N,
                           b.defined() ? b.data_ptr<bf>() : nullptr, out.data_ptr<bf>());
    return out;
  }
#endif
#if SS_HAS_AVX512
  run_packed<F32Words>(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<int32_t>(), N,
                       b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>());
#elif SS_HAS_AVX2
  run_packed<F32Words8>(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<int32_t>(), N,
                        b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<float>());
#endif
  return out;
}
