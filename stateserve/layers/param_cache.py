"""Tensors derived from a module's parameters that a decode step's kernels read in another form (float32 step-size
biases, D skips and norm weights, -exp(A_log), transposed conv taps): computing them on every call cost a copy or
a few ops each (a few microseconds, as much as a kernel's own work for one token), so each is made once per
weight version and reused."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def derived(owner: nn.Module, name: str, sources: tuple[torch.Tensor | None, ...], make: Callable[[], Any]) -> Any:
    """`make()`, cached on `owner` under `name` until one of `sources` (the parameters it is made from; None for an
    absent one) is written in place (its version changes) or replaced (its storage changes)."""
    key = tuple(None if t is None else (t._version, t.data_ptr()) for t in sources)
    cache: dict[str, tuple[tuple, Any]] = owner.__dict__.setdefault("_derived_params", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = (key, make())
        cache[name] = hit
    return hit[1]


def float32_copy(owner: nn.Module, name: str) -> torch.Tensor:
    """owner.<name> as a contiguous float32 tensor (the parameter itself when it already is one)."""
    return dtype_copy(owner, name, torch.float32)


def dtype_copy(owner: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """owner.<name> as a contiguous tensor of `dtype` (the parameter itself when it already is one)."""
    param = getattr(owner, name)
    if param.dtype == dtype and param.is_contiguous():
        return param.detach()
    return derived(owner, f"{dtype} {name}", (param,), lambda: param.detach().to(dtype).contiguous())


def _parameter_slots(module: nn.Module) -> list[tuple[dict, str]]:
    """(the owning module's parameter dict, name) of every parameter of `module` and its submodules."""
    slots = [(module._parameters, name) for name, p in module._parameters.items() if p is not None]
    for child in module._modules.values():
        if child is not None:
            slots.extend(_parameter_slots(child))
    return slots


def derived_from_module(owner: nn.Module, name: str, make: Callable[[], Any]) -> Any:
    """`derived` keyed on every parameter of `owner` and its submodules: for what a fused kernel call takes from a
    whole layer (its weights in the kernel's forms), made once per weight version of any of them. Checked at every
    decode step of every layer, so the walk over the submodules is made once (at the first call, after loading):
    a parameter written in place or replaced is seen, a submodule or parameter added or removed later is not."""
    slots = owner.__dict__.get("_parameter_slots")
    if slots is None:
        slots = owner.__dict__["_parameter_slots"] = _parameter_slots(owner)
    return derived(owner, name, tuple(params[key] for params, key in slots), make)
