"""Linear layers on CPU, routed by the number of rows.

A decode step multiplies every weight matrix by a handful of rows (one per running request). PyTorch's CPU
kernels do that at well under the machine's memory bandwidth, so after loading, the runner turns each
`nn.Linear` of a CPU model into a `FastLinear` (same parameters, same state dict): one or two rows go through the
C++ kernel in csrc/linear.cpp on the plain weight, more (a batch of decoding requests, a prefill chunk) through
csrc/packed_linear.cpp on a copy of the weight in 48-column panels made once after loading (`prepack`), or through
oneDNN where there is no such copy, and autograd through `F.linear`. Model code keeps using plain `nn.Linear`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from stateserve.cache import huge_pages
from stateserve.layers import cpu_kernels

logger = logging.getLogger("stateserve")

# Up to how many rows the few-row kernel beats the alternative, by dtype (measured on the benchmark machine, Zen 5
# with AVX-512, at the 30m and base shapes): ~16 rows against oneDNN on plain weights, ~2 against the panel kernel.
# On an AVX2-only Zen 3 (float32) the kernel also led oneDNN up to 16 rows (1.0-2x at 8-16 rows of the base
# shapes, 2-5x at 1-4 rows of the small ones).
MAX_ROWS = {torch.float32: 16, torch.bfloat16: 16}
MAX_ROWS_PREPACKED = {torch.float32: 2, torch.bfloat16: 2}
# With AVX2's 8-lane vectors the few-row kernel led the panel kernel up to 4 rows and trailed it from 8 (2 Zen 3
# cores, float32 GFLOP/s few-row / panel: [3072, 768] 4 rows 98 / 82, 8 rows 105 / 122; [768, 1536] 88 / 77 and
# 89 / 121); both led oneDNN at every row count from 3 to 512 (the panel kernel by 1.03-2.4x). In bfloat16 (half the
# bytes to stream, widened in registers) the few-row kernel led up to 8 rows, over a base model's 24 weights read from
# memory (ms, few-row / panel: 1 row 4.0 / 5.6, 4 rows 5.9 / 7.4, 6 rows 7.4 / 8.2, 8 rows 9.2 / 10.0); there is no
# oneDNN bfloat16 there.
MAX_ROWS_PREPACKED_8_LANES = {torch.float32: 4, torch.bfloat16: 8}

# Why the panel kernel and not oneDNN past two rows: Llama-base layer shapes, GFLOP/s on two cores (panel kernel /
# oneDNN on its own blocked copy of the weight / oneDNN on the plain weight): bfloat16 8 rows 370 / 212 / 96,
# 37 rows 402 / 355 / 229, 256 rows 430 / 427 / 406, 2048 rows 431 / 437 / 405; float32 8 rows 153 / 100 / 69,
# 37 rows 213 / 188 / 141, 2048 rows 207 / 204 / 199. One extra copy of the weights serves every batch size.
PANEL_COLUMNS = 48  # output columns per panel of csrc/packed_linear.cpp
# A bfloat16 layer with neither kernel nor oneDNN (a CPU without AVX2, or kernels that did not build, where oneDNN
# has no bfloat16 either) computes from this many rows on in float32: PyTorch's own bfloat16 matmul ran ~1 GFLOP/s on
# an AVX2-only Zen 3. [3072, 768] weight, 2 cores, ms (bfloat16 / float32 with the weight converted each call): 4 rows
# 0.95 / 1.05, 16 rows 3.75 / 1.36, 64 rows 14.9 / 2.6, 512 rows 120 / 18.
UPCAST_MIN_ROWS = 8


def max_rows_prepacked(dtype: torch.dtype) -> int:
    """Up to how many rows a prepacked layer of `dtype` keeps using the few-row kernel, for this build's vectors."""
    kernels = cpu_kernels.load()
    if kernels is not None and kernels.simd_float32_lanes() == 8:
        return MAX_ROWS_PREPACKED_8_LANES.get(dtype, 0)
    return MAX_ROWS_PREPACKED[dtype]


def _onednn_linear(dtype: torch.dtype):
    """oneDNN's linear on dense weights of `dtype`, or None. Why not F.linear: PyTorch's float32 CPU matmul goes to
    MKL's sgemm, which on AMD processors runs ~2x below oneDNN (150-190 vs 400+ GFLOP/s on 2 Zen 5 cores, at 64-2048
    rows); for bfloat16 both reach oneDNN. The op is the one inductor's CPU backend emits for frozen linears."""
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    return op if op is not None and _runs(op, dtype) else None


def _runs(op, dtype: torch.dtype) -> bool:
    """Whether `op` computes a small linear in `dtype` as F.linear does. The op exists in every build we pin, but
    oneDNN refuses bfloat16 on processors without AVX-512 ("could not create a primitive descriptor")."""
    try:
        x, w = torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype)
        return torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w))
    except (RuntimeError, TypeError):
        return False


