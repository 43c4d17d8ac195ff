// Load-time Q4_K quantization, bit for bit llama.cpp's quantize_row_q4_K_ref (ggml-quants.c) with its
// make_qkx2_quants(32, 15, x, weights, L, &min, Laux, -1, 0.1, 20, false) search for each sub-block's scale and min:
// the same fields as quantization/q4.py's quantize_q4_k (its PyTorch path, the fallback), many times faster.
//
// Exactness: the reference is C compiled without contraction (every product rounded before it is added), with
// sequential sums, true divisions, sqrtf and the magic-number nearest_int. Here the SIMD lanes are different
// sub-blocks, so each lane runs the C sequence of one sub-block, position after position, in the same order. Every
// product goes through mul(), whose result passes an empty asm statement: the compiler cannot see it as a product,
// so no flag (-ffp-contract=fast is GCC's default for C++, and -march=native enables FMA) can fuse it into an FMA.
// Nothing else here may be reassociated (no -ffast-math), divisions stay divisions, and the vector sqrt is
// correctly rounded as sqrtf is. Comparisons are the ordered ones C's < > == are, so NaN lanes take C's branches.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include "isa.h"
#include "kernels.h"
#include "simd.h"  // (SIMD builds: F32Vec, its register transpose)

namespace {

// v unchanged, but opaque to the optimiser: a product passed through this is never contracted with the addition
// that consumes it (ggml's arithmetic rounds the product first).
template <typename T>
inline T opaque(T v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));  // any SSE/AVX register (xmm/ymm/zmm 0-31 with AVX-512)
#elif defined(__aarch64__)
  asm("" : "+w"(v));  // any FP/SIMD register
#else
  volatile T kept = v;
  v = kept;
#endif
  return v;
}

constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: ggml's nearest_int adds it and reads the low mantissa bits

// ggml's nearest_int on the float's bits (also where |v| >= 2^22, inf or NaN, as the C computes it).
inline int32_t nearest_int(float v) {
  const float t = v + kMagic;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  return (bits & 0x007FFFFF) - 0x00400000;
}

inline float fmul(float a, float b) { return opaque(a * b); }

// ---- lanes: one sub-block each. F a vector of floats, M a lane mask; the operations C's float code uses: simd.h's
// F32Vec where the build has vectors, and what only this quantizer needs beside it: the product that no flag may
// contract, C's ordered compares as lane masks, and the codes.
#if SS_HAS_SIMD
struct Lanes : stateserve_simd::F32Vec {
  using Vec = stateserve_simd::F32Vec;
  using F = Vec::V;
  using M = Vec::Mask;
  static F mul(F a, F b) { return opaque(Vec::mul(a, b)); }  // (hides F32Vec's mul)
#if SS_HAS_AVX512
  static M lt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static M eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static M both(M a, M b) { return static_cast<M>(a & b); }
  static bool any(M m) { return m != 0; }
  // MAX(0, MIN(nmax, nearest_int(v))) as a float
  static F codes(F v, int nmax) {
    __m512i i = _mm512_castps_si512(_mm512_add_ps(v, _mm512_set1_ps(kMagic)));
    i = _mm512_sub_epi32(_mm512_and_si512(i, _mm512_set1_epi32(0x007FFFFF)), _mm512_set1_epi32(0x00400000));
    i = _mm512_min_epi32(_mm512_max_epi32(i, _mm512_setzero_si512()), _mm512_set1_epi32(nmax));
    return _mm512_cvtepi32_ps(i);
  }
#else
  static M lt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static M eq(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static M both(M a, M b) { return _mm256_and_ps(a, b); }
  static bool any(M m) { return _mm256_movemask_ps(m) != 0; }
  static F codes(F v, int nmax) {
    __m256i i = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(kMagic)));
    i = _mm256_sub_epi32(_mm256_and_si256(i, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x00400000));
    i = _mm256_min_epi32(_mm256_max_epi32(i, _mm256_setzero_si256()), _mm256_set1_epi32(nmax));
    return _mm256_cvtepi32_ps(i);
  }
