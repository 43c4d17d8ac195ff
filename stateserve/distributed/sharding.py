"""Splitting a loaded model across tensor-parallel ranks.

Each layer kind has a split rule (distributed/rules_*.py, registered with `@split_rule(LayerClass)`): it keeps this
rank's share of the layer's heads, channels or experts, and turns the projections that contract over the split
dimension into `RowParallelLinear`s, which sum the ranks' partial products (one all-reduce each). A layer without
a rule runs whole on every rank (the same result, computed on each), so every model runs under tensor parallelism
and the split rules decide how much of it is shared out; the load log says what stays whole.

Helpers for the rules: `rank_share` (this rank's contiguous piece of n), `share_or_replica` (the same, or the one
thing of fewer than the ranks that this rank reads), `head_rows` (a share of heads as rows), `take_rows` (the rank's
slice of a parameter, part by part for a stacked one such as qkv), `column_parallel`, `row_parallel`,
`local_columns` (a linear of the rank's input columns, summed by the caller) and `conv_channels`."""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.layers.markers import stacked

logger = logging.getLogger("stateserve")

_RULES: dict[type, Callable[[nn.Module, ParallelGroup], None]] = {}
# modules of these files register their rules when imported (lazily, at the first split)
_RULE_MODULES = ("stateserve.distributed.rules_attention", "stateserve.distributed.rules_recurrent",
                 "stateserve.distributed.rules_moe", "stateserve.distributed.rules_latent")


class TensorParallelError(ValueError):
    """A model whose sizes cannot be split over the ranks (a head count that does not divide, say)."""


def split_rule(*classes: type) -> Callable:
    """Register `fn(layer, group)` as the split rule of these layer classes (exact class, then its bases)."""
    def register(fn: Callable[[nn.Module, ParallelGroup], None]) -> Callable:
        for cls in classes:
            _RULES[cls] = fn
        return fn
    return register


def _rule_for(module: nn.Module) -> Callable | None:
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def rank_share(n: int, group: ParallelGroup, what: str) -> slice:
    """This rank's contiguous share of n things (heads, channels, experts); n must divide by the group size."""
    if n % group.size:
        raise TensorParallelError(f"{what}={n} is not divisible by tensor_parallel_size={group.size}")
    part = n // group.size
    return slice(group.rank * part, (group.rank + 1) * part)


def share_or_replica(n: int, group: ParallelGroup, what: str) -> slice:
    """This rank's share of n things read by its heads (KV heads, B/C groups): n / N of them when they divide,
    else, with fewer than the ranks, the one thing ranks [i * N / n, (i + 1) * N / n) share (replicated on them)."""
    if n % group.size == 0:
        return rank_share(n, group, what)
    if group.size % n:
        raise TensorParallelError(f"{what}={n} is neither a multiple nor a divisor of "
                                  f"tensor_parallel_size={group.size}")
    i = group.rank * n // group.size
    return slice(i, i + 1)


def head_rows(share: slice, width: int) -> slice:
    """A share of heads (or groups, channels) -> its rows when each has `width` rows."""
    return slice(share.start * width, share.stop * width)


def take_rows(t: torch.Tensor, parts: list[int], shares: list[slice]) -> torch.Tensor:
    """Dim 0 of t is made of `parts` stacked; keep `shares[i]` of part i (indices within the part), in order."""
    pieces, start = [], 0
    for size, share in zip(parts, shares):
        pieces.append(t[start:start + size][share])
        start += size
    if start != t.shape[0]:
        raise ValueError(f"parts {parts} do not add up to the tensor's {t.shape[0]} rows")
    return torch.cat(pieces).contiguous()


def set_param(module: nn.Module, name: str, value: torch.Tensor, shard_sizes: list[int] | None = None) -> None:
    """Replace module.<name> by a frozen parameter holding `value` (contiguous), `stacked` with shard_sizes when
    given (the loader's marker; a split model is loaded already, so only a split rule reads it back)."""
    param = nn.Parameter(value.contiguous(), requires_grad=False)
    setattr(module, name, param if shard_sizes is None else stacked(param, shard_sizes))


