// The Python module of the CPU kernels: one binding per kernel, the kernels live in their own files.
#include <torch/extension.h>
#include "isa.h"
#include "kernels.h"

// The build's widest float32 vector and its paths in one word (FastLinear's row limits, the kernel table's log, the
// tests of each STATESERVE_CPU_ISA build).
int64_t simd_float32_lanes() {
#if SS_HAS_AVX512
  return 16;
#elif SS_HAS_AVX2
  return 8;
#else
  return 0;
#endif
}
std::string compiled_isa() { return SS_ISA_NAME; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Kernels run without the GIL (arguments are converted before, results after): the server's event-loop
  // thread keeps serving sockets while the engine thread computes.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", nogil);
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of a prompt chunk over the paged cache (CPU, AVX-512 or AVX2)", nogil);
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether paged_prefill_attention has a kernel for a dtype and head size", nogil);
  m.def("write_kv_cache", &write_kv_cache, "new K/V rows into the paged cache at their slots (CPU)", nogil);
  m.def("fast_linear", &fast_linear, "x @ weight.T + bias for few rows of x (float32 or bfloat16, every build)", nogil);
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
  m.def("delta_rule_decode_", &delta_rule_decode_, "one delta-rule decode step (gated delta net, KDA) on the "
        "float32 states at slots, in place; returns q^T S", nogil);
  m.def("gated_delta_decode_", &gated_delta_decode_, "the gated delta net's decode step after its conv: q, k, v, "
        "decay and beta from the conv output and b / a, then the delta rule on the states at slots", nogil);
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
  m.def("rms_norm_f32_weight", &rms_norm_f32_weight, "RMSNorm of bfloat16 rows by a float32 weight, multiplied "
        "in float32 and rounded once", nogil);
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then RMSNorm of the sum in the weight's dtype", nogil);
  m.def("selective_scan_fwd", &selective_scan_fwd, "Mamba1 prefill scan of one sequence (sequential, O(L*D) memory)", nogil);
  m.def("ssd_scan_fwd", &ssd_scan_fwd, "Mamba2 prefill recurrence of one sequence (sequential, O(L*H*P) memory)", nogil);
  m.def("fast_linear_supported", &fast_linear_supported, "whether fast_linear has a kernel for a dtype", nogil);
  m.def("simd_float32_lanes", &simd_float32_lanes, "float32 lanes of the build's widest vector (16, 8 or 0)", nogil);
  m.def("compiled_isa", &compiled_isa, "the instruction sets of this build: avx512_bf16, avx512, avx2 or scalar");
  // lane_order: every output summed in fast_linear's order (bit-identical to it), from panels packed the same way
  m.def("packed_linear", &packed_linear, "x @ W.T + bias from W in 48-column panels (CPU: AVX-512 or AVX2)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("lane_order") = false,
        nogil);
  m.def("pack_linear_weight_", &pack_linear_weight_, "W [N, K] into packed_linear's panels, in place",
        py::arg("packed"), py::arg("weight"), py::arg("lane_order") = false, nogil);
  m.def("q8_0_supported", &q8_0_supported, "whether this build has the Q8_0 kernels", nogil);
  m.def("q8_0_dot_path", &q8_0_dot_path,
        "the int8 product of q8_0_linear's A8 mode here: avx512_vnni, avx512bw, avx2 or scalar", nogil);
  m.def("q8_0_pack", &q8_0_pack, "Q8_0 codes int8 [N, K] and scales float16 [N, K/32] into q8_0_linear's panels",
        py::arg("codes"), py::arg("scales"), nogil);
  m.def("q8_0_unpack", &q8_0_unpack, "(codes, scales) of a packed Q8_0 weight", py::arg("packed"), py::arg("N"),
        py::arg("K"), nogil);
  m.def("q8_0_linear", &q8_0_linear,
        "x @ W.T + bias with W packed Q8_0: int8 activations per block of 32 and integer dot products "
        "(quantize_activations) or float activations times the dequantized weights",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("N"), py::arg("K"),
        py::arg("quantize_activations") = true, nogil);
  m.def("q4_supported", &q4_supported, "whether this build has the Q4_0 / Q4_1 / Q4_K kernels", nogil);
  m.def("q4_pack", &q4_pack,
        "Q4 weight fields into q4_linear's panels: format 'q4_0' | 'q4_1' | 'q4_k', codes uint8 [N, K] (0..15), "
        "d float16 [N, K/32] (q4_k: [N, K/256]), m: q4_1's float16 [N, K/32] or q4_k's dmin [N, K/256], "
        "sc and mn: q4_k's uint8 [N, K/32] (0..63)",
        py::arg("format"), py::arg("codes"), py::arg("d"), py::arg("m") = py::none(), py::arg("sc") = py::none(),
        py::arg("mn") = py::none(), nogil);
  m.def("q4_unpack", &q4_unpack, "(format, codes, d, m, sc, mn) of a packed Q4 weight, None where the format has none",
        py::arg("packed"), py::arg("N"), py::arg("K"), nogil);
  m.def("q4_linear", &q4_linear,
        "x @ W.T + bias with W packed Q4_0 / Q4_1 / Q4_K: int8 activations per block of 32 and integer dot products "
        "(quantize_activations) or float activations times the dequantized weights",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("N"), py::arg("K"),
        py::arg("quantize_activations") = true, nogil);
  m.def("q4_k_quantize", &q4_k_quantize,
        "float32 w [N, K] (K a multiple of 256) -> [codes uint8 [N, K], d float16 [N, K/256], dmin float16 [N, K/256], "
        "sc uint8 [N, K/32], mn uint8 [N, K/32]]: llama.cpp's quantize_row_q4_K_ref bit for bit",
        py::arg("w"), nogil);
  m.def("q6_k_pack", &q6_k_pack,
        "Q6_K weight fields into q6_k_linear's panels: codes uint8 [N, K] (0..63), sc int8 [N, K/16], d float16 "
        "[N, K/256] (w = d * sc * (codes - 32))",
        py::arg("codes"), py::arg("sc"), py::arg("d"), nogil);
  m.def("q6_k_unpack", &q6_k_unpack, "(codes, sc, d) of a packed Q6_K weight", py::arg("packed"), py::arg("N"),
        py::arg("K"), nogil);
  m.def("q6_k_linear", &q6_k_linear,
        "x @ W.T + bias with W packed Q6_K: int8 activations per block of 32 and integer dot products "
        "(quantize_activations) or float activations times the dequantized weights",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("N"), py::arg("K"),
        py::arg("quantize_activations") = true, nogil);
  m.def("packed_linear_supported", &packed_linear_supported,
        "whether packed_linear has a kernel for a dtype and in_features", nogil);
}