#endif
};
#else
struct Lanes {  // the portable loops: one sub-block at a time, C's own statements
  static constexpr int kWidth = 1;
  using F = float;
  using M = bool;
  static F set1(float v) { return v; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return fmul(a, b); }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F abs(F a) { return std::fabs(a); }
  static F neg(F a) { return -a; }
  static M lt(F a, F b) { return a < b; }
  static M gt(F a, F b) { return a > b; }
  static M eq(F a, F b) { return a == b; }
  static M both(M a, M b) { return a && b; }
  static bool any(M m) { return m; }
  static F select(M m, F yes, F no) { return m ? yes : no; }
  static F codes(F v, int nmax) { return static_cast<float>(std::max(0, std::min(nmax, nearest_int(v)))); }
};
#endif

using V = Lanes;
using F = V::F;
constexpr int kLanes = V::kWidth;
constexpr int kQK = 256;  // values per super-block
constexpr int kSub = 32;  // values per sub-block
constexpr int kNmax = 15;
constexpr int kSteps = 20;  // make_qkx2_quants' nstep: candidates is = 0 .. 20
// super-blocks quantized together: 16 lanes take two super-blocks' 8 sub-blocks, 8 lanes one, 1 lane one (in 8 runs)
constexpr int kGroupSuper = kLanes > 8 ? kLanes / 8 : 1;
constexpr int kGroupSub = kGroupSuper * 8;

// make_qkx2_quants' candidate numerators rmin + rdelta*is + nmax, in the C's float steps.
struct Numerators {
  float v[kSteps + 1];
  Numerators() {
    for (int is = 0; is <= kSteps; ++is) {
      v[is] = (-1.f + fmul(0.1f, static_cast<float>(is))) + static_cast<float>(kNmax);
    }
  }
};

// kLanes sub-blocks, position-major: x[i][lane] is value i of the lane's sub-block.
struct alignas(64) Tile {
  float x[kSub][kLanes];
  float w[kSub][kLanes];
  float L[kSub][kLanes];    // the best codes so far
  float aux[kSub][kLanes];  // the candidate's codes (C's Laux)
  float scale[kLanes];
  float the_min[kLanes];
};

// Sub-blocks s = 0 .. n-1 of x (32 values each, one after the other) into the tile's lanes, lanes from n on zero.
void load_tile(Tile& t, const float* x, int n) {
#if SS_HAS_SIMD
  for (int i0 = 0; i0 < kSub; i0 += kLanes) {  // a square of kLanes sub-blocks x kLanes positions at a time
    F r[kLanes];
    for (int s = 0; s < kLanes; ++s) r[s] = s < n ? V::load(x + s * kSub + i0) : V::zero();
    V::transpose(r);
    for (int i = 0; i < kLanes; ++i) V::store(t.x[i0 + i], r[i]);
  }
#else
  for (int i = 0; i < kSub; ++i) t.x[i][0] = n > 0 ? x[i] : 0.f;
#endif
}

