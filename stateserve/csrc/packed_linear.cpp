// y = x @ W^T (+ bias) for a few to a few hundred rows of x (a batch of decoding requests, a verify step, a prefill
// chunk), from W repacked once into panels of 48 output columns. Within a panel the weights of one k-step for all
// 48 columns are 48 adjacent 32-bit words (float32: w[n][k]; bfloat16: the pair w[n][2s], w[n][2s + 1]), so a
// register tile of up to 8 rows of x by 3 vectors of 16 columns takes, per k-step, 3 vector loads of W, one
// broadcast word of each x row and 24 independent FMAs (vdpbf16ps in bfloat16): an outer product. A panel (48 x K)
// stays in L2 while every row tile passes over it, and panels are read in address order, one stream.
// Why: oneDNN with its own prepacked weights reaches 210-390 GFLOP/s in bfloat16 (100-200 in float32) at 8-64
// rows on the benchmark machine, this layout 370-410 (150-220); at 256-2048 rows they are within a few percent
// (peak: 470 and 235). At one or two rows csrc/linear.cpp streams the natural layout faster.
// Each output is one chain of multiply-adds over k in order, whatever the number of rows or the tile it falls in
// (a row's result does not depend on what it is batched with, from 3 rows up), or, packed in the lane order
// (batch_invariant), summed exactly in the few-row kernel's order (panel_layout.h): then a row's result is the
// same bits alone, batched, or in a verify step of 1 + k rows, whichever kernel took it. That order costs the
// k-steps' split into 16 chains, x put in their order per call and a tree at the end: 0-17% of the GFLOP/s of the
// k order (2 Zen 4 cores, weights in cache, K = 768-3072, 8-512 rows; least at large K).
// AVX2 (packed_linear_avx2.h): the same layout, tiles of up to 6 rows by 16 columns (in the lane order 3 in
// bfloat16, whose even and odd k are chains of their own), each panel in three such passes; float32 120-170 GFLOP/s
// at 8-512 rows on 2 Zen 3 cores against oneDNN's 55-160 (its ~190 peak), bfloat16 (widened to float32 in
// registers; no oneDNN bfloat16 there) 140-185 on [3072, 768] (half the bytes of W through the caches), in the k
// order. At a few rows the few-row kernel is faster there (linear.py's max_rows_prepacked).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include <vector>
#include "kernels.h"
#include "simd.h"
#include "panel_layout.h"
#include "packed_linear_avx2.h"

namespace {
constexpr int64_t kRowBlock = 256;  // rows of x per pass over W
using namespace stateserve_panels;

#if SS_HAS_AVX512
struct F32Words {  // one k per 32-bit word
  using T = float;
  using X = T;  // x's type as the tiles read it
  static constexpr int64_t kStep = 1;
  static constexpr int max_mr(bool) { return 8; }
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
  static constexpr int max_mr(bool) { return 8; }
  static __m512 madd(__m512 acc, __m512i w, __m512i x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
};
#endif

#if SS_HAS_AVX512
// c[r][0 .. 16 NV) = x row r times the panel's columns (r < MR), summed chain by chain in the order kLanes picks
// (panel_layout.h): x: row 0 of the tile, in the chains' order (to_chain_order; rows ldx elements apart); panel: the
// chains' words, kPanel per k-step; c: [MR][kPanel] float32; tree: kTreeDepth * MR * kPanel floats of scratch.
// Per k-step of a chain: NV vector loads of W, one broadcast word of each x row and MR * NV independent FMAs
// (vdpbf16ps in bfloat16), an outer product.
template <typename L, bool kLanes, int MR, int NV>
void tile(const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c, float* tree) {
  using O = SumOrder<kLanes>;
  const ChainLayout layout(steps, O::kCount);
  const int32_t* w = panel;
  const typename L::T* xs = x;  // x in the chains' order, as W
  int depth = 0;
  for (int i = 0; i < O::kCount; ++i) {
    const int j = O::chain(i);
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const int64_t n = layout.length(j);
    for (int64_t t = 0; t < n; ++t, w += kPanel, xs += L::kStep) {
      __m512i wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w + 16 * v);
      for (int r = 0; r < MR; ++r) {
        int32_t word;
        std::memcpy(&word, xs + r * ldx, sizeof(word));
        const __m512i xb = _mm512_set1_epi32(word);
        for (int v = 0; v < NV; ++v) acc[r][v] = L::madd(acc[r][v], wv[v], xb);
      }
    }
    if (layout.padded(j))
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = L::madd(acc[r][v], _mm512_setzero_si512(), _mm512_setzero_si512());
    // leaf i closes as many levels of the tree as i + 1 has trailing zero bits
    for (int closed = i + 1; (closed & 1) == 0; closed >>= 1) {
      const float* left = tree + (--depth) * MR * kPanel;
      for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v)
          acc[r][v] = _mm512_add_ps(_mm512_loadu_ps(left + r * kPanel + 16 * v), acc[r][v]);
    }
    float* dst = i + 1 < O::kCount ? tree + (depth++) * MR * kPanel : c;
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(dst + r * kPanel + 16 * v, acc[r][v]);
  }
}

