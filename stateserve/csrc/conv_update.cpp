// The conv of one decode token for Mamba-style layers: each sequence's depthwise causal conv over its last K
// inputs, shifting the conv state in place. A decode step runs it once per layer, so its cost is mostly reading
// the 16-channel windows, which the state keeps channel-major ([C, K-1]).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <array>
#include <cstring>
#include <type_traits>
#include "kernels.h"
#include "simd.h"

namespace {

using stateserve_simd::round_to;
using stateserve_simd::rows_grain;
using stateserve_simd::silu_rounded;

// Where the conv's outputs go, as `kind` says (conv_update.h).
template <typename T>
struct ConvOut {
  ConvOutput kind;
  T* y;          // kConv, kSilu
  float* y_f32;  // kSiluFloat32
  ConvOut at(int64_t offset) const { return {kind, y ? y + offset : nullptr, y_f32 ? y_f32 + offset : nullptr}; }
  void put(int64_t i, float v) const {
    if (kind == ConvOutput::kConv) y[i] = static_cast<T>(v);
    else if (kind == ConvOutput::kSilu) y[i] = static_cast<T>(silu_rounded<T>(v));
    else y_f32[i] = silu_rounded<T>(v);
  }
#if SS_HAS_SIMD
  void put_vec(int64_t i, stateserve_simd::VecF v) const {  // W channels from i
    using namespace stateserve_simd;
    if (kind == ConvOutput::kSiluFloat32) F32Vec::store(y_f32 + i, silu_rounded_ps<T>(v));
    else F32Vec::store_to(y + i, kind == ConvOutput::kSilu ? silu_rounded_ps<T>(v) : v);
  }
#endif
};

#if SS_HAS_SIMD
// The conv outputs of 16 channels from their W + 1 inputs, for each vector of channels c0 one float32 vector per tap
// (tap[c0 / lanes][k]; k = W: the new input): products and sums rounded as the scalar path rounds them; bias: 16
// float32 values or nullptr.
template <typename T>
inline void conv_16_channels(const stateserve_simd::VecF (*tap)[9], int64_t W, const float* wt, int64_t ldw,
                             const float* bias, bool float_accumulate, const ConvOut<T>& y) {
  using namespace stateserve_simd;
  using V = F32Vec;
  for (int64_t c0 = 0; c0 < 16; c0 += V::kWidth) {
    VecF acc = V::zero();
    for (int64_t k = 0; k <= W; ++k) {
      const VecF prod = V::mul(tap[c0 / V::kWidth][k], V::load(wt + k * ldw + c0));
      acc = V::add(acc, float_accumulate ? prod : round_to_ps<T>(prod));
    }
    const VecF b = bias ? V::load(bias + c0) : V::zero();
    y.put_vec(c0, V::add(float_accumulate ? acc : round_to_ps<T>(acc), b));
  }
}
#endif

// conv1d_update_ for 16 consecutive channels of one sequence: the windows are read into one float32 vector per
// tap, then conv_16_channels. Returns false when this dtype or window size has no vector path (the caller then
// runs the scalar loop).
template <typename T>
bool conv_update_simd(const T* rows, const T* x, const float* wt, const float* bias, int64_t ldw, int64_t W,
                      bool float_accumulate, const ConvOut<T>& y) {
#if SS_HAS_SIMD
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    using namespace stateserve_simd;
    using V = F32Vec;
    constexpr int64_t kMaxW = 8;
    if (W > kMaxW) return false;
    alignas(64) float win[kMaxW][16];
    for (int j = 0; j < 16; ++j)
      for (int64_t k = 0; k < W; ++k) win[k][j] = static_cast<float>(rows[j * W + k]);
    VecF tap[16 / V::kWidth][kMaxW + 1];
    for (int64_t c0 = 0; c0 < 16; c0 += V::kWidth) {
      for (int64_t k = 0; k < W; ++k) tap[c0 / V::kWidth][k] = V::load(win[k] + c0);
      tap[c0 / V::kWidth][W] = V::load_from(x + c0);
    }
    conv_16_channels(tap, W, wt, ldw, bias, float_accumulate, y);
    return true;
  }
#endif
  return false;
}

#if SS_HAS_AVX512_BW
// bfloat16 windows of at most 4 inputs (conv kernels up to 5): the 16 channels' windows are 16 * W <= 64
// consecutive words, two registers. One word permutation puts them window-major (16 channels per window: one
// vector per tap) and another puts the shifted windows back, instead of 16 * W scalar conversions in and a
// memmove plus 16 scalar stores out (~100 ns a block of 16 channels, ~11 us of Mamba2-base's 112 blocks).
struct WindowPermutes {
  __m512i to_taps[2];      // words 32c..32c+31 of the window-major order (16 per tap), from the channel-major ones
  __m512i to_channels[2];  // and back
};

