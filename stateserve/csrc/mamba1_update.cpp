// One decode token of Mamba1's selective SSM for S sequences, each float32 state [D, N] updated in place in its
// slot, fused with what surrounds it in transformers' step: dt = softplus(dt_raw + dt_bias) before, the C
// product, the D skip and the SiLU gate after. Every step is rounded to the model dtype T (float32 or bfloat16)
// where the PyTorch path (selective_scan.selective_state_update) rounds it; the stored state is float32.
// Why a block of 16 channels at a time: with d_state = 16 a channel's state row is one vector, and per channel
// the update is a short dependent chain (exp, update, product with C, horizontal sum, a scalar SiLU) that left
// the core waiting (~28 us a layer for Mamba-base in float32, 42 in bfloat16). 16 channels side by side give 16
// independent chains, one transpose-and-add for their 16 sums, and the gate on whole vectors (8 with AVX2).
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include "kernels.h"
#include "simd.h"

namespace {

using stateserve_simd::round_to;

struct Mamba1Args {
  float* states;            // [num_slots, D, N]
  const int64_t* slots;     // [S]
  const float* A;           // [D, N]
  int64_t D, N;
  int64_t ld_u, ld_dt, ld_b, ld_c, ld_z;  // row strides of u, dt_raw, B, C, z
};

// Channels [d0, d0 + kBlock) of sequence s, N a multiple of kBlock.
#if SS_HAS_SIMD
constexpr int64_t kBlock = stateserve_simd::F32Vec::kWidth;  // 16 with AVX-512, 8 with AVX2
#else
constexpr int64_t kBlock = 16;
#endif
template <typename T>
void update_block(const Mamba1Args& a, int64_t s, int64_t d0, const T* u, const T* dt_raw, const T* bias,
                  const T* B, const T* C, const T* Dskip, const T* z, T* out) {
#if SS_HAS_SIMD
  using namespace stateserve_simd;
  using Vec = F32Vec;
  using V = Vec::V;
  constexpr int W = Vec::kWidth;
  const V raw = Vec::load_from(dt_raw + s * a.ld_dt + d0), uv = Vec::load_from(u + s * a.ld_u + d0);
  const V dtv = round_to_ps<T>(softplus_ps(round_to_ps<T>(Vec::add(raw, Vec::load_from(bias + d0)))));
  alignas(64) float dts[W], us[W];
  Vec::store(dts, dtv);
  Vec::store(us, uv);
  const T* b = B + s * a.ld_b;
  const T* c = C + s * a.ld_c;
  V acc[W];
  for (int j = 0; j < W; ++j) {
    const V dj = Vec::set1(dts[j]), uj = Vec::set1(us[j]);
    const float* arow = a.A + (d0 + j) * a.N;
    float* row = a.states + (a.slots[s] * a.D + d0 + j) * a.N;
    V sum = Vec::zero();
    for (int64_t n = 0; n < a.N; n += W) {
      // h * exp(dt * A) + (dt * B) * u, the association of the PyTorch path
      const V decay = stateserve_simd::exp_ps(Vec::mul(dj, Vec::load(arow + n)));
      const V inject = Vec::mul(Vec::mul(dj, Vec::load_from(b + n)), uj);
      const V h = Vec::add(Vec::mul(Vec::load(row + n), decay), inject);
      Vec::store(row + n, h);
      sum = Vec::fmadd(round_to_ps<T>(h), Vec::load_from(c + n), sum);  // the matmul in T reads the rounded state
    }
    acc[j] = sum;
  }
  const V y = round_to_ps<T>(Vec::reduce(acc));  // lane j: channel d0 + j
  const V skip = round_to_ps<T>(Vec::mul(uv, Vec::load_from(Dskip + d0)));
  const V gate = silu_rounded_ps<T>(Vec::load_from(z + s * a.ld_z + d0));
  Vec::store_to(out + s * a.D + d0, round_to_ps<T>(Vec::mul(round_to_ps<T>(Vec::add(y, skip)), gate)));
#endif
}

// One channel, scalar (channels past the last block, or N not a multiple of kBlock).
template <typename T>
void update_channel(const Mamba1Args& a, int64_t s, int64_t d, const T* u, const T* dt_raw, const T* bias,
                    const T* B, const T* C, const T* Dskip, const T* z, T* out) {
  const float dv = stateserve_simd::softplus_rounded<T>(
      round_to<T>(static_cast<float>(dt_raw[s * a.ld_dt + d]) + static_cast<float>(bias[d])));
  const float uv = static_cast<float>(u[s * a.ld_u + d]);
  const float* arow = a.A + d * a.N;
  float* row = a.states + (a.slots[s] * a.D + d) * a.N;
  float acc = 0.f;
  for (int64_t n = 0; n < a.N; ++n) {
    const float h = row[n] * std::exp(dv * arow[n]) + (dv * static_cast<float>(B[s * a.ld_b + n])) * uv;
    row[n] = h;
    acc += round_to<T>(h) * static_cast<float>(C[s * a.ld_c + n]);
  }
  const float zv = static_cast<float>(z[s * a.ld_z + d]);
  const float gate = stateserve_simd::silu_rounded<T>(zv);
  const float skip = round_to<T>(uv * static_cast<float>(Dskip[d]));
  out[s * a.D + d] = static_cast<T>(round_to<T>(round_to<T>(acc) + skip) * gate);
}

inline at::Tensor unit_inner_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

// states: [num_slots, D, N] float32; u, dt_raw (before bias and softplus), z: [S, D]; B, C: [S, N]; all five in
// the model dtype T, rows may be strided (views of a projection's output). dt_bias, Dskip: [D], taken in T as
// the PyTorch path's .to(T) does; A: [D, N] float32. Returns (C.h + u * Dskip) * silu(z) as [S, D] in T.
at::Tensor selective_state_update_(at::Tensor states, at::Tensor slots, at::Tensor u,
                                      at::Tensor dt_raw, at::Tensor dt_bias, at::Tensor A,
                                      at::Tensor B, at::Tensor C, at::Tensor Dskip, at::Tensor z) {
  const auto dtype = u.scalar_type();
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous() && states.dim() == 3,
              "selective_state_update_: contiguous float32 states [slots, D, N]");
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && dt_raw.scalar_type() == dtype &&
                  B.scalar_type() == dtype && C.scalar_type() == dtype && z.scalar_type() == dtype,
              "selective_state_update_: u, dt, B, C and z must share a float32 or bfloat16 dtype");
  const int64_t S = u.size(0), Dn = states.size(1), N = states.size(2);
  TORCH_CHECK(u.dim() == 2 && u.size(1) == Dn && dt_raw.sizes() == u.sizes() && z.sizes() == u.sizes() &&
                  B.dim() == 2 && B.size(0) == S && B.size(1) == N && C.sizes() == B.sizes() &&
                  A.dim() == 2 && A.size(0) == Dn && A.size(1) == N && dt_bias.numel() == Dn &&
                  Dskip.numel() == Dn && slots.numel() == S,
              "selective_state_update_: shapes do not agree");
  u = unit_inner_stride(u), dt_raw = unit_inner_stride(dt_raw), z = unit_inner_stride(z);
  B = unit_inner_stride(B), C = unit_inner_stride(C);
  A = A.to(at::kFloat).contiguous();
  dt_bias = dt_bias.to(dtype).contiguous(), Dskip = Dskip.to(dtype).contiguous();
  auto slot_ids = slots.to(at::kLong).contiguous();
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  const int64_t num_slots = states.size(0);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(sl[s] >= 0 && sl[s] < num_slots, "selective_state_update_: slot ", sl[s], " outside the cache");
  auto out = at::empty({S, Dn}, u.options().memory_format(at::MemoryFormat::Contiguous));
  const Mamba1Args args{states.data_ptr<float>(), sl, A.data_ptr<float>(), Dn, N,
                        u.stride(0), dt_raw.stride(0), B.stride(0), C.stride(0), z.stride(0)};
