// Mamba2 prefill: the SSD recurrence of one sequence's chunk, sequential in time.
// S_t[h] = exp(dt_t[h] * A[h]) * S_{t-1}[h] + (x_t[h] * dt_t[h]) B_t[g]^T;  y_t[h] = S_t[h] C_t[g] + D[h] x_t[h].
// The chunked (quadratic) form that GPUs prefer costs ~2x the FLOPs of this recurrence at Q = 64 and many passes
// over [chunks, H, Q, Q] temporaries; on a CPU the recurrence wins.
//
// Rescaled state: with c_t the product of a head's decays since its last reset, U_t = S_t / c_t obeys
// U_t = U_{t-1} + (x_t dt_t / c_t) B_t^T and y_t = c_t (U_t C_t) + D x_t: one multiply-add per state element for
// the update and one for the output (the plain form needs a multiply more). Before c_t leaves [2^-40, 2^40] the
// step folds c into U instead (U_t = c_{t-1} decay_t U_{t-1} + x_t dt_t B_t^T, c_t = 1), so 1 / c_t stays finite.
// Vectors run along the head's channels p, state columns n are broadcast: no horizontal sums. Per 4096-token
// prefill of Mamba2-base (float32, 2 threads) this took the scan from ~7.3 to ~5.1 ms a layer per 2048 tokens.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {
constexpr float kMinScale = 0x1p-40f, kMaxScale = 0x1p40f;

// Per head and token, the rescaled step's factors (each [H, L]): keep multiplies U before the step (1 unless the
// scale is reset), in scales x_t, out = c_t scales the output and turns U back into the state.
struct Factors {
  std::vector<float> keep, in, out;
};

Factors rescale_factors(const float* dtp, const float* Ap, int64_t L, int64_t H) {
  Factors f{std::vector<float>(L * H), std::vector<float>(L * H), std::vector<float>(L * H)};
  // exp(dt * A) of every token and head first, a vector at a time (a scalar exp per token cost as much as the
  // tile's update), into `keep` ([L, H] order here); the per-head pass below only multiplies and divides.
  float* decays = f.keep.data();
  // Every decay goes through the same exp (the chunk's tail too, padded to a vector), so a token's decay, and so
  // a snapshot after it, does not depend on how many tokens follow or where the threads' chunks end.
  at::parallel_for(0, L, 256, [&](int64_t begin, int64_t end) {
#if SS_HAS_SIMD
    using Vec = stateserve_simd::F32Vec;
    constexpr int W = Vec::kWidth;
    for (int64_t i = begin * H; i < end * H; i += W) {
      const int64_t n = std::min<int64_t>(W, end * H - i);
      alignas(64) float a[W] = {}, d[W] = {};
      for (int j = 0; j < n; ++j) a[j] = Ap[(i + j) % H], d[j] = dtp[i + j];
      Vec::store(d, stateserve_simd::exp_ps(Vec::mul(Vec::load(d), Vec::load(a))));
      std::copy(d, d + n, decays + i);
    }
#else
    for (int64_t i = begin * H; i < end * H; ++i) decays[i] = std::exp(dtp[i] * Ap[i % H]);
#endif
  });
  std::vector<float> decay_t(L * H);  // [H, L]: a head's decays in a row
  for (int64_t t = 0; t < L; ++t)
    for (int64_t h = 0; h < H; ++h) decay_t[h * L + t] = decays[t * H + h];
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      float c = 1.f;
      for (int64_t t = 0; t < L; ++t) {
        const float next = c * decay_t[h * L + t];
        const bool reset = !(next >= kMinScale && next <= kMaxScale);
        f.keep[h * L + t] = reset ? next : 1.f;
        c = reset ? 1.f : next;
        f.in[h * L + t] = dtp[t * H + h] / c;
        f.out[h * L + t] = c;
      }
    }
  });
  return f;
}

struct Strides {
  int64_t x, bc;  // token strides of x and of B / C (floats)
};

