// One decode token of Mamba2 (SSD), updating each sequence's state (float32 or bfloat16) in place in its slot.
// In PyTorch the same update gathers the states, builds several state-sized temporaries and scatters the
// result back: for a 24-layer Mamba2 that is ~150 MB of memory traffic per token; here it is one read and one
// write of each state. The arithmetic follows the PyTorch path (ssd.ssd_decode_step) in float32. (Mamba1's
// update is in mamba1_update.cpp.)
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include <type_traits>
#include "kernels.h"
#include "simd.h"

namespace {
// float32 and contiguous, converting at most once (float32 contiguous inputs pass through untouched).
inline at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }
}  // namespace

namespace {
// One head of one sequence: state [P, N] <- state * exp(dt * A) + (x * dt) B, y[p] = state[p] . C (+ D x[p]).
// S = float or at::BFloat16: the update is computed in float32 and only the stored state is rounded (y uses the
// unrounded new state).
template <typename S>
inline void ssd_head_update(S* state, const float* x, float dt, float A, const float* b, const float* c,
                            const float* D, int64_t P, int64_t N, float* y) {
#if SS_HAS_SIMD
  // N and P multiples of the vector width W (16 with AVX-512, 8 with AVX2; float32 or bfloat16 rows): explicit
  // vectors, W rows at a time so that their W dot products with C finish in one transpose-and-add instead of W
  // dependent horizontal sums (which left the core waiting: ~40 us a layer for Mamba2-base's 24 heads of 64 x 64
  // on AVX-512); bfloat16 rows widened on load and rounded to nearest even on store.
  if constexpr (std::is_same_v<S, float> || std::is_same_v<S, at::BFloat16>) {
    using Vec = stateserve_simd::F32Vec;
    using V = Vec::V;
    constexpr int W = Vec::kWidth;
    if (N % W == 0 && P % W == 0) {
      const V decay = Vec::set1(std::exp(dt * A));
      for (int64_t p0 = 0; p0 < P; p0 += W) {
        V acc[W];
        for (int j = 0; j < W; ++j) {
          const V dx = Vec::set1(x[p0 + j] * dt);
          S* row = state + (p0 + j) * N;
          V sum = Vec::zero();
          for (int64_t n = 0; n < N; n += W) {
            const V v = Vec::fmadd(Vec::load_from(row + n), decay, Vec::mul(dx, Vec::load(b + n)));
            Vec::store_to(row + n, v);
            sum = Vec::fmadd(v, Vec::load(c + n), sum);
          }
          acc[j] = sum;
        }
        V yv = Vec::reduce(acc);  // lane j: row p0 + j
        if (D) yv = Vec::fmadd(Vec::set1(*D), Vec::load(x + p0), yv);
        Vec::store(y + p0, yv);
      }
      return;
    }
  }
#endif
  const float decay = std::exp(dt * A);
  for (int64_t p = 0; p < P; ++p) {
    const float acc = stateserve_simd::ssd_row_update(state + p * N, decay, x[p] * dt, b, c, N);
    y[p] = D ? acc + *D * x[p] : acc;
  }
}

// Runs body(states_ptr, s, h, g) for every sequence s and head h (g: the head's group) in parallel, with the
// states' element type (float32 or bfloat16) dispatched once.
template <typename Body>
void for_each_sequence_head(const at::Tensor& states, int64_t S, int64_t H, int64_t G, const Body& body) {
  const int64_t heads_per_group = H / G;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, states.scalar_type(), "ssd_heads", [&] {
    scalar_t* st = states.data_ptr<scalar_t>();
    at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task)
        body(st, task / H, task % H, (task % H) / heads_per_group);
    });
  });
}
}  // namespace

