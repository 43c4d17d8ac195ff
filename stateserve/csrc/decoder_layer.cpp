// One decode step of a Llama-style decoder layer (RMSNorm, GQA attention with rotary over the paged cache, RMSNorm,
// SwiGLU MLP) in one call: the same kernels the layer calls op by op from Python (rms_norm / add_rms_norm_,
// fast_linear, rotary_, write_kv_cache, paged_decode_attention, silu_and_mul), so the same results, without the
// Python, module calls and dispatch between them (~1.6 ms of a Llama-base bfloat16 token on 2 Zen 3 cores, where
// the kernels themselves took ~0.5 ms besides the linears). Used while every projection takes the few-row kernel.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <vector>
#include "kernels.h"

// x: [S, hidden], the previous layer's MLP output (the embeddings for the first layer, whose residual is None: the
// stream then starts as a copy of x); residual: the stream so far, updated in place. positions: [S]; rope_table:
// the layer's [max_pos, rotary_dim] cos|sin table covering them; k_cache, v_cache, slot_mapping, block_tables,
// seq_lens: the attention layer's bound cache and the step's decode metadata. Weights in nn.Linear's layout:
// qkv [q | k | v, hidden], o [hidden, heads * head_dim], gate_up [gate | up, hidden], down [hidden, intermediate],
// each a float weight or a packed quantized one (project(): quantize_activations picks the latter's mode).
// Returns (the MLP output [S, hidden], the stream).
std::vector<at::Tensor> decoder_layer_decode_(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor positions, at::Tensor norm1_weight,
    double norm1_eps, at::Tensor qkv_weight, c10::optional<at::Tensor> qkv_bias, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, at::Tensor rope_table, int64_t rotary_dim, at::Tensor k_cache,
    at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    double scale, at::Tensor o_weight, c10::optional<at::Tensor> o_bias, at::Tensor norm2_weight,
    double norm2_eps, at::Tensor gate_up_weight, c10::optional<at::Tensor> gate_up_bias,
    at::Tensor down_weight, c10::optional<at::Tensor> down_bias, bool quantize_activations) {
  const int64_t S = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(projection_outputs(qkv_weight) == q_size + 2 * kv_size && projection_inputs(o_weight) == q_size,
              "decoder_layer_decode_: qkv / o weights do not match ", num_heads, " heads and ", num_kv_heads,
              " kv heads of ", head_dim);
  at::Tensor stream, h;
  if (residual.has_value() && residual->defined()) {
    stream = *residual;
    h = add_rms_norm_(stream, x, norm1_weight, norm1_eps);
  } else {
    stream = x.clone();
    h = rms_norm(x, norm1_weight, norm1_eps);
  }
  auto qkv = project(h, qkv_weight, qkv_bias, quantize_activations);  // [S, q | k | v]
  auto q = qkv.narrow(1, 0, q_size).view({S, num_heads, head_dim});
  auto k = qkv.narrow(1, q_size, kv_size).view({S, num_kv_heads, head_dim});
  auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({S, num_kv_heads, head_dim});
  TORCH_CHECK(rotary_(q, k, rope_table, positions, rotary_dim),
              "decoder_layer_decode_: the rotary table does not cover the positions");
  write_kv_cache(k_cache, v_cache, k.contiguous(), v.contiguous(), slot_mapping);
  auto attn = paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale);  // [S, H, D]
  auto o = project(attn.view({S, q_size}), o_weight, o_bias, quantize_activations);
  h = add_rms_norm_(stream, o, norm2_weight, norm2_eps);
  auto mlp = project(silu_and_mul(project(h, gate_up_weight, gate_up_bias, quantize_activations)), down_weight,
                     down_bias, quantize_activations);
  return {mlp, stream};
}