class FastLinear(nn.Linear):
    """nn.Linear with CPU fast paths; installed over nn.Linear instances by `install_fast_linear`. Without grad:
    at most `max_rows` rows go through the few-row kernel, more through the panel kernel when the weight is packed,
    else through oneDNN (`onednn`), else (`upcast`, bfloat16 from UPCAST_MIN_ROWS rows) F.linear in float32, else
    F.linear."""

    max_rows: int = 0
    onednn = None
    upcast: bool = False
    packed: torch.Tensor | None = None  # int32 [panels, K / step, PANEL_COLUMNS]: the weight in the panel layout
    packed_from: tuple[int, int] | None = None  # (data_ptr, version) of the weight it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def prepack(self) -> int:
        """Keeps a copy of the weight in the panel kernel's layout for products past max_rows_prepacked rows (the
        few-row kernel's `max_rows` drops to that). Returns the bytes of the copy (0: no kernel for this dtype or
        in_features here)."""
        kernels = cpu_kernels.load()
        weight = self.weight.detach()
        if kernels is None or not kernels.packed_linear_supported(weight.dtype, self.in_features):
            return 0
        step = 2 if weight.dtype == torch.bfloat16 else 1
        shape = (-(-self.out_features // PANEL_COLUMNS), self.in_features // step, PANEL_COLUMNS)
        packed = huge_pages.zeros(shape, torch.int32)
        self.packed = packed if packed is not None else torch.zeros(shape, dtype=torch.int32)
        kernels.pack_linear_weight_(self.packed, weight)
        self.packed_from = (weight.data_ptr(), weight._version)
        if self.max_rows:
            self.max_rows = min(self.max_rows, max_rows_prepacked(weight.dtype))
        return self.packed.numel() * self.packed.element_size()

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
            out = cpu_kernels.load().packed_linear(flat, self.packed, bias, self.out_features)
        elif self.onednn is not None:
            out = self.onednn(flat.contiguous(), weight, bias, "none", [], "")
        elif self.upcast and rows >= UPCAST_MIN_ROWS:
            out = F.linear(flat.float(), weight.float(), None if bias is None else bias.float()).to(weight.dtype)
        else:
            return F.linear(x, weight, bias)
        return out if two_d else out.view(*x.shape[:-1], self.out_features)


def few_row_limit(layers: Sequence[nn.Module]) -> int:
    """Up to how many rows every one of `layers` takes the few-row kernel (FastLinear.product's first route); 0
    when one of them is not a FastLinear with that kernel or their dtypes differ."""
    if not all(isinstance(layer, FastLinear) for layer in layers) or \
            len({layer.weight.dtype for layer in layers}) != 1:
        return 0
    return min(layer.max_rows for layer in layers)


@dataclass(frozen=True)
class FewRowCall:
    """What a fused kernel that runs a layer's projections through the few-row kernel takes from the layer: its
    weights and configuration in the kernel's forms, for up to `max_rows` rows of `dtype`. Made once per weight
    version (param_cache.derived_from_module) after the weights are prepacked at load; switches that may change
    between steps (Mamba2's clamp_dt_on_decode) stay out of it and are read per call."""
    max_rows: int
    dtype: torch.dtype
    args: tuple

    def applies(self, x: torch.Tensor) -> bool:
        """Whether x ([rows, features]) goes to the few-row kernel now, as FastLinear.product would route it."""
        return x.dim() == 2 and 0 < x.shape[0] <= self.max_rows and x.dtype == self.dtype \
            and not torch.is_grad_enabled()


def linear_without_bias(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ layer.weight.T, leaving the layer's bias out (Mamba1 adds dt_proj's bias later, before the softplus),
    through FastLinear's kernels when the layer is one: PyTorch's bfloat16 path takes ~16 us for a one-row
    [48 -> 1536] product that the kernel does in ~4."""
    if isinstance(layer, FastLinear):
        return layer.product(x, None)
    return F.linear(x, layer.weight)


def prepack_fast_linear(model: nn.Module) -> int:
    """Packs every FastLinear of the model for the panel kernel (see FastLinear.prepack); returns the bytes added."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, FastLinear))


def install_fast_linear(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Turn the model's CPU nn.Linear layers of a float32 or bfloat16 model into FastLinear. Returns how many layers
    were converted (0 when neither the kernel nor oneDNN is available and the dtype is float32)."""
    if device.type != "cpu" or dtype not in MAX_ROWS:
        return 0
    kernels = cpu_kernels.load()
    max_rows = MAX_ROWS[dtype] if kernels is not None and kernels.fast_linear_supported(dtype) else 0
    onednn = _onednn_linear(dtype)
    upcast = False
    if not max_rows and onednn is None:
        if dtype != torch.bfloat16:
            return 0
        upcast = True  # no AVX-512 and no kernels: PyTorch's own bfloat16 matmul crawls there (~1 GFLOP/s)
        logger.warning("this CPU (%s) has no fast bfloat16 matmul: bfloat16 linears of %d rows or more compute in "
                       "float32 (converting the weight each call), fewer rows in bfloat16; dtype='float32' is "
                       "faster here", torch.backends.cpu.get_cpu_capability(), UPCAST_MIN_ROWS)
    count = 0
    for module in model.modules():
        # exact type: subclasses of nn.Linear may carry their own forward
        if type(module) is nn.Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
            module.__class__ = FastLinear
            module.max_rows = max_rows
            module.onednn = onednn
            module.upcast = upcast
            count += 1
    logger.debug("fast CPU linear on %d layers (kernel <= %d rows, oneDNN %s, float32 upcast %s)", count, max_rows,
                 "beyond" if onednn is not None else "off", "on" if upcast else "off")
    return count
