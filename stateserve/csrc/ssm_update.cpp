// One decode token of Mamba-style recurrences, updating each sequence's float32 state in place in its slot.
// In PyTorch the same update gathers the states, builds several state-sized temporaries and scatters the
// result back: for a 24-layer Mamba2 that is ~150 MB of memory traffic per token; here it is one read and one
// write of each state. The arithmetic and its order follow the PyTorch paths (ssd.ssd_decode_step,
// selective_scan.selective_state_update) in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {
// float32 and contiguous, converting at most once (float32 contiguous inputs pass through untouched).
inline torch::Tensor f32(const torch::Tensor& t) { return t.to(at::kFloat).contiguous(); }
}  // namespace

// Mamba2 / SSD. states: [num_slots, H, P, N] float32; slots: [S] int64; x: [S, H, P], dt: [S, H] (after
// softplus), B, C: [S, G, N], all float32; A, D: [H] float32 (D may be empty). Returns y: [S, H, P] float32.
torch::Tensor ssd_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor x, torch::Tensor dt,
                                torch::Tensor A, torch::Tensor B, torch::Tensor C, c10::optional<torch::Tensor> D) {
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous(), "ssd_state_update_: float32 states");
  x = f32(x), dt = f32(dt), A = f32(A), B = f32(B), C = f32(C);
  auto slot_ids = slots.to(at::kLong).contiguous();
  const int64_t S = x.size(0), H = x.size(1), P = x.size(2), N = states.size(3), G = B.size(1);
  TORCH_CHECK(states.size(1) == H && states.size(2) == P && B.size(2) == N && H % G == 0,
              "ssd_state_update_: shapes do not agree");
  torch::Tensor Dv;
  if (D.has_value() && D->defined()) Dv = D->contiguous().to(at::kFloat);
  auto y = torch::empty({S, H, P}, x.options());
  float* st = states.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = Dv.defined() ? Dv.data_ptr<float>() : nullptr;
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const int64_t heads_per_group = H / G;
  at::parallel_for(0, S * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / H, h = task % H, g = h / heads_per_group;
      const float d = dtp[s * H + h];
      const float decay = std::exp(d * Ap[h]);
      const float* b = Bp + (s * G + g) * N;
      const float* c = Cp + (s * G + g) * N;
      float* state = st + (sl[s] * H + h) * P * N;
      for (int64_t p = 0; p < P; ++p) {
        const float xv = xp[(s * H + h) * P + p];
        const float dx = xv * d;
        float* row = state + p * N;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; ++n) {
          const float v = row[n] * decay + dx * b[n];
          row[n] = v;
          acc += v * c[n];
        }
        yp[(s * H + h) * P + p] = Dp ? acc + Dp[h] * xv : acc;
      }
    }
  });
  return y;
}

// Mamba1. states: [num_slots, D, N] float32; u, dt: [S, D] (dt after bias and softplus); A: [D, N];
// B, C: [S, N]. Returns sum_n h[d, n] * C[n] as [S, D] float32; with round_to_bf16 the new state is rounded
// to bfloat16 before that product, as the bfloat16 PyTorch path's matmul does (the stored state is not).
torch::Tensor selective_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor u,
                                      torch::Tensor dt, torch::Tensor A, torch::Tensor B, torch::Tensor C,
                                      bool round_to_bf16) {
  TORCH_CHECK(states.scalar_type() == at::kFloat && states.is_contiguous(),
              "selective_state_update_: float32 states");
  u = f32(u), dt = f32(dt), A = f32(A), B = f32(B), C = f32(C);
  auto slot_ids = slots.to(at::kLong).contiguous();
  const int64_t S = u.size(0), Dn = u.size(1), N = states.size(2);
  TORCH_CHECK(states.size(1) == Dn && A.size(0) == Dn && A.size(1) == N && B.size(1) == N,
              "selective_state_update_: shapes do not agree");
  auto y = torch::empty({S, Dn}, u.options());
  float* st = states.data_ptr<float>();
  const float *up = u.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>();
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, S * Dn, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / Dn, d = task % Dn;
      const float dv = dtp[s * Dn + d], uv = up[s * Dn + d];
      const float* a = Ap + d * N;
      const float* b = Bp + s * N;
      const float* c = Cp + s * N;
      float* row = st + (sl[s] * Dn + d) * N;
      float acc = 0.f;
      for (int64_t n = 0; n < N; ++n) {
        // (dt * B) * u: the association of the PyTorch path
        const float v = row[n] * std::exp(dv * a[n]) + (dv * b[n]) * uv;
        row[n] = v;
        const float vr = round_to_bf16 ? static_cast<float>(static_cast<at::BFloat16>(v)) : v;
        acc += vr * c[n];
      }
      yp[s * Dn + d] = acc;
    }
  });
  return y;
}
