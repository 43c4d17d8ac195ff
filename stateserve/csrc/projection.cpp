// The projections of the fused decode calls (decoder_layer.cpp, ssm_update.cpp's mamba2_mixer_decode_,
// mamba1_update.cpp's mamba1_decode_): a float weight in nn.Linear's layout through fast_linear, a packed
// block-quantized one (q8_0_pack / q4_pack / q6_k_pack: uint8, 1-D, its trailer naming the format, N and K) through
// that format's product. So a quantized model's decode layer runs in one call as a float one does, the same products
// its QuantLinear modules compute one by one.
#include <ATen/core/Tensor.h>  // (not torch/extension.h: its headers cost each source ~10x the compile time)
#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <cstring>
#include "kernels.h"
#include "quant_q6k.h"
#include "quant_q8_0.h"

namespace {
// The packed weight's trailer: (magic, N, K, a full panel's bytes).
void read_trailer(const at::Tensor& weight, int64_t trailer[4]) {
  TORCH_CHECK(weight.dim() == 1 && weight.numel() >= stateserve_quant::kTrailerBytes,
              "project: a uint8 weight must be a packed quantized weight (q8_0_pack / q4_pack / q6_k_pack)");
  std::memcpy(trailer, weight.data_ptr<uint8_t>() + weight.numel() - stateserve_quant::kTrailerBytes,
              4 * sizeof(int64_t));
}
}  // namespace

int64_t projection_outputs(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kByte) return weight.size(0);
  int64_t trailer[4];
  read_trailer(weight, trailer);
  return trailer[1];
}

int64_t projection_inputs(const at::Tensor& weight) {
  if (weight.scalar_type() != at::kByte) return weight.size(1);
  int64_t trailer[4];
  read_trailer(weight, trailer);
  return trailer[2];
}

at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      bool quantize_activations) {
  if (weight.scalar_type() != at::kByte) return fast_linear(x, weight, bias);
  int64_t trailer[4];
  read_trailer(weight, trailer);
  const int64_t N = trailer[1], K = trailer[2];
  if (trailer[0] == stateserve_q8::kMagic) return q8_0_linear(x, weight, bias, N, K, quantize_activations);
  if (trailer[0] == stateserve_q6k::kMagic) return q6_k_linear(x, weight, bias, N, K, quantize_activations);
  return q4_linear(x, weight, bias, N, K, quantize_activations);  // which checks its magic
}