// The weights of quantize_row_q4_K_ref, then make_qkx2_quants, for the tile's lanes: t.L, t.scale and t.the_min.
void quantize_tile(Tile& t, const Numerators& num) {
  const F zero = V::set1(0.f);
  F sum_x2 = zero;
  for (int i = 0; i < kSub; ++i) {
    const F xi = V::load(t.x[i]);
    sum_x2 = V::add(sum_x2, V::mul(xi, xi));
  }
  const F av_x = V::sqrt(V::div(sum_x2, V::set1(32.f)));
  for (int i = 0; i < kSub; ++i) V::store(t.w[i], V::add(av_x, V::abs(V::load(t.x[i]))));

  F mn = V::load(t.x[0]), mx = mn;
  F sum_w = V::load(t.w[0]);
  F sum_x = V::mul(sum_w, mn);
  for (int i = 1; i < kSub; ++i) {
    const F xi = V::load(t.x[i]), wi = V::load(t.w[i]);
    mn = V::select(V::lt(xi, mn), xi, mn);
    mx = V::select(V::gt(xi, mx), xi, mx);
    sum_w = V::add(sum_w, wi);
    sum_x = V::add(sum_x, V::mul(wi, xi));
  }
  mn = V::select(V::gt(mn, zero), zero, mn);
  const F lo = mn;
  const auto flat = V::eq(mx, mn);  // C returns here: codes 0, scale 0, the_min -min

  F iscale = V::div(V::set1(static_cast<float>(kNmax)), V::sub(mx, mn));
  F scale = V::div(V::set1(1.f), iscale);
  F best = zero;
  for (int i = 0; i < kSub; ++i) {
    const F xi = V::load(t.x[i]);
    const F l = V::codes(V::mul(iscale, V::sub(xi, mn)), kNmax);
    V::store(t.L[i], l);
    const F diff = V::sub(V::add(V::mul(scale, l), mn), xi);
    best = V::add(best, V::mul(V::load(t.w[i]), V::mul(diff, diff)));
  }
  for (int is = 0; is <= kSteps; ++is) {
    // the running min: once a candidate wins, the next ones quantize x - that min
    iscale = V::div(V::set1(num.v[is]), V::sub(mx, mn));
    F sum_l = zero, sum_l2 = zero, sum_xl = zero;
    for (int i = 0; i < kSub; ++i) {
      const F xi = V::load(t.x[i]);
      const F l = V::codes(V::mul(iscale, V::sub(xi, mn)), kNmax);
      V::store(t.aux[i], l);
      const F wl = V::mul(V::load(t.w[i]), l);
      sum_l = V::add(sum_l, wl);
      sum_l2 = V::add(sum_l2, V::mul(wl, l));
      sum_xl = V::add(sum_xl, V::mul(wl, xi));
    }
    const F D = V::sub(V::mul(sum_w, sum_l2), V::mul(sum_l, sum_l));
    const auto solvable = V::gt(D, zero);
    if (!V::any(solvable)) continue;
    F this_scale = V::div(V::sub(V::mul(sum_w, sum_xl), V::mul(sum_x, sum_l)), D);
    F this_min = V::div(V::sub(V::mul(sum_l2, sum_x), V::mul(sum_l, sum_xl)), D);
    const auto positive = V::gt(this_min, zero);
    this_min = V::select(positive, zero, this_min);
    this_scale = V::select(positive, V::div(sum_xl, sum_l2), this_scale);
    F cur = zero;
    for (int i = 0; i < kSub; ++i) {
      const F diff = V::sub(V::add(V::mul(this_scale, V::load(t.aux[i])), this_min), V::load(t.x[i]));
      cur = V::add(cur, V::mul(V::load(t.w[i]), V::mul(diff, diff)));
    }
    const auto better = V::both(solvable, V::lt(cur, best));
    if (!V::any(better)) continue;
    for (int i = 0; i < kSub; ++i) V::store(t.L[i], V::select(better, V::load(t.aux[i]), V::load(t.L[i])));
    best = V::select(better, cur, best);
    scale = V::select(better, this_scale, scale);
    mn = V::select(better, this_min, mn);
  }
  if (V::any(flat)) {
    for (int i = 0; i < kSub; ++i) V::store(t.L[i], V::select(flat, zero, V::load(t.L[i])));
  }
  V::store(t.scale, V::select(flat, zero, scale));
  V::store(t.the_min, V::neg(V::select(flat, lo, mn)));
}

// One super-block's fields from its sub-blocks' search results (scales, mins: 8 each; codes: each sub-block's 32
// search codes at sub_codes(j, i)): the 6-bit scales against the largest, d and dmin in float16, and every value
// coded again with the stored scales (a sub-block whose d is 0 keeps the search's codes).
template <typename Codes>
void finish_super_block(const float* x, const float* scales, const float* mins, Codes sub_codes, uint8_t* codes,
                        c10::Half* d_out, c10::Half* dmin_out, uint8_t* sc_out, uint8_t* mn_out) {
  float max_scale = 0.f, max_min = 0.f;
  for (int j = 0; j < 8; ++j) {
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  for (int j = 0; j < 8; ++j) {
    // C stores nearest_int in a uint8_t (mod 256), then takes MIN(63, .)
    sc_out[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(fmul(inv_scale, scales[j]))));
    mn_out[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(fmul(inv_min, mins[j]))));
  }
  const c10::Half d16(max_scale / 63.f), dmin16(max_min / 63.f);  // round to nearest even, as GGML_FP32_TO_FP16
  *d_out = d16;
  *dmin_out = dmin16;
  const float d_f = static_cast<float>(d16), dmin_f = static_cast<float>(dmin16);
  for (int j = 0; j < 8; ++j) {
    uint8_t* q = codes + kSub * j;
    const float d = fmul(d_f, static_cast<float>(sc_out[j]));
    if (!d) {
      for (int i = 0; i < kSub; ++i) q[i] = static_cast<uint8_t>(sub_codes(j, i));
      continue;
    }
    const float dm = fmul(dmin_f, static_cast<float>(mn_out[j]));
    const float* xs = x + kSub * j;
    const F dm_v = V::set1(dm), d_v = V::set1(d);
    alignas(64) float l[kLanes];
    for (int i = 0; i < kSub; i += kLanes) {
      V::store(l, V::codes(V::div(V::add(V::load(xs + i), dm_v), d_v), kNmax));
      for (int k = 0; k < kLanes; ++k) q[i + k] = static_cast<uint8_t>(l[k]);
    }
  }
}

}  // namespace

