"""RMSNorm (computed in float32, like transformers) and its gated variant used by Mamba2."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers import cpu_kernels

# On CPU the fused C++ kernels serve every row count: for a few decode rows they save PyTorch's dispatches, for
# prefill chunks the float32 temporaries (and their page faults) of the 5-7 elementwise ops they replace.

class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.device.type == "cpu" and x.dtype == self.weight.dtype \
                and x.dtype in (torch.float32, torch.bfloat16):
            kernels = cpu_kernels.load()
            if kernels is not None:
                return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                    stream_float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-stream add and this norm: returns (self(sum.to(weight dtype)), sum) with sum = residual + x
        in residual's dtype (float32 under residual_in_fp32). On CPU one kernel, which updates `residual` in place
        and returns it as the sum: the caller must own it (the stream of its own forward). residual None (the first
        block): the stream starts as a copy of x, in float32 when stream_float32."""
        # residual, x: [T, hidden]
        if residual is None:
            residual = x.float() if stream_float32 and x.dtype != torch.float32 else x.clone()
            return self(x.to(self.weight.dtype)), residual
        if x.dim() == 2 and x.device.type == "cpu" and residual.is_contiguous() and x.shape == residual.shape \
                and (residual.dtype, x.dtype, self.weight.dtype) in _ADD_NORM_DTYPES:
            kernels = cpu_kernels.load()
            if kernels is not None:
                return kernels.add_rms_norm_(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self(residual.to(self.weight.dtype)), residual


_f32, _bf16 = torch.float32, torch.bfloat16
# (residual, x, weight) dtypes that add_rms_norm_ takes: plain float32 or bfloat16 streams, and a float32 stream
# of a bfloat16 model (residual_in_fp32)
_ADD_NORM_DTYPES = {(_f32, _f32, _f32), (_bf16, _bf16, _bf16), (_f32, _bf16, _bf16)}


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    if x.dim() == 2 and x.device.type == "cpu" and \
            x.dtype in (torch.float32, torch.bfloat16):
        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