template <typename L, bool kLanes, int MR>
void tile_nv(int nv, const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c,
             float* tree) {
  if (nv == 3) tile<L, kLanes, MR, 3>(x, ldx, panel, steps, c, tree);
  else if (nv == 2) tile<L, kLanes, MR, 2>(x, ldx, panel, steps, c, tree);
  else tile<L, kLanes, MR, 1>(x, ldx, panel, steps, c, tree);
}

template <typename L, bool kLanes>
void tile_any(int mr, int nv, const typename L::T* x, int64_t ldx, const int32_t* panel, int64_t steps, float* c,
              float* tree) {
  switch (mr) {
    case 8: return tile_nv<L, kLanes, 8>(nv, x, ldx, panel, steps, c, tree);
    case 7: return tile_nv<L, kLanes, 7>(nv, x, ldx, panel, steps, c, tree);
    case 6: return tile_nv<L, kLanes, 6>(nv, x, ldx, panel, steps, c, tree);
    case 5: return tile_nv<L, kLanes, 5>(nv, x, ldx, panel, steps, c, tree);
    case 4: return tile_nv<L, kLanes, 4>(nv, x, ldx, panel, steps, c, tree);
    case 3: return tile_nv<L, kLanes, 3>(nv, x, ldx, panel, steps, c, tree);
    case 2: return tile_nv<L, kLanes, 2>(nv, x, ldx, panel, steps, c, tree);
    default: return tile_nv<L, kLanes, 1>(nv, x, ldx, panel, steps, c, tree);
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

// dst[m] = x row m's k-steps (kStep values each) in the panels' chain order, for rows 0 .. rows: the tiles then read
// x in address order, as they read W (read in k order, chain after chain would pass over every cache line of x
// kChains times: with 8 rows of K = 3072 that is more than L1 holds, 25% slower in bfloat16). 32-bit k-steps go
// kChains x kChains at a time through a vector transpose (a copy word by word cost up to ~20% of a product of 5-16
// rows of a base model's weights).
template <typename X, int64_t kStep>
void to_chain_order(const X* x, int64_t ldx, int64_t rows, int64_t steps, X* dst) {
  struct Word {  // one k-step's values
    X v[kStep];
  };
  using V = stateserve_simd::F32Vec;
  constexpr bool kTranspose = sizeof(Word) == 4 && V::kWidth == kChains;
  const ChainLayout layout(steps, kChains);
  int64_t start[kChains];  // where each chain's k-steps begin in a row of dst
  int64_t pos = 0;
  for (int i = 0; i < kChains; pos += layout.length(kChainOrder[i++])) start[kChainOrder[i]] = pos;
  const int64_t grain = 1 + (int64_t{1} << 16) / (steps * kStep);  // a parallel region for 64K values or more
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const Word* row = reinterpret_cast<const Word*>(x + m * ldx);
      Word* out = reinterpret_cast<Word*>(dst + m * steps * kStep);
      int64_t t = 0;
      if constexpr (kTranspose) {  // rows t .. t + kChains of the [steps / kChains, kChains] matrix of words
        for (; t + kChains <= layout.full; t += kChains) {
          typename V::V block[kChains];
          for (int u = 0; u < kChains; ++u) block[u] = V::load(reinterpret_cast<const float*>(row + (t + u) * kChains));
          V::transpose(block);  // block[j]: chain j's words t .. t + kChains
          for (int j = 0; j < kChains; ++j) V::store(reinterpret_cast<float*>(out + start[j] + t), block[j]);
        }
      }
      for (; t < layout.full; ++t)
        for (int j = 0; j < kChains; ++j) out[start[j] + t] = row[t * kChains + j];
      for (int j = 0; j < layout.rest; ++j) out[start[j] + layout.full] = row[layout.full * kChains + j];
    }
  });
}

