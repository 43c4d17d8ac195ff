"""Tensor-parallel split rules of the moe layers (see distributed/sharding.py).

SparseMoE (and its subclasses with their own routers: KimiMoE, Lfm2MoeBlock), and NemotronH's MoE (non-gated
experts): every rank keeps every expert with its share of the expert's intermediate channels: gate_up rows (gate and
up alike) and down columns. The router stays whole (every rank routes the same tokens the same way), so each rank's
weighted sum over its experts is a partial sum of the layer's output. The shared expert is split the same way and
its down projection kept local (no all-reduce of its own): its partial product, scaled by the whole sigmoid gate,
adds to the routed one, and a forward hook sums the layer's output over the ranks: one all-reduce per MoE layer."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.distributed.group import ParallelGroup
from stateserve.distributed.sharding import (column_parallel, local_columns, rank_share, row_parallel, set_param,
                                             split_rule, take_rows)
from stateserve.layers.moe import SparseMoE


def _partial_linear(linear: nn.Linear, share: slice, group: ParallelGroup) -> nn.Linear:
    """local_columns(linear, share) whose partial products the caller sums over the ranks with others: its bias
    (if any) stays on rank 0 only, so the sum adds it once."""
    local = local_columns(linear, share)
    if linear.bias is not None:
        bias = linear.bias.data if group.rank == 0 else torch.zeros_like(linear.bias.data)
        local.bias = nn.Parameter(bias.clone(), requires_grad=False)
    return local


def _sum_output_over_ranks(module: nn.Module, group: ParallelGroup) -> None:
    """One all-reduce of the module's output: its ranks each computed a partial sum of it."""
    def hook(mod: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output.contiguous())

    module.register_forward_hook(hook)


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
        shared.down_proj = _partial_linear(shared.down_proj, part, group)
    _sum_output_over_ranks(moe, group)


split_rule(SparseMoE)(split_sparse_moe)


def split_nemotron_mlp(mlp: nn.Module, group: ParallelGroup) -> None:
    """NemotronH's non-gated MLP: up_proj column-parallel, down_proj row-parallel."""
    share = rank_share(mlp.up_proj.out_features, group, "NemotronH intermediate_size")
    column_parallel(mlp.up_proj, [share])
    mlp.down_proj = row_parallel(mlp.down_proj, group, share)


def split_nemotron_moe(moe: nn.Module, group: ParallelGroup) -> None:
    """NemotronH's MoE: each non-gated expert's intermediate split (up rows, down columns), the shared MLP too; the
    router and the latent projections stay whole (the latent fc2 is linear, so it may take the partial sum: its
    bias stays on rank 0); one all-reduce of the layer's output."""
    if moe.expert_products is not None:
        raise ValueError("tensor parallelism takes float expert matrices")
    E, I, D = moe.num_experts, moe.intermediate, moe.expert_dim
    share = rank_share(I, group, "NemotronH moe_intermediate_size")
    li = share.stop - share.start
    set_param(moe, "experts_up", take_rows(moe.experts_up.data, [I] * E, [share] * E), [li] * E)
    set_param(moe, "experts_down", moe.experts_down.data[:, share], [D] * E)
    moe.intermediate = li
    shared = moe.shared_experts
    part = rank_share(shared.up_proj.out_features, group, "NemotronH moe_shared_expert_intermediate_size")
    column_parallel(shared.up_proj, [part])
    shared.down_proj = _partial_linear(shared.down_proj, part, group)
    if isinstance(moe.fc2_latent_proj, nn.Linear) and moe.fc2_latent_proj.bias is not None and group.rank:
        moe.fc2_latent_proj.bias.data.zero_()
    _sum_output_over_ranks(moe, group)


def _register_nemotron() -> None:
    from stateserve.models.nemotron_h import NemotronHMLP, NemotronHMoE

    split_rule(NemotronHMLP)(split_nemotron_mlp)
    split_rule(NemotronHMoE)(split_nemotron_moe)


_register_nemotron()