// w float32 [N, K] (K a multiple of 256) -> [codes uint8 [N, K] (0..15), d float16 [N, K/256], dmin float16
// [N, K/256], sc uint8 [N, K/32] (0..63), mn uint8 [N, K/32]]: llama.cpp's quantize_row_q4_K_ref on every row,
// w ~ (d*sc)*codes - dmin*mn (quantization/q4.py's quantize_q4_k).
std::vector<at::Tensor> q4_k_quantize(at::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2,
              "q4_k_quantize: w must be a 2-D float32 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % kQK == 0, "q4_k_quantize: K = ", K, " is not a multiple of ", kQK);
  const at::Tensor x = w.contiguous();
  const auto u8 = x.options().dtype(at::kByte), f16 = x.options().dtype(at::kHalf);
  at::Tensor codes = at::empty({N, K}, u8), d = at::empty({N, K / kQK}, f16), dmin = at::empty({N, K / kQK}, f16);
  at::Tensor sc = at::empty({N, K / kSub}, u8), mn = at::empty({N, K / kSub}, u8);
  const int64_t supers = N * K / kQK, groups = (supers + kGroupSuper - 1) / kGroupSuper;
  const float* src = x.data_ptr<float>();
  uint8_t* codes_p = codes.data_ptr<uint8_t>();
  c10::Half* d_p = d.data_ptr<c10::Half>();
  c10::Half* dmin_p = dmin.data_ptr<c10::Half>();
  uint8_t* sc_p = sc.data_ptr<uint8_t>();
  uint8_t* mn_p = mn.data_ptr<uint8_t>();
  const Numerators num;
  at::parallel_for(0, groups, 8, [&](int64_t begin, int64_t end) {
    Tile t;
    float scales[kGroupSub], mins[kGroupSub];
    constexpr int kRuns = kGroupSub / kLanes;  // tiles per group: 1, or 8 of one lane in the portable build
    alignas(64) float search[kRuns > 1 ? kGroupSub : 1][kSub];  // the tiles' codes when there are several
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * kGroupSuper;
      const int in_group = static_cast<int>(std::min<int64_t>(kGroupSuper, supers - first));
      const float* xg = src + first * kQK;
      const int subs = in_group * 8;  // sub-blocks present (a last group of two super-blocks may hold one)
      for (int run = 0; run < kRuns; ++run) {
        const int s0 = run * kLanes;
        load_tile(t, xg + s0 * kSub, std::max(0, std::min(kLanes, subs - s0)));
        quantize_tile(t, num);
        for (int lane = 0; lane < kLanes; ++lane) {
          scales[s0 + lane] = t.scale[lane];
          mins[s0 + lane] = t.the_min[lane];
          if (kRuns > 1) {  // the next run reuses the tile
            for (int i = 0; i < kSub; ++i) search[s0 + lane][i] = t.L[i][lane];
          }
        }
      }
      for (int b = 0; b < in_group; ++b) {
        const int64_t sb = first + b;
        // the search codes of sub-block j (wanted only where its d is 0)
        const auto sub_codes = [&](int j, int i) {
          const int s = 8 * b + j;
          return kRuns > 1 ? search[s][i] : t.L[i][s];
        };
        finish_super_block(xg + b * kQK, scales + 8 * b, mins + 8 * b, sub_codes, codes_p + sb * kQK, d_p + sb,
                           dmin_p + sb, sc_p + sb * 8, mn_p + sb * 8);
      }
    }
  });
  return {codes, d, dmin, sc, mn};
}
