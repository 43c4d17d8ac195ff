"""RMSNorm (computed in float32, like transformers) and its gated variant used by Mamba2."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.platform import kernels

# On CPU the fused C++ kernels serve every row count: for a few decode rows they save PyTorch's dispatches, for
# prefill chunks the float32 temporaries (and their page faults) of the 5-7 elementwise ops they replace.

class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            kernel = kernels.table(x.device).rms_norm(x.dtype, self.weight.dtype)
            if kernel is not None:
                return kernel(x, self.weight, self.eps)
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
        if x.dim() == 2 and residual.is_contiguous() and x.shape == residual.shape:
            kernel = kernels.table(x.device).add_rms_norm(residual.dtype, x.dtype, self.weight.dtype)
            if kernel is not None:
                return kernel(residual, x, self.weight, self.eps), residual
        residual = residual + x
        return self(residual.to(self.weight.dtype)), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    if x.dim() == 2:
        kernel = kernels.table(x.device).silu_and_mul(x.dtype)
        if kernel is not None:
            return kernel(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
