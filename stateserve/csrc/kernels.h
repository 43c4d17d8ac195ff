// Every kernel's entry point, declared once: bindings.cpp binds them, and kernels that call others (the fused
// decode steps) include this too. Shapes and dtypes are documented at each definition.
#pragma once
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <string>
#include <tuple>
#include <vector>

// ---- the build (bindings.cpp)
int64_t simd_float32_lanes();  // float32 lanes of the widest vector: 16 (AVX-512), 8 (AVX2) or 0
std::string compiled_isa();    // SS_ISA_NAME: avx512_bf16, avx512, avx2 or scalar

// ---- attention over the paged KV cache (paged_attention.cpp, prefill_attention.cpp)
void write_kv_cache(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
                    at::Tensor slots);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor seq_lens, double scale);
bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_table, int64_t ctx, double scale);

// ---- linears (linear.cpp: few rows on the plain weight; packed_linear.cpp: the 48-column panel copy)
bool fast_linear_supported(c10::ScalarType dtype);
at::Tensor fast_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
// ---- the fused decode calls' projections (projection.cpp): a float weight through fast_linear, a packed quantized
// one (q8_0_pack / q4_pack / q6_k_pack) through its product in the mode quantize_activations names; its [N, K]
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      bool quantize_activations);
int64_t projection_outputs(const at::Tensor& weight);
int64_t projection_inputs(const at::Tensor& weight);
bool packed_linear_supported(c10::ScalarType dtype, int64_t in_features);
void pack_linear_weight_(at::Tensor packed, at::Tensor weight, bool lane_order);
at::Tensor packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t out_features,
                         bool lane_order);

// ---- Q8_0 weights (quant_linear.cpp; the tiles in quant_a8.cpp and quant_exact.cpp)
bool q8_0_supported();
std::string q8_0_dot_path();  // the build's integer product: avx512_vnni, avx512bw, avx2 or scalar
at::Tensor q8_0_pack(at::Tensor codes, at::Tensor scales);
std::vector<at::Tensor> q8_0_unpack(at::Tensor packed, int64_t N, int64_t K);
at::Tensor q8_0_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations);

// ---- Q4_0, Q4_1, Q4_K weights (quant_q4_linear.cpp; the tiles in quant_q4_a8.cpp and quant_q4_exact.cpp)
bool q4_supported();
at::Tensor q4_pack(const std::string& format, at::Tensor codes, at::Tensor d, c10::optional<at::Tensor> m,
                      c10::optional<at::Tensor> sc, c10::optional<at::Tensor> mn);
std::tuple<std::string, at::Tensor, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
           c10::optional<at::Tensor>>
q4_unpack(at::Tensor packed, int64_t N, int64_t K);  // (format, codes, d, m, sc, mn), None where absent
at::Tensor q4_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N, int64_t K,
                        bool quantize_activations);

// ---- Q4_K quantization at load (quant_q4k_quantize.cpp): llama.cpp's quantize_row_q4_K_ref bit for bit;
// w float32 [N, K] -> [codes, d, dmin, sc, mn] as quantization/q4.py's quantize_q4_k
std::vector<at::Tensor> q4_k_quantize(at::Tensor w);

// ---- Q6_K weights (quant_q6k_linear.cpp; the tiles in quant_q6k_a8.cpp and quant_q6k_exact.cpp)
at::Tensor q6_k_pack(at::Tensor codes, at::Tensor sc, at::Tensor d);
std::vector<at::Tensor> q6_k_unpack(at::Tensor packed, int64_t N, int64_t K);  // (codes, sc, d)
at::Tensor q6_k_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations);

// ---- per-token ops (small_ops.cpp, gated_norm.cpp)
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor rms_norm_f32_weight(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor residual, at::Tensor x, at::Tensor weight, double eps);
bool rotary_(at::Tensor q, at::Tensor k, at::Tensor table, at::Tensor positions, int64_t rotary_dim);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor conv1d_prefill(at::Tensor x, at::Tensor history, at::Tensor weight,
                             c10::optional<at::Tensor> bias, bool silu_float32);
at::Tensor dt_softplus(at::Tensor dt, at::Tensor dt_bias, double lo, double hi);
at::Tensor gated_rms_norm(at::Tensor y, at::Tensor gate, at::Tensor weight, int64_t group_size,
                             double eps, bool norm_before_gate);

// ---- the one-token causal conv (conv_update.cpp). What its outputs become: y itself in x's dtype T (kConv), its
// SiLU rounded to T (kSilu: what F.silu on y gives, the next layer's input) or that SiLU as float32 (kSiluFloat32,
// for a float32 state update).
enum class ConvOutput { kConv, kSilu, kSiluFloat32 };
at::Tensor conv1d_update(at::Tensor conv_state, at::Tensor slots, at::Tensor x, at::Tensor taps,
                            c10::optional<at::Tensor> bias, bool float_accumulate, ConvOutput output);
