"""Load-time weight quantization (EngineConfig.quantization): the model's dense projections become QuantLinear
layers holding llama.cpp's Q8_0 codes, right after the checkpoint is read.

Which layers: every nn.Linear whose in_features is a multiple of the 32-value block, except MoE routers (a few
columns that pick experts: kept exact, as llama.cpp keeps them) and a head that shares its weight with the
embedding (quantizing it would add a copy beside the float embedding; an untied head is quantized, at 8 bits).
Never conv1d weights, A_log, D, dt_bias, norms or recurrent state: those are not nn.Linear. MoE experts' stacked
matrices stay in the model dtype for now."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from stateserve.quantization import q8_0

logger = logging.getLogger("stateserve")
METHODS = ("int8", "int8_weight_only")
_KEEP_NAMES = ("router",)  # our MoE layers' expert pickers


@dataclass(frozen=True)
class QuantSummary:
    method: str
    layers: int  # linears quantized
    kept: int  # linears left in the model dtype
    weight_bytes: int  # bytes of the quantized layers' packed weights

    def describe(self) -> str:
        return f"{self.method} (Q8_0): {self.layers} linears, {self.weight_bytes / 2**30:.4f} GiB; {self.kept} kept " \
               "in the model dtype"


def _kernels(device: torch.device) -> object | None:
    from stateserve.platform import cpu_kernels

    module = cpu_kernels.load() if device.type == "cpu" else None
    supported = getattr(module, "q8_0_supported", None)
    return module if supported is not None and supported() else None


def quantize_model(model: nn.Module, method: str, device: torch.device) -> QuantSummary:
    """Replaces the model's eligible nn.Linear layers by QuantLinear, in place."""
    from stateserve.quantization.linear import QuantLinear

    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization={method!r} runs on CPU only; got device {device}")
    kernels = _kernels(device)
    if kernels is None:
        logger.warning("quantization=%s without the C++ int8 kernels: the products run in PyTorch, far slower",
                       method)
    owners: dict[int, int] = {}  # data_ptr -> how many parameters hold it (tied weights)
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    layers = kept = size = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            eligible = child.in_features % q8_0.BLOCK == 0 and name not in _KEEP_NAMES \
                and owners.get(child.weight.data_ptr(), 0) == 1
            if not eligible:
                kept += 1
                continue
            codes, scales = q8_0.quantize(child.weight)
            layer = QuantLinear(codes, scales, child.bias, method == "int8", kernels)
            setattr(parent, name, layer)
            layers += 1
            size += layer.weight_bytes
    return QuantSummary(method, layers, kept, size)


def gguf_quantization(checkpoint: object, dtype: torch.dtype) -> str | None:
    """The load-time quantization that keeps a GGUF file's linears as they are stored: "int8" for Q8_0 (its codes
    come back exactly), None for float files; other types are dequantized to the model dtype, which the log says."""
    fmt = checkpoint.linear_format()  # type: ignore[attr-defined]
    if fmt == "Q8_0":
        return "int8"
    if fmt != "float":
        logger.warning("%s: linear weights of type(s) %s are dequantized to %s (kernels for them are not built yet; "
                       "Q8_0 files stay quantized)", checkpoint.path, fmt, dtype)  # type: ignore[attr-defined]
    return None


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating parameter and buffer to dtype, except the quantized layers' codes and scales."""
    from stateserve.quantization.linear import QuantLinear

    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        if isinstance(module, QuantLinear):
            continue
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                setattr(module, name, b.to(dtype))