inline const WindowPermutes& window_permutes(int64_t W) {
  static const std::array<WindowPermutes, 5> tables = [] {
    std::array<WindowPermutes, 5> t{};
    for (int w = 1; w <= 4; ++w)
      for (int c = 0; c < 2; ++c) {
        alignas(64) uint16_t taps[32], channels[32];
        for (int i = 0; i < 32; ++i) {
          const int out = 32 * c + i;
          taps[i] = out / 16 < w ? static_cast<uint16_t>((out % 16) * w + out / 16) : 0;  // tap k, channel j
          channels[i] = out < 16 * w ? static_cast<uint16_t>((out % w) * 16 + out / w) : 0;
        }
        t[w].to_taps[c] = _mm512_load_si512(taps);
        t[w].to_channels[c] = _mm512_load_si512(channels);
      }
    return t;
  }();
  return tables[W];
}

inline __mmask32 first_words(int64_t n) {
  return n <= 0 ? 0 : n >= 32 ? 0xffffffffu : static_cast<__mmask32>((1u << n) - 1u);
}

// The conv of 16 channels and their window shift, as conv_update_simd plus the caller's shift compute them.
bool conv_update_bf16_small_window(at::BFloat16* rows, const at::BFloat16* x, const float* wt, const float* bias,
                                   int64_t ldw, int64_t W, bool float_accumulate,
                                   const ConvOut<at::BFloat16>& y) {
  if (W < 1 || W > 4) return false;
  auto* words = reinterpret_cast<uint16_t*>(rows);
  const int64_t n = 16 * W;
  const __m512i lo = _mm512_maskz_loadu_epi16(first_words(n), words);
  const __m512i hi = _mm512_maskz_loadu_epi16(first_words(n - 32), words + 32);
  const WindowPermutes& perm = window_permutes(W);
  const __m512i taps01 = _mm512_permutex2var_epi16(lo, perm.to_taps[0], hi);  // windows' inputs 0 and 1
  const __m512i taps23 = _mm512_permutex2var_epi16(lo, perm.to_taps[1], hi);  // 2 and 3
  __m256i raw[5] = {};  // each tap's 16 words
  raw[0] = _mm512_castsi512_si256(taps01);
  raw[1] = _mm512_extracti64x4_epi64(taps01, 1);
  raw[2] = _mm512_castsi512_si256(taps23);
  raw[3] = _mm512_extracti64x4_epi64(taps23, 1);
  raw[W] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));  // the new input is the last tap
  __m512 tap[1][9];
  for (int64_t k = 0; k <= W; ++k) tap[0][k] = stateserve_simd::widen_bf16(raw[k]);
  conv_16_channels(tap, W, wt, ldw, bias, float_accumulate, y);
  // shifted windows: inputs 1..W (raw[W] is the new one), back to channel-major
  const __m512i next01 = _mm512_inserti64x4(_mm512_castsi256_si512(raw[1]), raw[2], 1);
  const __m512i next23 = _mm512_inserti64x4(_mm512_castsi256_si512(raw[3]), raw[4], 1);
  _mm512_mask_storeu_epi16(words, first_words(n), _mm512_permutex2var_epi16(next01, perm.to_channels[0], next23));
  if (n > 32)
    _mm512_mask_storeu_epi16(words + 32, first_words(n - 32),
                             _mm512_permutex2var_epi16(next01, perm.to_channels[1], next23));
  return true;
}
#endif

}  // namespace

