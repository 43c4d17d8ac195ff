// Every kernel's entry point, declared once: bindings.cpp binds them, and kernels that call others (the fused
// decode steps) include this too. Shapes and dtypes are documented at each definition.
#pragma once
#include <torch/extension.h>
#include <string>
#include <tuple>
#include <vector>

// ---- the build (bindings.cpp)
int64_t simd_float32_lanes();  // float32 lanes of the widest vector: 16 (AVX-512), 8 (AVX2) or 0
std::string compiled_isa();    // SS_ISA_NAME: avx512_bf16, avx512, avx2 or scalar

// ---- attention over the paged KV cache (paged_attention.cpp, prefill_attention.cpp)
void write_kv_cache(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                    torch::Tensor slots);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx, double scale);

// ---- linears (linear.cpp: few rows on the plain weight; packed_linear.cpp: the 48-column panel copy)
bool fast_linear_supported(c10::ScalarType dtype);
torch::Tensor fast_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
// ---- the fused decode calls' projections (projection.cpp): a float weight through fast_linear, a packed quantized
// one (q8_0_pack / q4_pack / q6_k_pack) through its product in the mode quantize_activations names; its [N, K]
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias,
                      bool quantize_activations);
int64_t projection_outputs(const torch::Tensor& weight);
int64_t projection_inputs(const torch::Tensor& weight);
bool packed_linear_supported(c10::ScalarType dtype, int64_t in_features);
void pack_linear_weight_(torch::Tensor packed, torch::Tensor weight);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features);

// ---- Q8_0 weights (quant_linear.cpp; the tiles in quant_a8.cpp and quant_exact.cpp)
bool q8_0_supported();
std::string q8_0_dot_path();  // the build's integer product: avx512_vnni, avx512bw, avx2 or scalar
torch::Tensor q8_0_pack(torch::Tensor codes, torch::Tensor scales);
std::vector<torch::Tensor> q8_0_unpack(torch::Tensor packed, int64_t N, int64_t K);
torch::Tensor q8_0_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations);

// ---- Q4_0, Q4_1, Q4_K weights (quant_q4_linear.cpp; the tiles in quant_q4_a8.cpp and quant_q4_exact.cpp)
bool q4_supported();
torch::Tensor q4_pack(const std::string& format, torch::Tensor codes, torch::Tensor d, c10::optional<torch::Tensor> m,
                      c10::optional<torch::Tensor> sc, c10::optional<torch::Tensor> mn);
std::tuple<std::string, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
           c10::optional<torch::Tensor>>
q4_unpack(torch::Tensor packed, int64_t N, int64_t K);  // (format, codes, d, m, sc, mn), None where absent
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N, int64_t K,
                        bool quantize_activations);

// ---- Q6_K weights (quant_q6k_linear.cpp; the tiles in quant_q6k_a8.cpp and quant_q6k_exact.cpp)
torch::Tensor q6_k_pack(torch::Tensor codes, torch::Tensor sc, torch::Tensor d);
std::vector<torch::Tensor> q6_k_unpack(torch::Tensor packed, int64_t N, int64_t K);  // (codes, sc, d)
torch::Tensor q6_k_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N,
                          int64_t K, bool quantize_activations);

// ---- per-token ops (small_ops.cpp, gated_norm.cpp)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps);
bool rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor table, torch::Tensor positions, int64_t rotary_dim);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor conv1d_prefill(torch::Tensor x, torch::Tensor history, torch::Tensor weight,
                             c10::optional<torch::Tensor> bias, bool silu_float32);
torch::Tensor dt_softplus(torch::Tensor dt, torch::Tensor dt_bias, double lo, double hi);
torch::Tensor gated_rms_norm(torch::Tensor y, torch::Tensor gate, torch::Tensor weight, int64_t group_size,
                             double eps, bool norm_before_gate);

