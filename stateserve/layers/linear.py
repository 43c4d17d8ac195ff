"""Decode-shaped linear layers on CPU.

A decode step multiplies every weight matrix by a handful of rows (one per running request). PyTorch's CPU
kernels do that at well under the machine's memory bandwidth, so after loading, the runner turns each
`nn.Linear` of a CPU model into a `FastLinear` (same parameters, same state dict): products with at most
`max_rows` rows go through the C++ kernel in csrc/linear.cpp, everything else (prefill chunks, autograd)
through `F.linear`. Model code keeps using plain `nn.Linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers import cpu_kernels

logger = logging.getLogger("stateserve")

# Up to how many rows the kernel beats F.linear, by dtype (bench/linear_kernel.py measures the crossover:
# float32 stays ahead through ~32 rows, bfloat16 through ~16; beyond, the products are compute-bound and
# oneDNN/MKL tile them better).
MAX_ROWS = {torch.float32: 32, torch.bfloat16: 16}


class FastLinear(nn.Linear):
    """nn.Linear with a few-row fast path; installed over nn.Linear instances by `install_fast_linear`."""

    max_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] else 0
        if 0 < rows <= self.max_rows and x.dtype == self.weight.dtype and not torch.is_grad_enabled():
            out = cpu_kernels.load().fast_linear(x.reshape(rows, x.shape[-1]), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def install_fast_linear(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Turn the model's CPU nn.Linear layers into FastLinear where the kernel supports the dtype.
    Returns how many layers were converted (0 when the kernels are off or unavailable)."""
    max_rows = MAX_ROWS.get(dtype, 0)
    if device.type != "cpu" or not max_rows:
        return 0
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.fast_linear_supported(dtype):
        return 0
    count = 0
    for module in model.modules():
        # exact type: subclasses of nn.Linear may carry their own forward
        if type(module) is nn.Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
            module.__class__ = FastLinear
            module.max_rows = max_rows
            count += 1
    logger.debug("fast CPU linear kernel on %d layers (<= %d rows)", count, max_rows)
    return count