def column_parallel(linear: nn.Linear, shares: list[slice], parts: list[int] | None = None) -> None:
    """Keep the output rows (weight rows, bias entries) of this rank: `shares[i]` of each stacked part i (parts:
    the stacked sizes, default one part of all rows). The layer's `stacked` marker follows the new sizes."""
    parts = parts or [linear.out_features]
    sizes = [len(range(size)[share]) for size, share in zip(parts, shares)]
    set_param(linear, "weight", take_rows(linear.weight.data, parts, shares), sizes)
    if linear.bias is not None:
        set_param(linear, "bias", take_rows(linear.bias.data, parts, shares), sizes)
    linear.out_features = linear.weight.shape[0]


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r.T, plus the bias once: a linear whose input features are split (each rank
    holds the columns of its share and gets only those features). `local` is a plain nn.Linear of the rank's
    columns (the runner gives it the CPU kernels like any other); the bias stays here, added after the sum. No
    fused decode kernel takes this module (they would skip the sum), so layers holding one run op by op."""

    def __init__(self, local: nn.Linear, bias: torch.Tensor | None, group: ParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.in_features, self.out_features = local.in_features, local.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.local.weight

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = self.local(x)
        # partial products of a narrower dtype are summed in float32: one rounding, as one rank's product has
        out = self.group.all_reduce(out.float()).to(out.dtype) if out.dtype != torch.float32 else \
            self.group.all_reduce(out.contiguous())
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


def local_columns(linear: nn.Linear, share: slice | list[slice], parts: list[int] | None = None) -> nn.Linear:
    """A plain linear (no bias) of the input columns of this rank's share (per stacked part of the input, as
    column_parallel does for outputs): its products are partial sums the caller adds up over the ranks."""
    parts = parts or [linear.in_features]
    shares = share if isinstance(share, list) else [share]
    weight = take_rows(linear.weight.data.t(), parts, shares).t().contiguous()
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    local.weight = nn.Parameter(weight, requires_grad=False)
    return local


def row_parallel(linear: nn.Linear, group: ParallelGroup, share: slice | list[slice],
                 parts: list[int] | None = None) -> RowParallelLinear:
    """A RowParallelLinear over local_columns(linear, share, parts), summing over the ranks, the bias once."""
    return RowParallelLinear(local_columns(linear, share, parts), None if linear.bias is None else linear.bias.data,
                             group)


def conv_channels(conv: nn.Conv1d, parts: list[int], shares: list[slice]) -> None:
    """Keep a depthwise conv's channels (weight [C, 1, K], bias [C]) of this rank, part by part."""
    set_param(conv, "weight", take_rows(conv.weight.data, parts, shares))
    if conv.bias is not None:
        set_param(conv, "bias", take_rows(conv.bias.data, parts, shares))
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]


def rule_owners(model: nn.Module) -> list[str]:
    """Names of the modules a split rule applies to, outermost first (a rule owns the modules under it)."""
    import importlib

    for name in _RULE_MODULES:
        importlib.import_module(name)
    owners: list[str] = []
    for name, module in model.named_modules():
        if not any(name.startswith(prefix + ".") for prefix in owners) and _rule_for(module) is not None:
            owners.append(name)
    return owners


def split_module(model: nn.Module, name: str, group: ParallelGroup) -> None:
    """Apply the split rule of one of rule_owners(model)."""
    module = model.get_submodule(name)
    _rule_for(module)(module, group)  # type: ignore[misc]


class SplitRMSNorm(nn.Module):
    """An RMSNorm over features split across the ranks (lightning attention's norm over all heads, OLMo Hybrid's q/k
    norms): each rank normalises its slice by the mean square of all of them (one all-reduce of a float32 per row),
    times its slice of the weight. `replicas`: on how many ranks each of this rank's features lives (features
    replicated with fewer KV heads than ranks count once). Rounding as layers/norm.RMSNorm (normalised in float32,
    cast, times the weight), or with weight_first as OLMo's norm (times the weight in float32, then cast)."""

    def __init__(self, weight: torch.Tensor, total: int, eps: float, group: ParallelGroup, replicas: int = 1,
                 weight_first: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.total, self.eps, self.group = total, eps, group
        self.replicas, self.weight_first = replicas, weight_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, local] -> [T, local]
        xf = x.float()
        squares = xf.pow(2).sum(-1, keepdim=True)
        if self.replicas > 1:
            squares = squares / self.replicas
        normed = xf * torch.rsqrt(self.group.all_reduce(squares.contiguous()) / self.total + self.eps)
        return (self.weight * normed).to(x.dtype) if self.weight_first else self.weight * normed.to(x.dtype)


def split_model(model: nn.Module, group: ParallelGroup, vocab_size: int, already: tuple[str, ...] = ()) -> bool:
    """Apply every layer's split rule (rule_owners; `already`: those split as they were loaded, distributed/load.py),
    split the vocabulary (distributed/vocab.py) and log what stays whole on every rank. Returns whether the
    vocabulary was split (the logits then come from every rank)."""
    from stateserve.distributed.vocab import split_vocab

    rest = [name for name in rule_owners(model) if name not in already]
    for name in rest:
        split_module(model, name, group)
    done = list(already) + rest
    if not done:
        raise TensorParallelError(f"{type(model).__name__} has no layer that tensor parallelism can split")
    vocab_split = split_vocab(model, vocab_size, group)
    split = {id(p) for prefix in done for p in model.get_submodule(prefix).parameters()}
    if vocab_split:
        split |= {id(model.lm_head.weight)} | {id(m.weight) for m in model.modules()
                                              if type(m).__name__ == "VocabParallelEmbedding"}
    whole = sum(p.numel() for p in model.parameters() if id(p) not in split)
    total = sum(p.numel() for p in model.parameters())
    kinds = sorted({type(model.get_submodule(n)).__name__ for n in done})
    logger.info("Tensor parallel rank %d/%d: split %d layers (%s) and %s; %.1f%% of this rank's weights are "
                "whole on every rank (norms, layers without a split rule%s)", group.rank, group.size, len(done),
                ", ".join(kinds), "the vocabulary" if vocab_split else "not the vocabulary",
                100.0 * whole / max(total, 1), "" if vocab_split else ", the embedding and the head")
    return vocab_split
