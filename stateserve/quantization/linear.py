"""QuantLinear: a linear layer whose weight lives only as Q8_0 codes and scales, packed once at load for the C++
kernels (csrc/quant_linear.cpp); no float copy of the weight is kept beside them.

Two modes (EngineConfig.quantization): "int8" quantizes each row of activations per block of 32 as llama.cpp does
(Q8_0 rounding) and multiplies with integer dot products, the fast mode; "int8_weight_only" multiplies the float
activations by the dequantized weights (float32 accumulation), exact up to float32 round-off, for tests and users
who want no activation rounding. Without the C++ kernels the same arithmetic runs in PyTorch (slowly; the install
says so in the log)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.quantization import q8_0


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W in Q8_0. x: [..., K] float32 or bfloat16 -> y: [..., N], x's dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 quantize_activations: bool, kernels: object | None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.quantize_activations = quantize_activations
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernel = getattr(kernels, "q8_0_linear", None)  # the C++ product, None: PyTorch
        if self.kernel is not None:
            self.register_buffer("packed", kernels.q8_0_pack(codes.contiguous(), scales.contiguous()),
                                 persistent=False)
        else:
            self.register_buffer("codes", codes.contiguous(), persistent=False)
            self.register_buffer("scales", scales.contiguous(), persistent=False)

    def extra_repr(self) -> str:
        mode = "int8" if self.quantize_activations else "int8_weight_only"
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0, {mode}, " \
               f"kernel={'C++' if self.kernel is not None else 'PyTorch'}"

    @property
    def weight_bytes(self) -> int:
        tensors = [self.packed] if self.kernel is not None else [self.codes, self.scales]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias (bias None: none); the same call as FastLinear.product."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"a Q8_0 linear takes float32 or bfloat16 activations, got {x.dtype}")
        flat = x.reshape(-1, self.in_features)
        if self.kernel is not None:
            out = self.kernel(flat.contiguous(), self.packed, bias, self.out_features, self.in_features,
                              self.quantize_activations)
        else:
            xs = q8_0.fake_quantize(flat) if self.quantize_activations else flat.float()
            out = F.linear(xs, q8_0.dequantize(self.codes, self.scales), None if bias is None else bias.float())
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)