// Mamba2 / SSD. states: [num_slots, H, P, N] float32; slots: [S] int64; x: [S, H, P], dt: [S, H] (after
// softplus), B, C: [S, G, N], all float32; A, D: [H] float32 (D may be empty). Returns y: [S, H, P] float32.
at::Tensor ssd_state_update_(at::Tensor states, at::Tensor slots, at::Tensor x, at::Tensor dt,
                                at::Tensor A, at::Tensor B, at::Tensor C, c10::optional<at::Tensor> D) {
  TORCH_CHECK((states.scalar_type() == at::kFloat || states.scalar_type() == at::kBFloat16) && states.is_contiguous(),
              "ssd_state_update_: contiguous float32 or bfloat16 states");
  x = f32(x), dt = f32(dt), A = f32(A), B = f32(B), C = f32(C);
  auto slot_ids = slots.to(at::kLong).contiguous();
  const int64_t S = x.size(0), H = x.size(1), P = x.size(2), N = states.size(3), G = B.size(1);
  TORCH_CHECK(states.size(1) == H && states.size(2) == P && B.size(2) == N && H % G == 0,
              "ssd_state_update_: shapes do not agree");
  at::Tensor Dv;
  if (D.has_value() && D->defined()) Dv = D->contiguous().to(at::kFloat);
  auto y = at::empty({S, H, P}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for_each_sequence_head(states, S, H, G, [&](auto* st, int64_t s, int64_t h, int64_t g) {
    ssd_head_update(st + (sl[s] * H + h) * P * N, xp + (s * H + h) * P, dtp[s * H + h], Ap[h],
                    Bp + (s * G + g) * N, Cp + (s * G + g) * N, Dp ? Dp + h : nullptr, P, N, yp + (s * H + h) * P);
  });
  return y;
}

// A whole Mamba2 decode step after in_proj, in one call: the conv update with SiLU (conv1d_update_), the step
// sizes (dt_softplus), then the SSD state update reading x, B and C in place from the conv output. Same
// arithmetic as those three kernels one after the other (the Python path), without the Python between them and
// the copies of the x / B / C views. xbc: [S, conv_dim = H*P + 2*G*N] and dt: [S, H] in the model dtype; taps,
// conv_bias: the layer's conv_taps(); dt_bias, A, D: [H] float32 (dt_bias holding model-dtype values).
at::Tensor mamba2_decode_(at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots,
                             at::Tensor xbc, at::Tensor dt, at::Tensor taps,
                             c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias, double dt_min,
                             double dt_max, at::Tensor A, c10::optional<at::Tensor> D, int64_t n_groups) {
  TORCH_CHECK((ssm_state.scalar_type() == at::kFloat || ssm_state.scalar_type() == at::kBFloat16) &&
                  ssm_state.is_contiguous() && ssm_state.dim() == 4,
              "mamba2_decode_: contiguous float32 or bfloat16 ssm states [slots, H, P, N]");
  const int64_t H = ssm_state.size(1), P = ssm_state.size(2), N = ssm_state.size(3), G = n_groups;
  TORCH_CHECK(G > 0 && H % G == 0 && xbc.dim() == 2 && xbc.size(1) == H * P + 2 * G * N && dt.dim() == 2 &&
                  dt.size(0) == xbc.size(0) && dt.size(1) == H && A.numel() == H,
              "mamba2_decode_: shapes do not agree");
  auto slot_ids = slots.scalar_type() == at::kLong ? slots.contiguous() : slots.to(at::kLong).contiguous();
  auto conv_out = conv1d_update_(conv_state, slot_ids, xbc, taps, conv_bias, false, true);  // [S, conv_dim] f32
  auto steps = dt_softplus(dt, dt_bias, dt_min, dt_max);  // [S, H] f32
  A = f32(A);
  at::Tensor Dv;
  if (D.has_value() && D->defined()) Dv = f32(*D);
  const int64_t S = xbc.size(0), conv_dim = xbc.size(1), inner = H * P;
  auto y = at::empty({S, H, P}, conv_out.options());
  const float *cp = conv_out.data_ptr<float>(), *dtp = steps.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float* Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  for_each_sequence_head(ssm_state, S, H, G, [&](auto* st, int64_t s, int64_t h, int64_t g) {
    const float* row = cp + s * conv_dim;  // [x (H*P) | B (G*N) | C (G*N)]
    ssd_head_update(st + (sl[s] * H + h) * P * N, row + h * P, dtp[s * H + h], Ap[h], row + inner + g * N,
                    row + inner + G * N + g * N, Dp ? Dp + h : nullptr, P, N, yp + (s * H + h) * P);
  });
  return y;
}

// A whole Mamba2 mixer's decode step with its gated RMSNorm, in_proj to out_proj, for rows few enough for
// fast_linear: in_proj, mamba2_decode_, gated_rms_norm, out_proj, as the layer runs them op by op (same kernels,
// same roundings) without the Python and dispatch between them. x: [S, hidden] in the model dtype; in_weight
// [gate I | xbc conv_dim | dt H, hidden], out_weight [hidden, I] (float or packed quantized: project()); norm_weight
// [I] float32; the rest as mamba2_decode_ takes it. Returns [S, hidden].
at::Tensor mamba2_mixer_decode_(at::Tensor x, at::Tensor conv_state, at::Tensor ssm_state,
                                   at::Tensor slots, at::Tensor in_weight, c10::optional<at::Tensor> in_bias,
                                   at::Tensor taps, c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias,
                                   double dt_min, double dt_max, at::Tensor A, c10::optional<at::Tensor> D,
                                   int64_t n_groups, at::Tensor norm_weight, int64_t norm_group_size,
                                   double norm_eps, bool norm_before_gate, at::Tensor out_weight,
                                   c10::optional<at::Tensor> out_bias, bool quantize_activations) {
  const int64_t H = ssm_state.size(1), I = projection_inputs(out_weight), conv_dim = taps.size(1);
  TORCH_CHECK(projection_outputs(in_weight) == I + conv_dim + H && norm_weight.numel() == I,
              "mamba2_mixer_decode_: in_proj has ", projection_outputs(in_weight), " outputs, expected gate ", I, " + conv ",
              conv_dim, " + heads ", H);
  auto proj = project(x, in_weight, in_bias, quantize_activations);  // [S, I + conv_dim + H]: gate | xbc | dt
  auto y = mamba2_decode_(conv_state, ssm_state, slots, proj.narrow(1, I, conv_dim), proj.narrow(1, I + conv_dim, H),
                          taps, conv_bias, dt_bias, dt_min, dt_max, A, D, n_groups);  // [S, H, P] float32
  auto normed = gated_rms_norm(y.view({y.size(0), I}), proj.narrow(1, 0, I), norm_weight, norm_group_size, norm_eps,
                               norm_before_gate);  // [S, I] in the model dtype
  return project(normed, out_weight, out_bias, quantize_activations);
}
