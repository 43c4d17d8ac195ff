"""An additive attention-score bias that depends only on where a key lies relative to its query: T5's learned
relative position bias, passed to Attention.forward as `bias`.

The split of work: the model supplies `values` (relative positions -> per-head scores, e.g. a bucketed embedding
lookup); the attention layer, which owns the paged KV layout, decides which key and query positions a step
involves and asks for their scores here. The causal -inf mask is folded into the same tensor, as SDPA takes one
float mask. One PositionBias serves every layer of one step (the model builds a fresh one each forward), so a
score tensor is built by the first layer that needs it and reused by the rest."""
from __future__ import annotations

from typing import Callable, Hashable

import torch


class PositionBias:
    def __init__(self, values: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # values: relative positions (key - query) [..., Lk] long -> scores [..., Lk, H]
        self.values = values
        self._scores: dict[Hashable, torch.Tensor] = {}

    def scores(self, key: Hashable, relative: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
        """relative [..., Lq, Lk] -> float mask [..., H, Lq, Lk] in `dtype`, -inf where causal and the key lies
        after its query. `key` names the (sequence, role) these positions belong to within the step; a repeated
        key returns the tensor built the first time."""
        out = self._scores.get(key)
        if out is None:
            out = self.values(relative).to(dtype).movedim(-1, -3)
            if causal:
                out = out.masked_fill((relative > 0).unsqueeze(-3), float("-inf"))
            self._scores[key] = out
        return out