#if SS_HAS_SIMD
// Tokens t0 .. t1-1 of kWidth = W * kVecs channels (p0 ..) of head h against kCols state columns (n0 ..), with W
// the lanes of Vec (16 with AVX-512, 8 with AVX2): kCols * kVecs state vectors in registers, each broadcast column
// value feeds kVecs multiply-adds. u: the tile's first channel in the task's rescaled state, transposed (column n
// at u + n * ldu). first: this column tile writes y (with the skip term), later tiles add to it.
template <typename Vec, int kVecs, int kCols>
void scan_tile(float* u, int64_t ldu, const float* xp, const float* Bp, const float* Cp, const float* keep,
               const float* in, const float* out, float* yp, float* snaps, const int64_t* want, int64_t t0,
               int64_t t1, int64_t H, int64_t P, int64_t N, int64_t h, int64_t g, int64_t p0, int64_t n0, Strides st,
               const float* skip, bool first) {
  using V = typename Vec::V;
  constexpr int W = Vec::kWidth, kWidth = W * kVecs;
  V s[kCols][kVecs];
  for (int j = 0; j < kCols; ++j)
    for (int v = 0; v < kVecs; ++v) s[j][v] = Vec::load(u + (n0 + j) * ldu + W * v);
  for (int64_t t = t0; t < t1; ++t) {
    if (keep[t] != 1.f) {
      const V k = Vec::set1(keep[t]);
      for (int j = 0; j < kCols; ++j)
        for (int v = 0; v < kVecs; ++v) s[j][v] = Vec::mul(s[j][v], k);
    }
    const float* xt = xp + t * st.x + h * P + p0;
    const float* b = Bp + t * st.bc + g * N + n0;
    const float* c = Cp + t * st.bc + g * N + n0;
    V xs[kVecs], acc[kVecs][2];
    for (int v = 0; v < kVecs; ++v) {
      xs[v] = Vec::mul(Vec::load(xt + W * v), Vec::set1(in[t]));
      acc[v][0] = acc[v][1] = Vec::zero();
    }
    for (int j = 0; j < kCols; ++j) {
      const V bj = Vec::set1(b[j]), cj = Vec::set1(c[j]);
      for (int v = 0; v < kVecs; ++v) {
        s[j][v] = Vec::fmadd(xs[v], bj, s[j][v]);
        acc[v][j % 2] = Vec::fmadd(s[j][v], cj, acc[v][j % 2]);
      }
    }
    float* yt = yp + (t * H + h) * P + p0;
    for (int v = 0; v < kVecs; ++v) {
      V yv = Vec::mul(Vec::add(acc[v][0], acc[v][1]), Vec::set1(out[t]));
      if (!first) yv = Vec::add(yv, Vec::load(yt + W * v));
      else if (skip) yv = Vec::fmadd(Vec::set1(*skip), Vec::load(xt + W * v), yv);
      Vec::store(yt + W * v, yv);
    }
    if (want[t + 1] >= 0) {  // the true state c_t U_t, back in [P, N] order
      alignas(64) float cols[kCols][kWidth];
      for (int j = 0; j < kCols; ++j)
        for (int v = 0; v < kVecs; ++v) Vec::store(cols[j] + W * v, Vec::mul(s[j][v], Vec::set1(out[t])));
      float* dst = snaps + (want[t + 1] * H * P + h * P + p0) * N + n0;
      for (int r = 0; r < kWidth; ++r)
        for (int j = 0; j < kCols; ++j) dst[r * N + j] = cols[j][r];
    }
  }
  for (int j = 0; j < kCols; ++j)
    for (int v = 0; v < kVecs; ++v) Vec::store(u + (n0 + j) * ldu + W * v, s[j][v]);
}

// A task's rows (block: [rows, N], updated in place) through scan_tile, if its shape has a tile: 16 state vectors
// in registers with AVX-512's 32, 8 with AVX2's 16; tiles two vectors wide where rows and N allow, else one.
// u: scratch for the rescaled state, transposed. Returns false (nothing done) when no tile fits.
template <typename Vec>
bool scan_rows_in_tiles(float* block, float* u, int64_t rows, const float* xp, const float* Bp, const float* Cp,
                        const float* keep, const float* in, const float* out, float* yp, float* snaps,
                        const int64_t* want, int64_t L, int64_t H, int64_t P, int64_t N, int64_t h, int64_t g,
                        int64_t p0, Strides st, const float* skip) {
  constexpr int W = Vec::kWidth, kStateVecs = W == 16 ? 16 : 8;
  const int kVecs = rows % (2 * W) == 0 && N % (kStateVecs / 2) == 0 ? 2
                    : rows % W == 0 && N % kStateVecs == 0          ? 1
                                                                    : 0;
  if (kVecs == 0) return false;
  const int kCols = kStateVecs / kVecs;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) u[n * rows + r] = block[r * N + n];
  // Token rows of x and y are H * P floats apart (a new page per token): the tiles take kTokens tokens in turn,
  // so those tokens' pages are reused by every tile while they are hot.
  constexpr int64_t kTokens = 128;
  for (int64_t t0 = 0; t0 < L; t0 += kTokens)
    for (int64_t q = 0; q < rows; q += W * kVecs)
      for (int64_t n0 = 0; n0 < N; n0 += kCols)
        (kVecs == 2 ? scan_tile<Vec, 2, kStateVecs / 2> : scan_tile<Vec, 1, kStateVecs>)(
            u + q, rows, xp, Bp, Cp, keep, in, out, yp, snaps, want, t0, std::min(L, t0 + kTokens), H, P, N, h, g,
            p0 + q, n0, st, skip, n0 == 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < N; ++n) block[r * N + n] = out[L - 1] * u[n * rows + r];
  return true;
}
#endif
}  // namespace

