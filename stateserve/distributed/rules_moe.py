"""Tensor-parallel split rules of the moe layers (see distributed/sharding.py).

SparseMoE (and its subclasses with their own routers: KimiMoE, Lfm2MoeBlock): every rank keeps every expert with
its share of the expert's intermediate channels: gate_up rows (gate and up alike) and down columns. The router stays
whole (every rank routes the same tokens the same way), so each rank's weighted sum over its experts is a partial
sum of the layer's output. The shared expert is split the same way and its down projection kept local (no
all-reduce of its own): its partial product, scaled by the whole sigmoid gate, adds to the routed one, and a
forward hook sums the layer's output over the ranks: one all-reduce per MoE layer."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import column_parallel, rank_share, set_param, split_rule, take_rows
from stateserve.layers.moe import SparseMoE


def _local_columns(linear: nn.Linear, share: slice) -> nn.Linear:
    """A plain linear of the input columns `share` (no bias: the partial products are summed by the caller)."""
    if linear.bias is not None:
        raise ValueError("a shared expert's down projection with a bias cannot be split")
    weight = linear.weight.data[:, share].contiguous()
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    local.weight = nn.Parameter(weight, requires_grad=False)
    return local


def split_sparse_moe(moe: SparseMoE, group: ParallelGroup) -> None:
    if moe.expert_products is not None:
        raise ValueError("tensor parallelism takes float expert matrices")
    E, I, H = moe.num_experts, moe.intermediate_size, moe.hidden_size
    share = rank_share(I, group, "moe intermediate_size (per expert)")
    li = share.stop - share.start
    gate_up, down = moe.experts_gate_up.data, moe.experts_down.data
    if moe.checkpoint_format == "fused":  # [E, 2I, H] (gate rows first), [E, H, I]
        set_param(moe, "experts_gate_up", gate_up.view(E, 2, I, H)[:, :, share].reshape(E, 2 * li, H), None)
        set_param(moe, "experts_down", down[:, :, share], None)
    else:  # [E * 2I, H] with one shard per expert matrix, [E * H, I]
        set_param(moe, "experts_gate_up", take_rows(gate_up, [I] * (2 * E), [share] * (2 * E)), [li] * (2 * E))
        set_param(moe, "experts_down", down[:, share], [H] * E)
    moe.intermediate_size = li
    shared = moe.shared_expert
    if shared is not None:  # gate_up [gate; up] column-parallel, down the rank's columns, summed with the rest
        inter = shared.down_proj.in_features
        part = rank_share(inter, group, "shared expert intermediate_size")
        column_parallel(shared.gate_up_proj, [part, part], [inter, inter])
        shared.down_proj = _local_columns(shared.down_proj, part)

    def sum_over_ranks(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output.contiguous())

    moe.register_forward_hook(sum_over_ranks)


split_rule(SparseMoE)(split_sparse_moe)