template <typename L, bool kLanes>
void run_packed(const typename L::X* x, int64_t ldx, int64_t M, int64_t K, const int32_t* packed, int64_t N,
                const typename L::T* bias, typename L::T* out) {
  constexpr int kMaxMR = L::max_mr(kLanes);
  const int64_t steps = K / L::kStep, panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = at::get_num_threads();
  // In the lane order, a pass's rows of x in chain order, in a buffer each calling thread keeps (a fresh one per call
  // cost its page faults: ~25% of a 512-row product's time with bfloat16 [480, 768] weights).
  thread_local std::vector<typename L::X> ordered;
  if (kLanes && ordered.size() < static_cast<size_t>(std::min(kRowBlock, M) * K))
    ordered.resize(std::min(kRowBlock, M) * K);
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
    int64_t ldb = ldx;
    if constexpr (kLanes) {
      to_chain_order<typename L::X, L::kStep>(xb, ldx, rows, steps, ordered.data());
      xb = ordered.data();
      ldb = K;
    }
    typename L::T* ob = out + row0 * N;
    at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float c[kMaxMR * kPanel];
      alignas(64) float tree[kTreeDepth * kMaxMR * kPanel];
      for (int64_t task = begin; task < end; ++task) {
        const int64_t p = task / chunks, n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        const int nv = static_cast<int>((cols + 15) / 16);
        const int32_t* panel = packed + p * steps * kPanel;
        const int64_t m_end = std::min(rows, (task % chunks + 1) * chunk_rows);
        for (int64_t m0 = (task % chunks) * chunk_rows; m0 < m_end; m0 += kMaxMR) {
          const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, m_end - m0));
          tile_any<L, kLanes>(mr, nv, xb + m0 * ldb, ldb, panel, steps, c, tree);
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
// N zero), step = 1 (float32) or 2 (bfloat16: K must be even); its k-steps in the chains of the lane order
// (lane_order: packed_linear must be called with the same) or in k order.
void pack_linear_weight_(at::Tensor packed, at::Tensor weight, bool lane_order) {
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
  const int chains = lane_order ? kChains : 1;
  const ChainLayout layout(steps, chains);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int32_t* out = dst + p * steps * kPanel;
      for (int i = 0; i < chains; ++i) {  // chain after chain (see kChainOrder), each k-step's kPanel columns
        const int j = lane_order ? kChainOrder[i] : 0;
        for (int64_t t = 0; t < layout.length(j); ++t, out += kPanel) {
          const int64_t s = t * chains + j;
          for (int64_t col = 0; col < kPanel; ++col) {
            const int64_t n = p * kPanel + col;
            int32_t word = 0;
            if (n < N) std::memcpy(&word, w + n * row_bytes + s * word_bytes, sizeof(word));
            out[col] = word;
          }
        }
      }
    }
  });
}

// x: [M, K] with unit stride along K; packed: from pack_linear_weight_ of a [N, K] weight of x's dtype, with the same
// lane_order; bias: [N] or None. Returns [M, N] in x's dtype (float32 sums, the bias added before rounding).
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t out_features,
                         bool lane_order) {
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
#if SS_HAS_SIMD
  const auto run = [&](auto words, const auto* xp, int64_t ldx, const auto* bp, auto* op) {
    using L = decltype(words);
    if (lane_order) run_packed<L, true>(xp, ldx, M, K, packed.data_ptr<int32_t>(), N, bp, op);
    else run_packed<L, false>(xp, ldx, M, K, packed.data_ptr<int32_t>(), N, bp, op);
  };
  if (x.scalar_type() == at::kBFloat16) {
    using bf = at::BFloat16;
    const bf* bp = b.defined() ? b.data_ptr<bf>() : nullptr;
#if SS_HAS_AVX512_BF16
    run(Bf16Words{}, x.data_ptr<bf>(), x.stride(0), bp, out.data_ptr<bf>());
#elif SS_HAS_AVX2
    const at::Tensor xf = x.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);  // [M, K]
    run(Bf16Words8{}, xf.data_ptr<float>(), K, bp, out.data_ptr<bf>());
#endif
    return out;
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if SS_HAS_AVX512
  run(F32Words{}, x.data_ptr<float>(), x.stride(0), bp, out.data_ptr<float>());
#else
  run(F32Words8{}, x.data_ptr<float>(), x.stride(0), bp, out.data_ptr<float>());
#endif
#endif
  return out;
}
