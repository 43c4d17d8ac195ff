"""QuantLinear: a linear layer whose weight lives only in a llama.cpp block format (formats.py: Q8_0, Q4_0, Q4_1,
Q4_K, Q6_K), packed once at load for the C++ kernels (csrc/quant_linear.cpp, csrc/quant_q4*.cpp, csrc/quant_q6k*.cpp);
no float copy of the weight is kept beside it.

Two modes (EngineConfig.quantization): int8 activations (the default) quantize each row of x per block of 32 as
llama.cpp does (Q8_0 rounding) and multiply with integer dot products, the fast mode; weight-only ("..._weight_only")
multiplies the float activations by the weights dequantized in registers (float32 accumulation), exact up to
float32 round-off, for tests and users who want no activation rounding. Without the C++ kernels the same arithmetic
runs in PyTorch, dequantizing the weight at every call (slowly; the load says so in the log)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.quantization import q8_0
from stateserve.quantization.formats import QuantizedWeight


_PRODUCTS = {"q8_0": "q8_0_linear", "q6_k": "q6_k_linear"}  # the kernel of each format (the Q4 formats: q4_linear)


def _pack(kernels: object, weight: QuantizedWeight) -> torch.Tensor:
    f = weight.fields
    if weight.fmt == "q8_0":
        return kernels.q8_0_pack(f["codes"].contiguous(), f["scales"].contiguous())  # type: ignore[attr-defined]
    if weight.fmt == "q6_k":
        return kernels.q6_k_pack(f["codes"], f["sc"], f["d"])  # type: ignore[attr-defined]
    return kernels.q4_pack(weight.fmt, *(t.contiguous() for t in f.values()))  # type: ignore[attr-defined]


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W in a block format. x: [..., K] float32 or bfloat16 -> y: [..., N], x's dtype.

    W may come in parts of different formats stacked along N (a fused q/k/v projection whose v rows a GGUF file
    stores at more bits than q and k): each part is its own product, their outputs joined."""

    def __init__(self, weight: QuantizedWeight | list[QuantizedWeight], bias: torch.Tensor | None,
                 quantize_activations: bool, kernels: object | None) -> None:
        super().__init__()
        parts = weight if isinstance(weight, list) else [weight]
        self.in_features = parts[0].shape[1]
        self.part_rows = [p.shape[0] for p in parts]
        self.out_features = sum(self.part_rows)
        self.formats = [p.fmt for p in parts]
        self.fmt = parts[0].fmt if len(set(self.formats)) == 1 else "+".join(self.formats)
        self.quantize_activations = quantize_activations
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels = [getattr(kernels, _PRODUCTS.get(p.fmt, "q4_linear"), None) for p in parts]
        self._fields: list[QuantizedWeight] = []
        if all(k is not None for k in self.kernels):
            for i, part in enumerate(parts):  # buffers, so that .to() and the memory accounting see them
                self.register_buffer(f"packed{i if i else ''}", _pack(kernels, part), persistent=False)
        else:
            self.kernels = [None] * len(parts)  # the C++ product, None: PyTorch
            self._fields = parts

    @property
    def kernel(self) -> object | None:
        """The C++ product of a one-part layer (None: PyTorch, or several parts)."""
        return self.kernels[0] if len(self.kernels) == 1 else None

    @kernel.setter
    def kernel(self, fn: object) -> None:  # tests wrap it to count calls
        self.kernels = [fn]

    def extra_repr(self) -> str:
        mode = "int8 activations" if self.quantize_activations else "weight-only"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, {mode}, " \
               f"kernel={'PyTorch' if self._fields else 'C++'}"

    @property
    def weight_bytes(self) -> int:
        if self._fields:
            return sum(p.nbytes for p in self._fields)
        return sum(b.numel() for name, b in self.named_buffers() if name.startswith("packed"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias (bias None: none); the same call as FastLinear.product."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"a {self.fmt} linear takes float32 or bfloat16 activations, got {x.dtype}")
        flat = x.reshape(-1, self.in_features).contiguous()
        outs, start = [], 0
        for i, rows in enumerate(self.part_rows):
            part_bias = None if bias is None else bias[start:start + rows]
            outs.append(self._part(i, flat, part_bias, rows))
            start += rows
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.view(*x.shape[:-1], self.out_features)

    def _part(self, i: int, flat: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        if not self._fields:
            packed = getattr(self, f"packed{i if i else ''}")
            return self.kernels[i](flat, packed, bias, rows, self.in_features, self.quantize_activations)
        xs = q8_0.fake_quantize(flat) if self.quantize_activations else flat.float()
        out = F.linear(xs, self._fields[i].dequantize(), None if bias is None else bias.float())
        return out.to(flat.dtype)
