// The one-token causal conv of Mamba-style layers (conv_update.cpp), for kernels that run it inside a fused step.
#pragma once
#include <torch/extension.h>

// What the conv's outputs become: y itself in x's dtype T (kConv), its SiLU rounded to T (kSilu: what F.silu on y
// gives, the next layer's input) or that SiLU as float32 (kSiluFloat32, for a float32 state update).
enum class ConvOutput { kConv, kSilu, kSiluFloat32 };

torch::Tensor conv1d_update(torch::Tensor conv_state, torch::Tensor slots, torch::Tensor x, torch::Tensor taps,
                            c10::optional<torch::Tensor> bias, bool float_accumulate, ConvOutput output);
