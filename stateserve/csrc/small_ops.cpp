// Small per-token ops of a decode step fused into one pass each: at batch sizes of a few tokens, PyTorch spends
// more time dispatching their 5-10 elementwise kernels (and, for the conv state, gathering and scattering
// rows) than computing. Rounding follows the PyTorch expressions they replace (see each comment).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// (a pragma cannot sit inside AT_DISPATCH's macro arguments, hence a function of its own)
template <typename T>
float sum_of_squares(const T* row, int64_t n) {
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t h = 0; h < n; ++h) {
    const float v = static_cast<float>(row[h]);
    sq += v * v;
  }
  return sq;
}

}  // namespace

// Depthwise causal conv over the last K inputs of each sequence, shifting the conv state in place.
// conv_state: [num_slots, C, K-1]; x: [S, C]; weight: [C, K]; bias: [C] or empty; all one dtype.
// float_accumulate: products and bias summed in float32, rounded once (F.conv1d). Otherwise as the PyTorch
// expression (window * weight).sum(-1) + bias: each product rounded, the sum rounded, then the bias add.
torch::Tensor conv1d_update_(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor weight,
                             c10::optional<torch::Tensor> bias, bool float_accumulate) {
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "conv1d_update_: conv_state, x and weight must share a dtype (conv_state contiguous)");
  x = x.contiguous();
  weight = weight.contiguous();
  auto slot_ids = slots.to(at::kLong).contiguous();
  const int64_t S = x.size(0), C = x.size(1), K = weight.size(1), W = conv_state.size(2);
  TORCH_CHECK(W == K - 1 && conv_state.size(1) == C && weight.size(0) == C, "conv1d_update_: shapes do not agree");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->contiguous().to(x.scalar_type());
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv1d_update_", [&] {
    scalar_t* st = conv_state.data_ptr<scalar_t>();
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    const int64_t* sl = slot_ids.data_ptr<int64_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, S * C, 256, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t s = task / C, c = task % C;
        scalar_t* row = st + (sl[s] * C + c) * W;
        const scalar_t* w = wp + c * K;
        const float xv = static_cast<float>(xp[s * C + c]);
        float acc = 0.f;
        for (int64_t k = 0; k < W; ++k) {
          const float prod = static_cast<float>(row[k]) * static_cast<float>(w[k]);
          acc += float_accumulate ? prod : round_to<scalar_t>(prod);
        }
        const float last = xv * static_cast<float>(w[W]);
        acc += float_accumulate ? last : round_to<scalar_t>(last);
        float out;
        if (float_accumulate) {
          out = acc + (bp ? static_cast<float>(bp[c]) : 0.f);
        } else {
          out = round_to<scalar_t>(acc);
          if (bp) out = out + static_cast<float>(bp[c]);
        }
        yp[s * C + c] = static_cast<scalar_t>(out);
        for (int64_t k = 0; k + 1 < W; ++k) row[k] = row[k + 1];
        if (W > 0) row[W - 1] = xp[s * C + c];
      }
    });
  });
  return y;
}

// RMSNorm of each row as transformers computes it: normalised in float32, cast to the input dtype, then
// multiplied by the weight in that dtype. x: [M, H]; weight: [H], x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: x [M, H] and weight [H] of the same dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t M = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* row = xp + m * H;
        const float sq = sum_of_squares(row, H);
        const float r = 1.f / std::sqrt(sq / static_cast<float>(H) + static_cast<float>(eps));
        for (int64_t h = 0; h < H; ++h) {
          const float normed = round_to<scalar_t>(static_cast<float>(row[h]) * r);
          op[m * H + h] = static_cast<scalar_t>(static_cast<float>(wp[h]) * normed);
        }
      }
    });
  });
  return out;
}

// Depthwise causal conv of one sequence's chunk in time-major layout (no transposes): padded: [K-1+L, C] (the
// K-1 inputs before the chunk, then the chunk); weight: [C, K]; bias: [C] or empty. y[t, c] =
// sum_k weight[c, k] * padded[t + k, c] + bias[c], summed in float32 and rounded once, as F.conv1d does.
torch::Tensor conv1d_prefill(torch::Tensor padded, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(padded.dim() == 2 && weight.dim() == 2 && padded.size(1) == weight.size(0),
              "conv1d_prefill: padded [K-1+L, C] and weight [C, K]");
  padded = padded.contiguous();
  const int64_t C = weight.size(0), K = weight.size(1), L = padded.size(0) - (K - 1);
  TORCH_CHECK(L >= 0, "conv1d_prefill: fewer rows than the kernel's history");
  auto wt = weight.to(at::kFloat).t().contiguous();  // [K, C]: channel-contiguous taps
  torch::Tensor b = (bias.has_value() && bias->defined()) ? bias->to(at::kFloat).contiguous()
                                                         : torch::zeros({C}, wt.options());
  auto y = torch::empty({L, C}, padded.options());
  const float *wp = wt.data_ptr<float>(), *bp = b.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, padded.scalar_type(), "conv1d_prefill", [&] {
    const scalar_t* xp = padded.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, L, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(C);
      for (int64_t t = begin; t < end; ++t) {
        std::copy(bp, bp + C, acc.begin());
        for (int64_t k = 0; k < K; ++k) {
          const scalar_t* row = xp + (t + k) * C;
          const float* w = wp + k * C;
          float* a = acc.data();
          for (int64_t c = 0; c < C; ++c) a[c] += w[c] * static_cast<float>(row[c]);
        }
        for (int64_t c = 0; c < C; ++c) yp[t * C + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return y;
}

// Rotate-half rotary embedding applied in place to q [T, H, D] and k [T, KH, D] (unit stride inside a token's
// heads; any token stride, so views into the fused qkv output work). table: [max_pos, rotary_dim] float32, cos
// then sin halves; positions: [T] int64. As the PyTorch path: float32 products, rounded once to x's dtype.
void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor table, torch::Tensor positions, int64_t rotary_dim) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.scalar_type() == k.scalar_type(), "rotary_: q, k [T, heads, D]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "rotary_: heads must be contiguous within a token");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.size(1) == rotary_dim,
              "rotary_: float32 table [max_pos, rotary_dim]");
  auto pos = positions.to(at::kLong).contiguous();
  const int64_t T = q.size(0), half = rotary_dim / 2;
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* tp = table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rotary_", [&] {
    auto apply = [&](scalar_t* base, int64_t token_stride, int64_t heads, int64_t D) {
      at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* cs = tp + pp[t] * rotary_dim;
          for (int64_t h = 0; h < heads; ++h) {
            scalar_t* x = base + t * token_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
              const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
              const float c = cs[i], s = cs[half + i];
              x[i] = static_cast<scalar_t>(a * c + (-b) * s);
              x[i + half] = static_cast<scalar_t>(b * c + a * s);
            }
          }
        }
      });
    };
    apply(q.data_ptr<scalar_t>(), q.stride(0), q.size(1), q.size(2));
    apply(k.data_ptr<scalar_t>(), k.stride(0), k.size(1), k.size(2));
  });
}

// silu(gate) * up for x = [gate | up] of shape [M, 2I], rounded as F.silu(gate) * up in x's dtype.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [M, 2I]");
  x = x.contiguous();
  const int64_t M = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({M, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        const scalar_t* g = xp + m * 2 * I;
        const scalar_t* u = g + I;
        for (int64_t i = 0; i < I; ++i) {
          const float gv = static_cast<float>(g[i]);
          const float act = round_to<scalar_t>(gv / (1.f + std::exp(-gv)));
          op[m * I + i] = static_cast<scalar_t>(act * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}