// ---- the one-token causal conv (conv_update.cpp). What its outputs become: y itself in x's dtype T (kConv), its
// SiLU rounded to T (kSilu: what F.silu on y gives, the next layer's input) or that SiLU as float32 (kSiluFloat32,
// for a float32 state update).
enum class ConvOutput { kConv, kSilu, kSiluFloat32 };
torch::Tensor conv1d_update(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor taps,
                            c10::optional<torch::Tensor> bias, bool float_accumulate, ConvOutput output);
torch::Tensor conv1d_update_(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor taps,
                             c10::optional<torch::Tensor> bias, bool float_accumulate, bool silu_float32);

// ---- recurrent state updates and scans (ssm_update.cpp: Mamba2; mamba1_update.cpp, selective_scan.cpp: Mamba1;
// ssd_scan.cpp: Mamba2 prefill)
torch::Tensor ssd_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor x, torch::Tensor dt,
                                torch::Tensor A, torch::Tensor B, torch::Tensor C, c10::optional<torch::Tensor> D);
torch::Tensor mamba2_decode_(torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor slots,
                             torch::Tensor xbc, torch::Tensor dt, torch::Tensor taps,
                             c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias, double dt_min,
                             double dt_max, torch::Tensor A, c10::optional<torch::Tensor> D, int64_t n_groups);
torch::Tensor selective_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor u,
                                      torch::Tensor dt_raw, torch::Tensor dt_bias, torch::Tensor A,
                                      torch::Tensor B, torch::Tensor C, torch::Tensor Dskip, torch::Tensor z);
std::vector<torch::Tensor> selective_scan_fwd(torch::Tensor u, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                              torch::Tensor C, c10::optional<torch::Tensor> h0,
                                              std::vector<int64_t> offsets, c10::optional<torch::Tensor> D,
                                              c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> dt_bias);
std::vector<torch::Tensor> ssd_scan_fwd(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                        torch::Tensor C, c10::optional<torch::Tensor> D,
                                        c10::optional<torch::Tensor> h0, std::vector<int64_t> offsets);

// ---- whole layers' decode steps in one call (ssm_update.cpp, mamba1_update.cpp, decoder_layer.cpp)
torch::Tensor mamba2_mixer_decode_(torch::Tensor x, torch::Tensor conv_state, torch::Tensor ssm_state,
                                   torch::Tensor slots, torch::Tensor in_weight, c10::optional<torch::Tensor> in_bias,
                                   torch::Tensor taps, c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias,
                                   double dt_min, double dt_max, torch::Tensor A, c10::optional<torch::Tensor> D,
                                   int64_t n_groups, torch::Tensor norm_weight, int64_t norm_group_size,
                                   double norm_eps, bool norm_before_gate, torch::Tensor out_weight,
                                   c10::optional<torch::Tensor> out_bias, bool quantize_activations);
torch::Tensor mamba1_decode_(torch::Tensor x, torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor slots,
                             torch::Tensor in_weight, c10::optional<torch::Tensor> in_bias, torch::Tensor taps,
                             c10::optional<torch::Tensor> conv_bias, torch::Tensor x_proj_weight,
                             torch::Tensor dt_weight, torch::Tensor dt_bias, torch::Tensor A, torch::Tensor Dskip,
                             torch::Tensor out_weight, c10::optional<torch::Tensor> out_bias,
                             bool quantize_activations);
std::vector<torch::Tensor> decoder_layer_decode_(
    torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor positions, torch::Tensor norm1_weight,
    double norm1_eps, torch::Tensor qkv_weight, c10::optional<torch::Tensor> qkv_bias, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, torch::Tensor rope_table, int64_t rotary_dim, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
    double scale, torch::Tensor o_weight, c10::optional<torch::Tensor> o_bias, torch::Tensor norm2_weight,
    double norm2_eps, torch::Tensor gate_up_weight, c10::optional<torch::Tensor> gate_up_bias,
    torch::Tensor down_weight, c10::optional<torch::Tensor> down_bias, bool quantize_activations);
