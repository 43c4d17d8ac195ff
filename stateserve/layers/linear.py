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

from stateserve.platform import huge_pages, kernels
from stateserve.platform.kernels import UPCAST_MIN_ROWS, LinearRoutes

logger = logging.getLogger("stateserve")

PANEL_COLUMNS = 48  # output columns per panel of csrc/packed_linear.cpp


class FastLinear(nn.Linear):
    """nn.Linear with CPU fast paths; installed over nn.Linear instances by `install_fast_linear`. Without grad it
    takes the routes the kernel table gives its dtype (kernels.LinearRoutes): at most `max_rows` rows through the
    few-row kernel, more through the panel kernel when the weight is packed, else oneDNN, else (bfloat16 without
    either, from UPCAST_MIN_ROWS rows) F.linear in float32, else F.linear."""

    routes: LinearRoutes | None = None
    max_rows: int = 0
    packed: torch.Tensor | None = None  # int32 [panels, K / step, PANEL_COLUMNS]: the weight in the panel layout
    packed_from: tuple[int, int] | None = None  # (data_ptr, version) of the weight it was made from
    # the packed copy sums every output in the few-row kernel's order (bit-identical results at any row count)
    lane_order: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def prepack(self, lane_order: bool | None = None) -> int:
        """Keeps a copy of the weight in the panel kernel's layout for products past the routes' max_rows_prepacked
        rows (the few-row kernel's `max_rows` drops to that); lane_order (None: as before) packs it for sums in the
        few-row kernel's order. Returns the bytes of the copy (0: no kernel for this dtype or in_features here)."""
        if lane_order is not None:
            self.lane_order = lane_order
        routes, weight = self.routes, self.weight.detach()
        if routes is None or routes.pack is None or not routes.panel_takes(self.in_features) or weight.is_meta:
            return 0
        step = 2 if weight.dtype == torch.bfloat16 else 1
        shape = (-(-self.out_features // PANEL_COLUMNS), self.in_features // step, PANEL_COLUMNS)
        packed = huge_pages.zeros(shape, torch.int32)
        self.packed = packed if packed is not None else torch.zeros(shape, dtype=torch.int32)
        routes.pack(self.packed, weight, self.lane_order)
        self.packed_from = (weight.data_ptr(), weight._version)
        if self.max_rows:
            self.max_rows = min(self.max_rows, routes.max_rows_prepacked)
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
        routes = self.routes
        if rows <= self.max_rows:
            out = routes.few_row(flat, weight, bias)
        elif self.packed is not None:
            if self.packed_from != (weight.data_ptr(), weight._version):
                self.prepack()  # the weight was written or replaced since (a reload): pack it again
            out = routes.panel(flat, self.packed, bias, self.out_features, self.lane_order)
        elif routes.onednn is not None:
            out = routes.onednn(flat.contiguous(), weight, bias, "none", [], "")
        elif routes.upcast and rows >= UPCAST_MIN_ROWS:
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


QUANT_DECODE_ROWS = 4096  # a quantized product runs the same kernel at any row count: fused at every decode size


@dataclass(frozen=True)
class DecodeProjections:
    """A layer's projections as a fused decode kernel takes them (csrc/projection.cpp): each one's weight in the
    kernel's form (a FastLinear's float weight, a QuantLinear's packed one), up to how many rows, the float
    weights' dtype (None: all quantized) and the quantized ones' activation mode."""
    max_rows: int
    dtype: torch.dtype | None
    quantize_activations: bool
    weights: tuple[torch.Tensor, ...]


def decode_projections(layers: Sequence[nn.Module]) -> DecodeProjections | None:
    """None when one of `layers` cannot run inside a fused decode kernel: not a FastLinear with the few-row kernel
    nor a one-format QuantLinear with its C++ product, float weights of two dtypes, or two activation modes."""
    from stateserve.quantization.linear import QuantLinear

    floats = [layer for layer in layers if isinstance(layer, FastLinear)]
    quantized = [layer for layer in layers if isinstance(layer, QuantLinear) and layer.kernel is not None]
    modes = {layer.quantize_activations for layer in quantized}
    if len(floats) + len(quantized) != len(layers) or len(modes) > 1:
        return None
    limit = few_row_limit(floats) if floats else QUANT_DECODE_ROWS
    if not limit:
        return None
    weights = tuple(layer.packed if isinstance(layer, QuantLinear) else layer.weight for layer in layers)
    return DecodeProjections(limit, floats[0].weight.dtype if floats else None, modes == {True}, weights)


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
    if isinstance(layer, FastLinear) or not isinstance(layer, nn.Linear):  # FastLinear or QuantLinear
        return layer.product(x, None)
    return F.linear(x, layer.weight)


def prepack_fast_linear(model: nn.Module, lane_order: bool = False) -> int:
    """Packs every FastLinear of the model for the panel kernel (see FastLinear.prepack); returns the bytes added."""
    return sum(m.prepack(lane_order) for m in model.modules() if isinstance(m, FastLinear))


def make_batch_invariant(model: nn.Module, why: str) -> list[str]:
    """For a model whose FastLinears were prepacked in lane order (or not packed at all): every row count then
    gives the same bits, because a layer without a packed copy takes the few-row kernel at any row count (slower
    past 16 rows, but in the one order). Logs that (`why`: the setting's origin) and warns of what it cannot
    cover; returns the names of the float linears left out (no few-row kernel for their dtype here: they run
    PyTorch's matmul, whose order depends on the batch size)."""
    from stateserve.layers.moe import ExpertMatrices
    from stateserve.quantization.linear import QuantLinear

    stray = []
    for name, m in model.named_modules():
        if hasattr(m, "batch_invariant"):  # an attention that pads its batch (latent_attention.py): one by one
            m.batch_invariant = True
        if isinstance(m, ExpertMatrices) and m.expert_matrices():  # not all of them quantized
            if m.few_row_product is not None:
                m.few_row_rows = 1 << 62
            else:
                stray.append(name + " (experts)")
        if not isinstance(m, FastLinear) or m.weight.is_meta:  # meta: another pipeline stage's layer
            continue
        if m.packed is None and m.routes is not None and m.routes.few_row is not None:
            m.max_rows = 1 << 62
        elif m.packed is None or not m.lane_order:
            stray.append(name)
    logger.info("Batch-invariant linears (%s): every float linear sums its outputs in one order at any batch size",
                why)
    if stray:
        logger.warning("batch_invariant: %d float linears (%s) have no few-row kernel for their dtype here and run "
                       "PyTorch's matmul, whose sums depend on the batch size", len(stray), ", ".join(stray[:3]))
    # the C++ block-quantized products sum each output in one order at any row count (csrc/quant_*.h's tile
    # contracts); their PyTorch fallback multiplies by a dequantized matrix, in the batch's order
    fallback = sum(1 for m in model.modules() if isinstance(m, QuantLinear) and any(k is None for k in m.kernels))
    if fallback:
        logger.warning("batch_invariant: the %d quantized projections without a C++ kernel here are not covered "
                       "(their PyTorch products sum in an order that depends on the batch size)", fallback)
    return stray


def install_fast_linear(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Turn the model's CPU nn.Linear layers of a float32 or bfloat16 model into FastLinear. Returns how many layers
    were converted (0 when neither the kernel nor oneDNN is available and the dtype is float32)."""
    routes = kernels.table(device).linear(dtype)
    if routes is None or (routes.few_row is None and routes.onednn is None and not routes.upcast):
        return 0
    if routes.upcast:  # no AVX-512 and no kernels: PyTorch's own bfloat16 matmul crawls there (~1 GFLOP/s)
        logger.warning("this CPU (%s) has no fast bfloat16 matmul: bfloat16 linears of %d rows or more compute in "
                       "float32 (converting the weight each call), fewer rows in bfloat16; dtype='float32' is "
                       "faster here", torch.backends.cpu.get_cpu_capability(), UPCAST_MIN_ROWS)
    from stateserve.layers.moe import ExpertMatrices

    count = 0
    for module in model.modules():
        if isinstance(module, ExpertMatrices) and routes.few_row is not None:
            module.few_row_product, module.few_row_rows = routes.few_row, routes.max_rows
        # exact type: subclasses of nn.Linear may carry their own forward
        if type(module) is nn.Linear and module.weight.dtype == dtype and module.weight.is_contiguous():
            module.__class__ = FastLinear
            module.routes = routes
            module.max_rows = routes.max_rows
            count += 1
    logger.debug("fast CPU linear on %d layers (kernel <= %d rows, oneDNN %s, float32 upcast %s)", count,
                 routes.max_rows, "beyond" if routes.onednn is not None else "off", "on" if routes.upcast else "off")
    return count