#if SS_HAS_SIMD
  const bool blocks = N % kBlock == 0;
#else
  const bool blocks = false;
#endif
  const int64_t num_blocks = blocks ? Dn / kBlock : 0, per_seq = num_blocks + (Dn - num_blocks * kBlock);
  // a task is a block of channels (or one leftover channel); ~8K state elements a task at least, so a
  // one-token step of a small model runs inline and Mamba-base's (24K) splits over two threads
  const int64_t grain = std::max<int64_t>(1, 8192 / (kBlock * N));
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *up = u.data_ptr<scalar_t>(), *dp = dt_raw.data_ptr<scalar_t>(), *bias = dt_bias.data_ptr<scalar_t>();
    const scalar_t *Bp = B.data_ptr<scalar_t>(), *Cp = C.data_ptr<scalar_t>(), *Dp = Dskip.data_ptr<scalar_t>();
    const scalar_t* zp = z.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, S * per_seq, grain, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / per_seq, t = task % per_seq;
        if (t < num_blocks)
          update_block<scalar_t>(args, s, t * kBlock, up, dp, bias, Bp, Cp, Dp, zp, op);
        else
          update_channel<scalar_t>(args, s, num_blocks * kBlock + (t - num_blocks), up, dp, bias, Bp, Cp, Dp, zp,
                                   op);
      }
    });
  };
  if (dtype == at::kBFloat16) run(at::BFloat16{}); else run(float{});
  return out;
}

