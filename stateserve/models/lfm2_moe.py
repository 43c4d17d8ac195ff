"""Lfm2-MoE: LFM2 (models/lfm2.py: short-conv and attention layers, same names and arithmetic) whose feed-forwards
are sparse mixtures of experts after the first `num_dense_layers`, as transformers' Lfm2MoeForCausalLM defines it.

The router (transformers' Lfm2MoeTopKRouter) scores experts with sigmoid(x W^T); with use_expert_bias it picks the
top k by score + expert_bias (a per-expert float32 vector, the load balancer's) but weights them by the plain
scores; with norm_topk_prob the k weights are divided by their sum + 1e-6; all are times routed_scaling_factor.
Experts are SwiGLU (silu). The dense layers are LFM2's MLP at intermediate_size, unadjusted; the experts are
moe_intermediate_size wide. transformers saves the experts per expert (experts.N.w1 / w3 / w2, its original
format; its in-memory 3-D experts.gate_up_proj / down_proj are split per expert on load by expand_weight) and
the router as `gate.weight`; SparseMoE maps both."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stateserve.layers.decoder_layer import GatedMLP
from stateserve.layers.moe import SparseMoE
from stateserve.models.lfm2 import Lfm2ForCausalLM


class Lfm2MoeBlock(SparseMoE):
    """SparseMoE with LFM2-MoE's sigmoid router: forward(x [T, H]) -> [T, H]."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(int(cfg.num_experts), int(cfg.num_experts_per_tok), cfg.hidden_size,
                         int(cfg.moe_intermediate_size), norm_topk_prob=bool(cfg.norm_topk_prob), activation="silu")
        self.use_expert_bias = bool(getattr(cfg, "use_expert_bias", True))
        self.routed_scaling_factor = float(getattr(cfg, "routed_scaling_factor", 1.0))
        # a checkpoint tensor (a buffer in transformers), so a parameter here: the strict loader fills parameters
        self.expert_bias = (nn.Parameter(torch.zeros(self.num_experts), requires_grad=False)
                            if self.use_expert_bias else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        scores = torch.sigmoid(self.router(x))  # [T, E] in x's dtype, as transformers computes them
        if self.expert_bias is not None:
            ids = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices  # the bias only picks
            weights = scores.gather(1, ids)
        else:
            weights, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return (weights * self.routed_scaling_factor).to(x.dtype), ids


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    fused_experts = "gated"  # 3-D fused expert tensors load too, split per expert (ModelBase.expand_weight)

    def make_feed_forward(self, cfg: Any, index: int) -> nn.Module:
        if index < int(getattr(cfg, "num_dense_layers", 0)):
            return GatedMLP(cfg.hidden_size, int(cfg.intermediate_size))
        return Lfm2MoeBlock(cfg)