// x: [L, H, P], dt: [L, H] (after softplus and clamp), B, C: [L, G, N], A, D: [H] (D may be empty), h0: [H, P, N]
// or empty (zeros); all float32; x, B and C may have any token stride. offsets: token counts (1..L) after which
// the state is wanted. Returns (y [L, H, P], final state [H, P, N], states after each offset [num_offsets, H, P, N]).
std::vector<at::Tensor> ssd_scan_fwd(at::Tensor x, at::Tensor dt, at::Tensor A, at::Tensor B,
                                        at::Tensor C, c10::optional<at::Tensor> D,
                                        c10::optional<at::Tensor> h0, std::vector<int64_t> offsets) {
  for (const auto* t : {&x, &dt, &A, &B, &C})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ssd_scan_fwd: float32 inputs");
  TORCH_CHECK(x.dim() == 3 && B.dim() == 3, "ssd_scan_fwd: x [L, H, P] and B, C [L, G, N]");
  // Token rows may be views into a wider buffer (the conv's output); within a token they must be dense.
  auto rows_dense = [](const at::Tensor& t) { return t.stride(2) == 1 && t.stride(1) == t.size(2); };
  if (!rows_dense(x)) x = x.contiguous();
  if (!rows_dense(B) || !rows_dense(C) || B.stride(0) != C.stride(0)) B = B.contiguous(), C = C.contiguous();
  dt = dt.contiguous(), A = A.contiguous();
  const int64_t L = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  TORCH_CHECK(dt.size(0) == L && dt.size(1) == H && A.numel() == H && B.size(0) == L && C.sizes() == B.sizes() &&
                  G >= 1 && H % G == 0,
              "ssd_scan_fwd: shapes do not agree");
  for (int64_t off : offsets) TORCH_CHECK(off >= 1 && off <= L, "ssd_scan_fwd: offset ", off, " outside 1..", L);
  auto state = (h0.has_value() && h0->defined()) ? h0->to(at::kFloat).contiguous().clone()
                                                 : at::zeros({H, P, N}, x.options());
  TORCH_CHECK(state.numel() == H * P * N, "ssd_scan_fwd: initial state is not [H, P, N]");
  at::Tensor Dv;
  if (D.has_value() && D->defined()) Dv = D->to(at::kFloat).contiguous();
  auto y = at::empty({L, H, P}, x.options());
  auto snaps = at::empty({static_cast<int64_t>(offsets.size()), H, P, N}, x.options());
  std::vector<int64_t> want(L + 1, -1);  // want[t] = index of the snapshot taken after t tokens
  for (size_t i = 0; i < offsets.size(); ++i) want[offsets[i]] = static_cast<int64_t>(i);
  if (L == 0) return {y, state, snaps};

  const Strides st{x.stride(0), B.stride(0)};
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  const float* Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>(), *snp = snaps.data_ptr<float>();
  const int64_t heads_per_group = H / G;
  const Factors f = rescale_factors(dtp, Ap, L, H);

  // A task is kRows channels of one head (kRows x N floats: 8 KB at N = 64, in L1 while all tokens stream past).
  constexpr int64_t kRows = 32;
  const int64_t blocks_per_head = (P + kRows - 1) / kRows;
  at::parallel_for(0, H * blocks_per_head, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> u(N * kRows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks_per_head, p0 = (task % blocks_per_head) * kRows;
      const int64_t rows = std::min(kRows, P - p0), g = h / heads_per_group;
      float* block = sp + (h * P + p0) * N;  // rows p0 .. p0+rows-1 of head h, updated in place
      const float skip = Dp ? Dp[h] : 0.f;
      const float *keep = f.keep.data() + h * L, *in = f.in.data() + h * L, *out = f.out.data() + h * L;
#if SS_HAS_SIMD
      if (scan_rows_in_tiles<stateserve_simd::F32Vec>(block, u.data(), rows, xp, Bp, Cp, keep, in, out, yp, snp,
                                                      want.data(), L, H, P, N, h, g, p0, st, Dp ? &skip : nullptr))
        continue;
#endif
      // Any shape: the plain recurrence, a row at a time.
      for (int64_t t = 0; t < L; ++t) {
        const float d = dtp[t * H + h];
        const float decay = std::exp(d * Ap[h]);
        const float* b = Bp + t * st.bc + g * N;
        const float* c = Cp + t * st.bc + g * N;
        const float* xt = xp + t * st.x + h * P + p0;
        float* yt = yp + (t * H + h) * P + p0;
        for (int64_t r = 0; r < rows; ++r) {
          const float acc = stateserve_simd::ssd_row_update(block + r * N, decay, xt[r] * d, b, c, N);
          yt[r] = Dp ? acc + skip * xt[r] : acc;
        }
        if (want[t + 1] >= 0)
          std::copy(block, block + rows * N, snp + (want[t + 1] * H * P + h * P + p0) * N);
      }
    }
  });
  return {y, state, snaps};
}
