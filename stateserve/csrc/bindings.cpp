// The Python module of the CPU kernels: one binding per kernel, the kernels live in their own files.
#include <torch/extension.h>

void write_kv_cache(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots);
bool prefill_attention_supported(c10::ScalarType dtype, int64_t head_dim);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx, double scale);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor fast_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
bool fast_linear_supported(c10::ScalarType dtype);
int64_t simd_float32_lanes();
bool packed_linear_supported(c10::ScalarType dtype, int64_t in_features);
void pack_linear_weight_(torch::Tensor packed, torch::Tensor weight);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features);
torch::Tensor ssd_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor x, torch::Tensor dt,
                                torch::Tensor A, torch::Tensor B, torch::Tensor C, c10::optional<torch::Tensor> D);
torch::Tensor mamba2_decode_(torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor slots,
                             torch::Tensor xbc, torch::Tensor dt, torch::Tensor taps,
                             c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias, double dt_min,
                             double dt_max, torch::Tensor A, c10::optional<torch::Tensor> D, int64_t n_groups);
torch::Tensor mamba2_mixer_decode_(torch::Tensor x, torch::Tensor conv_state, torch::Tensor ssm_state,
                                   torch::Tensor slots, torch::Tensor in_weight, c10::optional<torch::Tensor> in_bias,
                                   torch::Tensor taps, c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias,
                                   double dt_min, double dt_max, torch::Tensor A, c10::optional<torch::Tensor> D,
                                   int64_t n_groups, torch::Tensor norm_weight, int64_t norm_group_size,
                                   double norm_eps, bool norm_before_gate, torch::Tensor out_weight,
                                   c10::optional<torch::Tensor> out_bias);
torch::Tensor selective_state_update_(torch::Tensor states, torch::Tensor slots, torch::Tensor u,
                                      torch::Tensor dt_raw, torch::Tensor dt_bias, torch::Tensor A,
                                      torch::Tensor B, torch::Tensor C, torch::Tensor Dskip, torch::Tensor z);
torch::Tensor mamba1_decode_(torch::Tensor x, torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor slots,
                             torch::Tensor in_weight, c10::optional<torch::Tensor> in_bias, torch::Tensor taps,
                             c10::optional<torch::Tensor> conv_bias, torch::Tensor x_proj_weight,
                             torch::Tensor dt_weight, torch::Tensor dt_bias, torch::Tensor A, torch::Tensor Dskip,
                             torch::Tensor out_weight, c10::optional<torch::Tensor> out_bias);
std::vector<torch::Tensor> decoder_layer_decode_(
    torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor positions, torch::Tensor norm1_weight,
    double norm1_eps, torch::Tensor qkv_weight, c10::optional<torch::Tensor> qkv_bias, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, torch::Tensor rope_table, int64_t rotary_dim, torch::Tensor k_cache,
    torch::Tensor v_cache, torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
    double scale, torch::Tensor o_weight, c10::optional<torch::Tensor> o_bias, torch::Tensor norm2_weight,
    double norm2_eps, torch::Tensor gate_up_weight, c10::optional<torch::Tensor> gate_up_bias,
    torch::Tensor down_weight, c10::optional<torch::Tensor> down_bias);
torch::Tensor conv1d_update_(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor taps,
                             c10::optional<torch::Tensor> bias, bool float_accumulate, bool silu_float32);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps);
bool rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor table, torch::Tensor positions, int64_t rotary_dim);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor conv1d_prefill(torch::Tensor x, torch::Tensor history, torch::Tensor weight,
                             c10::optional<torch::Tensor> bias, bool silu_float32);
torch::Tensor dt_softplus(torch::Tensor dt, torch::Tensor dt_bias, double lo, double hi);
torch::Tensor gated_rms_norm(torch::Tensor y, torch::Tensor gate, torch::Tensor weight, int64_t group_size,
                             double eps, bool norm_before_gate);
std::vector<torch::Tensor> selective_scan_fwd(torch::Tensor u, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                              torch::Tensor C, c10::optional<torch::Tensor> h0,
                                              std::vector<int64_t> offsets, c10::optional<torch::Tensor> D,
                                              c10::optional<torch::Tensor> z, c10::optional<torch::Tensor> dt_bias);