// One decode token of a whole Mamba1 mixer (no dt/B/C norms) for S sequences, the few-row kernels' path: in_proj,
// the conv of the new token and its SiLU, x_proj, dt_proj, the state update with its gate, out_proj; the same
// kernels and roundings as the layer's step op by op (F.silu aside: the kernel's SiLU may differ from PyTorch's by
// an ulp), in one call. Why: at one row the Python and dispatch between the linears cost ~80 us a layer of
// Mamba-base (a bfloat16 mixer step, weights in cache, 2 Zen 3 cores: 370 -> 290 us fused).
// x: [S, H] the normed block input; conv_state [num_slots, D, K-1] (x's dtype), ssm_state [num_slots, D, N] float32,
// both updated in place at `slots`; taps [K, D] float32 and conv_bias [D] as conv1d_update takes them; weights in
// nn.Linear's [out, in] layout and x's dtype, or packed quantized (project(), quantize_activations its mode); dt_bias, Dskip: [D] in x's dtype; A: [D, N] float32 (-exp(A_log)).
// Returns out_proj's output [S, H].
at::Tensor mamba1_decode_(at::Tensor x, at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots,
                             at::Tensor in_weight, c10::optional<at::Tensor> in_bias, at::Tensor taps,
                             c10::optional<at::Tensor> conv_bias, at::Tensor x_proj_weight,
                             at::Tensor dt_weight, at::Tensor dt_bias, at::Tensor A, at::Tensor Dskip,
                             at::Tensor out_weight, c10::optional<at::Tensor> out_bias,
                             bool quantize_activations) {
  const int64_t D = conv_state.size(1), N = ssm_state.size(2), R = projection_inputs(dt_weight);
  TORCH_CHECK(projection_outputs(in_weight) == 2 * D && projection_outputs(x_proj_weight) == R + 2 * N &&
                  projection_inputs(x_proj_weight) == D && projection_outputs(dt_weight) == D &&
                  projection_inputs(out_weight) == D,
              "mamba1_decode_: weight shapes do not agree with the states (D = ", D, ", N = ", N, ", rank ", R, ")");
  const bool a8 = quantize_activations;
  auto xz = project(x, in_weight, in_bias, a8);  // [S, 2D]: u | z
  auto u = conv1d_update(conv_state, slots, xz.narrow(1, 0, D), taps, conv_bias, /*float_accumulate=*/true,
                         ConvOutput::kSilu);       // [S, D]
  auto dbc = project(u, x_proj_weight, {}, a8);  // [S, R + 2N]: dt (low rank) | B | C
  auto dt_raw = project(dbc.narrow(1, 0, R).contiguous(), dt_weight, {}, a8);  // [S, D], before bias and softplus
  auto y = selective_state_update_(ssm_state, slots, u, dt_raw, dt_bias, A, dbc.narrow(1, R, N),
                                   dbc.narrow(1, R + N, N), Dskip, xz.narrow(1, D, D));
  return project(y, out_weight, out_bias, a8);
}