namespace {

template <typename T>
void conv_update_rows(T* st, const int64_t* sl, const T* xp, const float* wtp, const float* bias_p, int64_t S,
                      int64_t C, int64_t W, bool float_accumulate, const ConvOut<T>& out) {
  constexpr int64_t kBlock = 16;  // channels per task: one AVX-512 vector (two AVX2 ones)
  const int64_t num_blocks = (C + kBlock - 1) / kBlock;
  at::parallel_for(0, S * num_blocks, rows_grain(kBlock * (W + 1), 8), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_blocks, c0 = (task % num_blocks) * kBlock;
      const int64_t n = std::min(kBlock, C - c0);
      T* rows = st + (sl[s] * C + c0) * W;  // n consecutive channels' windows, W each
      const T* xs = xp + s * C + c0;
      const ConvOut<T> y = out.at(s * C + c0);
      const float* bias_c = bias_p ? bias_p + c0 : nullptr;
#if SS_HAS_AVX512_BW
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (n == kBlock && conv_update_bf16_small_window(rows, xs, wtp + c0, bias_c, C, W, float_accumulate, y))
          continue;  // conv and shift done
      }
#endif
      if (n != kBlock || !conv_update_simd<T>(rows, xs, wtp + c0, bias_c, C, W, float_accumulate, y)) {
        for (int64_t j = 0; j < n; ++j) {
          const T* row = rows + j * W;
          float acc = 0.f;
          for (int64_t k = 0; k <= W; ++k) {
            const float v = static_cast<float>(k < W ? row[k] : xs[j]);
            const float prod = v * wtp[k * C + c0 + j];
            acc += float_accumulate ? prod : round_to<T>(prod);
          }
          const float bias_v = bias_c ? bias_c[j] : 0.f;
          y.put(j, float_accumulate ? acc + bias_v : round_to<T>(acc) + bias_v);
        }
      }
      if (W > 0) {  // shift each window left by one and append the new input: the n windows are contiguous, so
        // one move of the whole run, then each window's last element (which got the next window's first) is set
        std::memmove(rows, rows + 1, (n * W - 1) * sizeof(T));
        for (int64_t j = 0; j < n; ++j) rows[j * W + W - 1] = xs[j];
      }
    }
  });
}

}  // namespace

// Depthwise causal conv over the last K inputs of each sequence, shifting the conv state in place.
// conv_state: [num_slots, C, K-1]; x: [S, C], conv_state's dtype; taps: the conv weight as float32 [K, C] (transposed,
// so 16 channels' taps are one vector load; the caller caches it per weight version); bias: [C] float32 holding
// values of x's dtype, or empty.
// float_accumulate: products and bias summed in float32, rounded once (F.conv1d). Otherwise as the PyTorch
// expression (window * weight).sum(-1) + bias: each product rounded, the sum rounded, then the bias add.
// output: what is returned, y ([S, C] in x's dtype), its SiLU in x's dtype, or that SiLU as float32.
at::Tensor conv1d_update(at::Tensor conv_state, at::Tensor slots, at::Tensor x, at::Tensor taps,
                            c10::optional<at::Tensor> bias, bool float_accumulate, ConvOutput output) {
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.scalar_type() == x.scalar_type(),
              "conv1d_update_: conv_state and x must share a dtype (conv_state contiguous)");
  TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.dim() == 2 && taps.is_contiguous(),
              "conv1d_update_: taps must be contiguous float32 [K, C]");
  x = x.contiguous();
  auto slot_ids = slots.scalar_type() == at::kLong ? slots.contiguous() : slots.to(at::kLong).contiguous();
  const int64_t S = x.size(0), C = x.size(1), K = taps.size(0), W = conv_state.size(2);
  TORCH_CHECK(W == K - 1 && conv_state.size(1) == C && taps.size(1) == C, "conv1d_update_: shapes do not agree");
  TORCH_CHECK(slot_ids.numel() == S, "conv1d_update_: ", slot_ids.numel(), " slots for ", S, " rows");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == C && bias->is_contiguous(),
                "conv1d_update_: bias must be contiguous float32 [C]");
  const bool to_float32 = output == ConvOutput::kSiluFloat32;
  auto y = to_float32 ? at::empty(x.sizes(), x.options().dtype(at::kFloat)) : at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv1d_update_", [&] {
    const ConvOut<scalar_t> out{output, to_float32 ? nullptr : y.data_ptr<scalar_t>(),
                                to_float32 ? y.data_ptr<float>() : nullptr};
    conv_update_rows<scalar_t>(conv_state.data_ptr<scalar_t>(), slot_ids.data_ptr<int64_t>(), x.data_ptr<scalar_t>(),
                               taps.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr, S, C, W,
                               float_accumulate, out);
  });
  return y;
}

// The binding: y, or with silu_float32 its SiLU (rounded to x's dtype, as F.silu on y would) as float32.
at::Tensor conv1d_update_(at::Tensor conv_state, at::Tensor slots, at::Tensor x, at::Tensor taps,
                             c10::optional<at::Tensor> bias, bool float_accumulate, bool silu_float32) {
  return conv1d_update(conv_state, slots, x, taps, bias, float_accumulate,
                       silu_float32 ? ConvOutput::kSiluFloat32 : ConvOutput::kConv);
}