std::vector<torch::Tensor> ssd_scan_fwd(torch::Tensor x, torch::Tensor dt, torch::Tensor A, torch::Tensor B,
                                        torch::Tensor C, c10::optional<torch::Tensor> D,
                                        c10::optional<torch::Tensor> h0, std::vector<int64_t> offsets);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Kernels run without the GIL (arguments are converted before, results after): the server's event-loop
  // thread keeps serving sockets while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of a prompt chunk over the paged cache (CPU, AVX-512)", nogil);
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether paged_prefill_attention has a kernel for a dtype and head size", nogil);
  m.def("write_kv_cache", &write_kv_cache, "new K/V rows into the paged cache at their slots (CPU)", nogil);
  m.def("fast_linear", &fast_linear, "x @ weight.T + bias for few rows of x (CPU: AVX-512, or AVX2 in float32)", nogil);
  m.def("ssd_state_update_", &ssd_state_update_, "Mamba2 decode: state update in place, returns y", nogil);
  m.def("mamba2_decode_", &mamba2_decode_, "Mamba2 decode after in_proj: conv, step sizes, state update; returns y",
        nogil);
  m.def("mamba2_mixer_decode_", &mamba2_mixer_decode_,
        "Mamba2 mixer decode with its gated norm, in_proj to out_proj, few-row kernels; states updated in place", nogil);
  m.def("selective_state_update_", &selective_state_update_, "Mamba1 decode: step sizes and state update in place, returns (C.h + u*D) * silu(z)", nogil);
  m.def("mamba1_decode_", &mamba1_decode_,
        "Mamba1 mixer decode, in_proj to out_proj, few-row kernels; conv and ssm states updated in place", nogil);
  m.def("decoder_layer_decode_", &decoder_layer_decode_,
        "Llama-style decoder layer decode (norms, attention over the paged cache, SwiGLU MLP), few-row kernels",
        nogil);
  m.def("conv1d_update_", &conv1d_update_, "causal depthwise conv of one new token, conv state shifted in place",
        py::arg("conv_state"), py::arg("slots"), py::arg("x"), py::arg("taps"), py::arg("bias"),
        py::arg("float_accumulate"), py::arg("silu_float32") = false, nogil);
  m.def("conv1d_prefill", &conv1d_prefill, "causal depthwise conv of a chunk, time-major", py::arg("x"),
        py::arg("history"), py::arg("weight"), py::arg("bias"), py::arg("silu_float32") = false, nogil);
  m.def("dt_softplus", &dt_softplus, "Mamba2 step sizes: clamp(softplus(dt + bias)) as float32", nogil);
  m.def("gated_rms_norm", &gated_rms_norm, "Mamba2 gated RMSNorm over channel groups, float32", nogil);
  m.def("rotary_", &rotary_, "rotate-half rotary embedding of q and k, in place", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up]", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, rounded as transformers", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm of the sum in the weight's dtype", nogil);
  m.def("selective_scan_fwd", &selective_scan_fwd, "Mamba1 prefill scan of one sequence (sequential, O(L*D) memory)", nogil);
  m.def("ssd_scan_fwd", &ssd_scan_fwd, "Mamba2 prefill recurrence of one sequence (sequential, O(L*H*P) memory)", nogil);
  m.def("fast_linear_supported", &fast_linear_supported, "whether fast_linear has a kernel for a dtype", nogil);
  m.def("simd_float32_lanes", &simd_float32_lanes, "float32 lanes of the build's widest vector (16, 8 or 0)", nogil);
  m.def("packed_linear", &packed_linear, "x @ W.T + bias from W in 48-column panels (CPU: AVX-512 or AVX2)", nogil);
  m.def("pack_linear_weight_", &pack_linear_weight_, "W [N, K] into packed_linear's panels, in place", nogil);
  m.def("packed_linear_supported", &packed_linear_supported,
        "whether packed_linear has a kernel for a dtype and in_features", nogil);
}
