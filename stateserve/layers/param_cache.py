"""Float32 copies of small parameters that a decode step's kernels read in float32 (step-size biases, D skips,
norm weights): converting them on every call cost a copy each (a few microseconds, as much as the kernel's own
work for one token), so each is made once per weight version and reused."""
from __future__ import annotations

import torch
from torch import nn


def float32_copy(owner: nn.Module, name: str) -> torch.Tensor:
    """owner.<name> as a contiguous float32 tensor (the parameter itself when it already is one). The copy is
    remade when the parameter is written in place (its version changes) or replaced (its storage changes)."""
    param = getattr(owner, name)
    if param.dtype == torch.float32 and param.is_contiguous():
        return param.detach()
    cache: dict[str, tuple[tuple[int, int], torch.Tensor]] = owner.__dict__.setdefault("_float32_copies", {})
    key = (param._version, param.data_ptr())
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = (key, param.detach().float().contiguous())
        cache[name] = hit
    return hit[1]
