"""Linear layers on CPU, routed by the number of rows.

A decode step multiplies every weight matrix by a handful of rows (one per running request). PyTorch's CPU
kernels do that at well under the machine's memory bandwidth, so after loading, the runner turns each
`nn.Linear` of a CPU model into a `FastLinear` (same parameters, same state dict): products with at most
`max_rows` rows go through the C++ kernel in csrc/linear.cpp, larger ones (prefill chunks, wide batches) through
oneDNN, and autograd through `F.linear`. Model code keeps using plain `nn.Linear`.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.layers import cpu_kernels

logger = logging.getLogger("stateserve")

# Up to how many rows the kernel beats oneDNN, by dtype (measured on the benchmark machine, Zen 5 with AVX-512, at
# the 30m and base shapes): both dtypes through ~16 rows against oneDNN on plain weights, ~2 rows against oneDNN
# on weights reordered into its blocked layout (prepacked; 4096 x 768 at 16 rows: float32 0.50 -> 0.38 ms,
# bfloat16 at 64 rows 0.60 -> 0.48 ms).
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
MAX_ROWS_PREPACKED = {torch.float32: 2, torch.bfloat16: 2}
PREPACK_BATCH_HINT = 64  # the row count oneDNN picks its weight layout for (float32 needs >= 16; bf16 indifferent)


def _onednn_linear():
    """oneDNN's linear on dense weights, or None. Why not F.linear: PyTorch's float32 CPU matmul goes to MKL's
    sgemm, which on AMD processors runs ~2x below oneDNN (150-190 vs 400+ GFLOP/s on 2 Zen 5 cores, at 64-2048
    rows); for bfloat16 both reach oneDNN. The op is the one inductor's CPU backend emits for frozen linears."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if op is None:
        return None
    try:  # the op exists in every build we pin, but check it runs before relying on it
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        if not torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)):
            return None
    except (RuntimeError, TypeError):
        return None
    return op


class FastLinear(nn.Linear):
    """nn.Linear with CPU fast paths; installed over nn.Linear instances by `install_fast_linear`. Without grad:
    at most `max_rows` rows go through the C++ kernel, more through oneDNN (`onednn`), else F.linear."""

    max_rows: int = 0
    onednn = None
    packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout (an opaque mkldnn tensor)
    packed_from: tuple[int, int] | None = None  # (data_ptr, version) of the weight it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def prepack(self) -> int:
        """Keeps a copy of the weight in oneDNN's blocked layout for products past `max_rows` (which drops to
        MAX_ROWS_PREPACKED). Returns the bytes of the copy (0: no oneDNN)."""
        if self.onednn is None:
            return 0
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PREPACK_BATCH_HINT)
        self.packed_from = (self.weight.data_ptr(), self.weight._version)
        if self.max_rows:
            self.max_rows = min(self.max_rows, MAX_ROWS_PREPACKED[self.weight.dtype])
        return self.weight.numel() * self.weight.element_size()

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias (bias None: none), routed by rows."""
        weight = self.weight  # one nn.Module attribute lookup: this runs ~50 times a decode token
        if x.dtype != weight.dtype or torch.is_grad_enabled():
            return F.linear(x, weight, bias)
        two_d = x.dim() == 2  # the model's [tokens, features]: no reshape or view (~2.5 us of a few-row product)
        rows = x.shape[0] if two_d else (x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] else 0)
        if not rows or not x.shape[-1]:
            return F.linear(x, weight, bias)
        flat = x if two_d else x.reshape(rows, x.shape[-1])
        if rows <= self.max_rows:
            out = cpu_kernels.load().fast_linear(flat, weight, bias)
        elif self.packed is not None:
            if self.packed_from != (weight.data_ptr(), weight._version):
                self.prepack()  # the weight was written or replaced since (a reload): pack it again
            out = self.onednn(flat.contiguous(), self.packed, bias, "none", [], "")
        elif self.onednn is not None:
            out = self.onednn(flat.contiguous(), weight, bias, "none", [], "")
        else:
            return F.linear(x, weight, bias)
        return out if two_d else out.view(*x.shape[:-1], self.out_features)


def linear_without_bias(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ layer.weight.T, leaving the layer's bias out (Mamba1 adds dt_proj's bias later, before the softplus),
    through FastLinear's kernels when the layer is one: PyTorch's bfloat16 path takes ~16 us for a one-row
    [48 -> 1536] product that the kernel does in ~4."""
    if isinstance(layer, FastLinear):
        return layer.product(x, None)
    return F.linear(x, layer.weight)


def prepack_fast_linear(model: nn.Module) -> int:
    """Prepacks every FastLinear of the model for oneDNN (see FastLinear.prepack); returns the bytes added."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, FastLinear))


def install_fast_linear(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Turn the model's CPU nn.Linear layers of a float32 or bfloat16 model into FastLinear. Returns how many layers
    were converted (0 when neither the kernel nor oneDNN is available)."""
    if device.type != "cpu" or dtype not in MAX_ROWS:
        return 0
    kernels = cpu_kernels.load()
    max_rows = MAX_ROWS[dtype] if kernels is not None and kernels.fast_linear_supported(dtype) else 0
    onednn = _onednn_linear()
    if not max_rows and onednn is None:
        return 0
    count = 0
    for module in model.modules():
        # exact type: subclasses of nn.Linear may carry their own forward
        if type(module) is nn.Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
            module.__class__ = FastLinear
            module.max_rows = max_rows
            module.onednn = onednn
            count += 1
    logger.debug("fast CPU linear on %d layers (kernel <= %d rows, oneDNN %s)", count, max_rows,
                 "beyond" if onednn is not None else "off")
    return count