at::Tensor conv1d_update_(at::Tensor conv_state, at::Tensor slots, at::Tensor x, at::Tensor taps,
                             c10::optional<at::Tensor> bias, bool float_accumulate, bool silu_float32);

// ---- recurrent state updates and scans (ssm_update.cpp: Mamba2; mamba1_update.cpp, selective_scan.cpp: Mamba1;
// ssd_scan.cpp: Mamba2 prefill)
at::Tensor ssd_state_update_(at::Tensor states, at::Tensor slots, at::Tensor x, at::Tensor dt,
                                at::Tensor A, at::Tensor B, at::Tensor C, c10::optional<at::Tensor> D);
at::Tensor mamba2_decode_(at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots,
                             at::Tensor xbc, at::Tensor dt, at::Tensor taps,
                             c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias, double dt_min,
                             double dt_max, at::Tensor A, c10::optional<at::Tensor> D, int64_t n_groups);
at::Tensor selective_state_update_(at::Tensor states, at::Tensor slots, at::Tensor u,
                                      at::Tensor dt_raw, at::Tensor dt_bias, at::Tensor A,
                                      at::Tensor B, at::Tensor C, at::Tensor Dskip, at::Tensor z);
std::vector<at::Tensor> selective_scan_fwd(at::Tensor u, at::Tensor dt, at::Tensor A, at::Tensor B,
                                              at::Tensor C, c10::optional<at::Tensor> h0,
                                              std::vector<int64_t> offsets, c10::optional<at::Tensor> D,
                                              c10::optional<at::Tensor> z, c10::optional<at::Tensor> dt_bias);
std::vector<at::Tensor> ssd_scan_fwd(at::Tensor x, at::Tensor dt, at::Tensor A, at::Tensor B,
                                        at::Tensor C, c10::optional<at::Tensor> D,
                                        c10::optional<at::Tensor> h0, std::vector<int64_t> offsets);

// ---- delta rule (delta_rule_update.cpp): one decode step of the gated delta net / KDA on the states in place
at::Tensor delta_rule_decode_(at::Tensor state, at::Tensor slots, at::Tensor q, at::Tensor k, at::Tensor v,
                              at::Tensor decay, at::Tensor beta);
at::Tensor gated_delta_decode_(at::Tensor state, at::Tensor slots, at::Tensor qkv, at::Tensor b, at::Tensor a,
                               at::Tensor neg_exp_A, at::Tensor dt_bias, int64_t num_k_heads, double beta_scale);
// ---- whole layers' decode steps in one call (ssm_update.cpp, mamba1_update.cpp, decoder_layer.cpp)
at::Tensor mamba2_mixer_decode_(at::Tensor x, at::Tensor conv_state, at::Tensor ssm_state,
                                   at::Tensor slots, at::Tensor in_weight, c10::optional<at::Tensor> in_bias,
                                   at::Tensor taps, c10::optional<at::Tensor> conv_bias, at::Tensor dt_bias,
                                   double dt_min, double dt_max, at::Tensor A, c10::optional<at::Tensor> D,
                                   int64_t n_groups, at::Tensor norm_weight, int64_t norm_group_size,
                                   double norm_eps, bool norm_before_gate, at::Tensor out_weight,
                                   c10::optional<at::Tensor> out_bias, bool quantize_activations);
at::Tensor mamba1_decode_(at::Tensor x, at::Tensor conv_state, at::Tensor ssm_state, at::Tensor slots,
                             at::Tensor in_weight, c10::optional<at::Tensor> in_bias, at::Tensor taps,
                             c10::optional<at::Tensor> conv_bias, at::Tensor x_proj_weight,
                             at::Tensor dt_weight, at::Tensor dt_bias, at::Tensor A, at::Tensor Dskip,
                             at::Tensor out_weight, c10::optional<at::Tensor> out_bias,
                             bool quantize_activations);
std::vector<at::Tensor> decoder_layer_decode_(
    at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor positions, at::Tensor norm1_weight,
    double norm1_eps, at::Tensor qkv_weight, c10::optional<at::Tensor> qkv_bias, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, at::Tensor rope_table, int64_t rotary_dim, at::Tensor k_cache,
    at::Tensor v_cache, at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor seq_lens,
    double scale, at::Tensor o_weight, c10::optional<at::Tensor> o_bias, at::Tensor norm2_weight,
    double norm2_eps, at::Tensor gate_up_weight, c10::optional<at::Tensor> gate_up_bias,
    at::Tensor down_weight, c10::optional<at::Tensor> down_bias, bool quantize_activations);
